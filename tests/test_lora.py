"""LoRA adapters (modeling/lora.py, `model.lora`): every path that runs the towers sees them, zero adapters are the
frozen model exactly, only adapters and heads train, the export merges them, DDP parity, refusals."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import lightning as L
import open_clip
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor

from core.config import REPO_ROOT
from modeling.encoders import CLIPEncoders, build_model
from datamodules.inputs import InputError
from lightning_modules import load_run_config
from lightning_modules.base import total_loss
from lightning_modules.fit import build_module, check_inputs, run
from modeling.attribution import (ATTRIBUTIONS, AttributionOptions, TextAttributionInputs, image_grad_eclip_grid,
                                  text_attribution, word_end_table)
from modeling.long_context import stretch_text_context
from modeling.lora import (adapter_layers, add_lora, adapted_module_names, has_adapters, lora_setting_problems, merged,
                           tower_shapes)
from fitting import TINY, StopAfter, a_batch, exported_state, method_overrides, tiny_config
from tolerance import assert_scaled_close, scaled_close

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "towers": ["image", "text"], "layers": None,
        "targets": ["out_proj", "c_fc", "c_proj"]}
# The tiny test models have random weights: adapters on them are refused unless asked for.
RANDOM_BACKBONE = "model.lora.allow_random_backbone=true"
LORA_OVERRIDES = ["model.lora.rank=4", "model.lora.alpha=8", RANDOM_BACKBONE]
CAPTIONS = ["a red square left of a blue circle", "a small green triangle above a big yellow square",
            "two circles"]
# The tiny text tower's context stretched as Long-CLIP does (77 -> 2 x 77 - 20 positions).
LONG_CONTEXT, KEEP = 134, 20


# ----- every path that runs the towers -------------------------------------------------------------------------
def traced_text(encoders: CLIPEncoders, x) -> TextAttributionInputs:
    """As CLIP-CAE encodes the text: the token embeddings a graph leaf (the adapted model's are frozen)."""
    text = encoders.encode_text(x.ids, attn=True, embeddings_as_leaf=True)
    return TextAttributionInputs(encoders, x.ids, x.image, text, x.word_ends)


def recomputing(encode: Callable) -> Callable:
    """A path run with the towers recomputing their MLP activations in the backward (MACCO's setting)."""
    def path(encoders: CLIPEncoders, x) -> List[Tensor]:
        encoders.recompute_activations = True
        try:
            return encode(encoders, x)
        finally:
            encoders.recompute_activations = False
    return path


def continuations(encoders: CLIPEncoders, x) -> List[Tensor]:
    """Each caption's copy with its second token replaced, run from that token on (perturbation's path)."""
    source = encoders.encode_text(x.ids, keep_block_inputs=True)
    perturbed = x.ids.clone()
    perturbed[:, 1] = 320
    start = torch.ones(len(x.ids), dtype=torch.long)
    return [encoders.encode_text_continuations(perturbed, start, torch.arange(len(x.ids)), source.block_inputs)]


def attribution(name: str) -> Callable:
    options = AttributionOptions(eclip_layers=2, replacement="token", renormalise=False)
    return lambda encoders, x: [text_attribution(name, traced_text(encoders, x), options)]


PATHS: Dict[str, Callable] = {
    "image": lambda e, x: [(f := e.encode_image(x.images)).pooled, f.patches],
    "image_traced": lambda e, x: [(f := e.encode_image(x.images, attn=True)).pooled, f.traces[-1].context],
    "image_recomputing": recomputing(lambda e, x: [e.encode_image(x.images).pooled]),
    "text": lambda e, x: [(f := e.encode_text(x.ids)).pooled, f.tokens],
    "text_traced": lambda e, x: [(f := e.encode_text(x.ids, attn=True)).pooled, *f.attentions],
    "text_trimmed_block_inputs": lambda e, x: [(f := e.encode_text(x.ids, trim=True, keep_block_inputs=True)).pooled,
                                               *f.block_inputs],
    "text_recomputing": recomputing(lambda e, x: [e.encode_text(x.ids).pooled]),
    "text_continuations": continuations,
    **{f"attribution_{name}": attribution(name) for name in ATTRIBUTIONS},
    "image_grad_eclip": lambda e, x: list(image_grad_eclip_grid(e, x.images, x.text)),
}


class Inputs:
    def __init__(self, built, ids: Tensor):
        generator = torch.Generator().manual_seed(1)
        size = built.model.visual.image_size
        self.images = torch.randn(len(ids), 3, *((size,) * 2 if isinstance(size, int) else size), generator=generator)
        self.ids = ids
        self.image = F.normalize(torch.randn(len(ids), built.model.visual.output_dim, generator=generator), dim=-1)
        self.text = self.image.flip(0)
        self.word_ends = word_end_table(built.tokenizer, built.model.vocab_size)


def tiny_pair(long_context: bool, lora: dict = LORA):
    """(frozen encoders, encoders of the same weights with zero-initialised adapters, inputs), in training mode."""
    torch.manual_seed(0)
    built = build_model(TINY, None, "configs/models")
    if long_context:
        built = stretch_text_context(built, LONG_CONTEXT, KEEP, torch.float32)
    frozen = copy.deepcopy(built.model)
    adapted = add_lora(built.model, lora)
    return CLIPEncoders(frozen).train(), CLIPEncoders(adapted).train(), Inputs(built, built.tokenizer(CAPTIONS))


@pytest.fixture(scope="module", params=[False, True], ids=["context77", "long_context"])
def pair(request):
    return tiny_pair(request.param)


def randomise_adapters(model: torch.nn.Module, seed: int = 2, std: float = 0.05) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in adapter_layers(model):
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * std)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_zero_adapters_leave_every_path_exactly_the_frozen_model(pair, path):
    frozen, adapted, x = pair
    assert all((layer.lora_B["default"].weight == 0).all() for _, layer in adapter_layers(adapted.model))
    for got, expected in zip(PATHS[path](adapted, x), PATHS[path](frozen, x), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_adapters_reach_every_path(pair, path):
    """With trained (random) adapters every path of the adapted model equals the same path of the plain model with
    the adapters merged into its weights (a path that skipped one adapter would not), and moves away from the
    frozen one."""
    frozen, adapted, x = pair
    trained = copy.deepcopy(adapted.model)
    randomise_adapters(trained)
    lora_encoders, merged_encoders = CLIPEncoders(trained).train(), CLIPEncoders(merged(trained)).train()
    assert not has_adapters(merged_encoders.model)
    outputs = PATHS[path](lora_encoders, x)
    for got, expected in zip(outputs, PATHS[path](merged_encoders, x), strict=True):
        assert_scaled_close(got, expected, 1e-4)
    # the first block's attention comes before any adapter: the path's first output (its result) moves
    assert not scaled_close(outputs[0], PATHS[path](frozen, x)[0], 1e-3)


@pytest.mark.parametrize("target", ["out_proj", "c_fc", "c_proj"])
def test_each_target_alone_moves_both_towers(target):
    frozen, adapted, x = tiny_pair(False, {**LORA, "targets": [target]})
    randomise_adapters(adapted.model)
    with torch.no_grad():
        for encode in (PATHS["image"], PATHS["text"]):
            moved, kept = encode(adapted, x)[0], encode(frozen, x)[0]
            assert not scaled_close(moved, kept, 1e-3)
            assert_scaled_close(moved, encode(CLIPEncoders(merged(adapted.model)).train(), x)[0], 1e-4)


def test_open_clip_forward_of_the_merged_copy_matches_the_adapted_encoders():
    """The scorers run open_clip's own encode_image / encode_text: on the merged copy they see every adapter."""
    _, adapted, x = tiny_pair(False)
    randomise_adapters(adapted.model)
    plain = merged(adapted.model).eval()
    adapted.eval()
    with torch.no_grad():
        assert_scaled_close(plain.encode_image(x.images), adapted.encode_image(x.images).pooled, 1e-5)
        assert_scaled_close(plain.encode_text(x.ids), adapted.encode_text(x.ids).pooled, 1e-5)


def test_towers_and_layers_choose_the_adapted_layers():
    built = build_model(TINY, None, "configs/models")
    names = adapted_module_names(built.model, {**LORA, "towers": ["text"], "layers": [-1], "targets": ["c_fc"]})
    assert names == ["transformer.resblocks.1.mlp.c_fc"]
    add_lora(built.model, {**LORA, "towers": ["image"], "layers": [0]})
    adapted = sorted(name for name, _ in adapter_layers(built.model))
    assert adapted == ["visual.transformer.resblocks.0.attn.out_proj", "visual.transformer.resblocks.0.mlp.c_fc",
                       "visual.transformer.resblocks.0.mlp.c_proj"]
    assert not any(p.requires_grad for name, p in built.model.named_parameters() if "lora_" not in name)


# ----- training: the optimizer, gradients, export ---------------------------------------------------------------
@pytest.mark.parametrize("method,precision", [(name, "32-true") for name in ("clip_ft", "clip_cae", "macco",
                                                                                 "smartclip")]
                         + [("clip_ft", "bf16-mixed"), ("macco", "bf16-mixed")])
def test_fast_dev_run_of_every_method_with_adapters(shapes_root, mask_cache, tmp_path, method, precision):
    cfg = tiny_config(shapes_root, tmp_path, *method_overrides(method, mask_cache), *LORA_OVERRIDES,
                      "trainer.fast_dev_run=2", f"trainer.precision={precision}")
    trainer = run(cfg)
    assert trainer.global_step == 2
    assert has_adapters(trainer.lightning_module.clip)
    assert (tmp_path / "demo_pretrain" / "export" / "open_clip.pt").is_file()


@pytest.mark.parametrize("method", ["clip_ft", "clip_cae", "macco", "smartclip"])
def test_the_optimizer_sees_only_adapters_and_the_method_heads(shapes_root, mask_cache, tmp_path, method):
    cfg = tiny_config(shapes_root, tmp_path, *method_overrides(method, mask_cache), *LORA_OVERRIDES)
    L.seed_everything(0)
    module = build_module(cfg).train()
    adapters = {id(p) for name, p in module.clip.named_parameters() if "lora_" in name}
    heads = {id(p) for _, p in module.head_parameters()}
    optimised = {id(p) for group in module.param_groups() for p in group["params"]}
    assert adapters and optimised == adapters | heads
    assert not module.clip.logit_scale.requires_grad
    randomise_adapters(module.clip)  # lora_B = 0 at the start leaves lora_A without a gradient
    terms, _ = module.compute_terms(a_batch(module, cfg))
    total_loss(terms).backward()
    for name, param in module.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_macco_predictor_inputs_see_the_adapters(shapes_root, mask_cache, tmp_path):
    """MACCO's four tower forwards (recomputing activations) feed its predictors: exactly the frozen model's with
    zero adapters, the merged model's with trained ones."""
    cfg = tiny_config(shapes_root, tmp_path, *method_overrides("macco", mask_cache), *LORA_OVERRIDES)
    L.seed_everything(0)
    module = build_module(cfg).train()
    batch = a_batch(module, cfg)

    def outputs(model) -> List[Tensor]:
        own = module.encoders
        module.encoders = CLIPEncoders(model, recompute_activations=True)
        try:
            out = module.macco_forward(batch)
        finally:
            module.encoders = own
        return [out.text.tokens, out.masked_text.pooled, out.image.patches, out.masked_image.pooled,
                out.text_predictor_features, out.pixel_predictions]

    for got, expected in zip(outputs(module.clip), outputs(merged(module.clip)), strict=True):
        assert torch.equal(got, expected)
    randomise_adapters(module.clip)
    for got, expected in zip(outputs(module.clip), outputs(merged(module.clip)), strict=True):
        assert_scaled_close(got, expected, 1e-4)


def test_export_merges_the_adapters_into_a_plain_open_clip_checkpoint(shapes_root, tmp_path):
    cfg = tiny_config(shapes_root, tmp_path, *LORA_OVERRIDES, "trainer.max_steps=3", "optim.lr=1e-2")
    module = run(cfg).lightning_module.eval()
    export_dir = tmp_path / "demo_pretrain" / "export"
    meta = json.loads((export_dir / "model.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["backbone"]["name"] == TINY and "lora" not in meta["backbone"]
    state = exported_state(tmp_path / "demo_pretrain")
    plain = module.plain_clip()
    assert list(state) == list(plain.state_dict()) == list(open_clip.create_model(TINY).state_dict())
    open_clip.add_model_config(export_dir / "model_configs")
    model, _, _ = open_clip.create_model_and_transforms(meta["model"], pretrained=str(export_dir / "open_clip.pt"))
    model.eval().requires_grad_(False)  # as frozen as the merged copy: nn.MultiheadAttention picks its kernel by it
    ids = module.tokenizer(CAPTIONS)
    images = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model.encode_image(images), plain.eval().encode_image(images))
        assert torch.equal(model.encode_text(ids), plain.encode_text(ids))
        assert_scaled_close(model.encode_image(images), module.encoders.encode_image(images).pooled, 1e-5)
        assert_scaled_close(model.encode_text(ids), module.encoders.encode_text(ids).pooled, 1e-5)
    assert all(torch.equal(state[key], value) for key, value in plain.state_dict().items())
    # the adapters trained: the merged layers moved, nothing else did (the backbone is rebuilt from the same seed)
    L.seed_everything(cfg.seed)
    start = build_module(cfg).plain_clip().state_dict()
    changed = {key for key in state if not torch.equal(state[key], start[key])}
    assert changed and all(key.endswith(("out_proj.weight", "c_fc.weight", "c_proj.weight")) for key in changed)


def test_a_run_with_adapters_resumes_to_the_uninterrupted_weights(shapes_root, tmp_path):
    """Stopped at step 3 of 6, then the same command again, against 6 straight: the adapters and their optimizer
    state come back from last.ckpt; a rerun with another rank is refused (the checkpoint holds the run's own)."""
    overrides = [*LORA_OVERRIDES, "optim.lr=1e-2", "trainer.limit_val_batches=0", "trainer.max_steps=6"]
    run(tiny_config(shapes_root, tmp_path / "a", *overrides), extra_callbacks=[StopAfter(3)])
    run(tiny_config(shapes_root, tmp_path / "a", *overrides))
    run(tiny_config(shapes_root, tmp_path / "b", *overrides))
    a, b = exported_state(tmp_path / "a" / "demo_pretrain"), exported_state(tmp_path / "b" / "demo_pretrain")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6, msg=key)
    from lightning_modules.resume import ResumeConfigError

    with pytest.raises(ResumeConfigError, match="model.lora.rank"):
        run(tiny_config(shapes_root, tmp_path / "a", *overrides, "model.lora.rank=2"))


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "lightning_modules.fit", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_ddp_with_adapters_on_two_processes_equals_one_process_with_the_global_batch(shapes_root, tmp_path):
    """As full fine-tuning's DDP test: 2 gloo ranks x 4 against 1 process x 8, adapters on both towers. The frozen
    attention key biases make that test's rounding-noise exception unnecessary here."""
    common = ["--config", str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), f"model.name={TINY}",
              f"data.root={shapes_root}", "data.num_workers=0", "data.masks=false", "trainer.max_steps=3",
              "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "data.batch_size=8",
              *LORA_OVERRIDES, "optim.lr=1e-2"]
    ddp = cli(*common, "trainer.devices=2", "trainer.strategy=ddp", cwd=tmp_path / "ddp")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = cli(*common, cwd=tmp_path / "single")
    assert single.returncode == 0, single.stderr[-3000:]
    assert "global batch 8 = 2 device(s) x 4 per device" in ddp.stdout
    checkpoints = [torch.load(tmp_path / where / "runs" / "demo_pretrain" / "checkpoints" / "last.ckpt",
                              weights_only=False)["state_dict"] for where in ("ddp", "single")]
    adapters = [key for key in checkpoints[0] if "lora_" in key]
    assert adapters and all(checkpoints[0][key].abs().sum() > 0 for key in adapters if "lora_B" in key)
    for key in checkpoints[0]:
        assert torch.allclose(checkpoints[0][key], checkpoints[1][key], rtol=1e-5, atol=1e-6), key
    a = exported_state(tmp_path / "ddp" / "runs" / "demo_pretrain")
    b = exported_state(tmp_path / "single" / "runs" / "demo_pretrain")
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-6, atol=1e-6), key


# ----- refusals before anything is built -------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["tflocal", "tfglobal"])
def test_lora_on_a_frozen_backbone_method_is_refused(shapes_root, tmp_path, method):
    cfg = tiny_config(shapes_root, tmp_path, f"method.name={method}", *LORA_OVERRIDES)
    with pytest.raises(InputError, match=f"method {method} keeps its backbone frozen.*model.lora.rank=0"):
        check_inputs(cfg)


def test_a_rank_larger_than_a_layer_is_refused_naming_the_layer(shapes_root, tmp_path):
    cfg = tiny_config(shapes_root, tmp_path, "model.lora.rank=65", "model.lora.towers=[text]", RANDOM_BACKBONE)
    with pytest.raises(InputError, match=r"rank=65 is larger than the text tower's out_proj layer \(64 -> 64"):
        check_inputs(cfg)
    check_inputs(tiny_config(shapes_root, tmp_path, "model.lora.rank=64", "model.lora.towers=[text]", RANDOM_BACKBONE))
    result = cli("--config", str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), f"model.name={TINY}",
                 f"data.root={shapes_root}", "data.masks=false", "model.lora.rank=200", RANDOM_BACKBONE,
                 cwd=tmp_path / "cli")
    assert result.returncode != 0 and "rank=200 is larger than the image tower's out_proj" in result.stderr
    assert not (tmp_path / "cli" / "runs").exists()


def test_setting_problems_name_each_key():
    config = json.loads((REPO_ROOT / "configs" / "models" / f"{TINY}.json").read_text())
    shapes = tower_shapes(config)
    assert (shapes["image"].width, shapes["text"].width, shapes["text"].layers) == (128, 64, 2)
    problems = lora_setting_problems({**LORA, "towers": ["vision"], "targets": ["qkv"], "dropout": 1.0}, config)
    assert [p.split("=")[0] for p in problems] == ["model.lora.dropout", "model.lora.towers", "model.lora.targets"]
    assert [p.partition("blocks of the ")[2] for p in lora_setting_problems({**LORA, "layers": [2]}, config)] == [
        "image tower (0..1, or negative from the end)", "text tower (0..1, or negative from the end)"]
    assert lora_setting_problems({**LORA, "rank": 0, "towers": []}, config) == []
    with pytest.raises(ValueError, match="rank=129 is larger than visual.transformer.resblocks.0.attn.out_proj"):
        add_lora(build_model(TINY, None, "configs/models").model, {**LORA, "rank": 129, "towers": ["image"]})


def test_every_shipped_config_leaves_lora_off():
    for path in sorted((REPO_ROOT / "configs").rglob("*.yaml")):
        assert OmegaConf.select(OmegaConf.load(path), "model.lora", default=None) is None, path
    assert load_run_config([REPO_ROOT / "configs" / "clip_ft.yaml"]).model.lora.rank == 0
