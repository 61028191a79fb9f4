"""modeling.checkpoints: each published layout written by its own library, read into a fresh open_clip model.

Every test writes a random-weight checkpoint the way its source does (open_clip, torch DDP, Lightning, the OpenAI
`clip` package, TorchScript, loralib's key layout), reads it into a new model and compares the state dict exactly,
or the image and text features with those of the model that wrote it. All weights are perturbed from their
initialisation so that every tensor, layer norms and biases included, changes the features.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Dict, Tuple

import lightning as L
import numpy as np
import open_clip
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from modeling.checkpoints import (FORMATS, BaseMismatch, CheckpointMismatch, UntrustedPickle, check_fits, load_strict,
                              read_checkpoint, truncate_context, wise_ft)
from modeling.encoders import register_model_configs
from tolerance import assert_scaled_close, scaled_close

TINY = "ViT-Tiny-16-64"  # image 64, patch 16, vision width 128 (2 heads), text width 64 (2 heads), context 77
EOT = 49407  # CLIP's end-of-text id, the largest in the vocabulary: open_clip and OpenAI pool at its argmax
RTOL = 1e-5  # float32 features computed by two implementations of the same tower
# OpenAI `clip.model.CLIP` arguments with the dimensions of TINY (vision heads = width // 64 there).
OPENAI_TINY = dict(embed_dim=64, image_resolution=64, vision_layers=2, vision_width=128, vision_patch_size=16,
                   context_length=77, vocab_size=49408, transformer_width=64, transformer_heads=2,
                   transformer_layers=2)
# A tiny QuickGELU CLIP with 32-pixel patches: conv1's LoRA factors then have the published shapes' form
# (A [4 * 32, 3 * 32], B [width * 32, 4 * 32]).
LORA_CONFIG = dict(embed_dim=32, quick_gelu=True,
                   vision_cfg=dict(image_size=64, layers=2, width=64, patch_size=32, head_width=32),
                   text_cfg=dict(context_length=77, vocab_size=49408, width=32, heads=2, layers=2))
RANK = 4


@pytest.fixture(scope="module", autouse=True)
def tiny_configs() -> None:
    register_model_configs("configs/models")


def perturb(model: nn.Module, seed: int) -> nn.Module:
    """Add noise to every parameter (layer norms stay near 1/0 but differ per channel), eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


def tiny(seed: int, **kwargs) -> nn.Module:
    return perturb(open_clip.create_model(TINY, **kwargs), seed)


def fresh(**kwargs) -> nn.Module:
    """An untouched model to read into (its own random weights differ from every checkpoint's)."""
    return open_clip.create_model(TINY, **kwargs).eval()


def inputs(seed: int, context: int = 77, image_size: int = 64) -> Tuple[Tensor, Tensor]:
    """Images [2, 3, H, W] and token ids [3, context]: random tokens, EOT at 5, 17 and 40, zeros after."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(2, 3, image_size, image_size, generator=generator)
    texts = torch.zeros(3, context, dtype=torch.long)
    for row, eot in enumerate((5, 17, 40)):
        texts[row, :eot] = torch.randint(1, EOT, (eot,), generator=generator)
        texts[row, eot] = EOT
    return images, texts


@torch.no_grad()
def assert_same_features(model: nn.Module, reference: nn.Module, images: Tensor, texts: Tensor) -> None:
    assert_scaled_close(model.encode_image(images), reference.encode_image(images), RTOL, "image features")
    assert_scaled_close(model.encode_text(texts), reference.encode_text(texts), RTOL, "text features")


def assert_same_state(actual: Dict[str, Tensor], expected: Dict[str, Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == torch.float32, key
        assert torch.equal(actual[key], value.float()), key


# ---------------------------------------------------------------------------------------------------------------
# open_clip files and wrappers


def test_open_clip_plain_and_training_checkpoint(tmp_path):
    model = tiny(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, texts = inputs(seed=2)
    model.encode_image(images).sum().backward()
    optimizer.step()
    plain, training = tmp_path / "plain.pt", tmp_path / "epoch_3.pt"
    torch.save(model.state_dict(), plain)
    torch.save({"epoch": 3, "name": "negclip", "state_dict": model.state_dict(),
                "optimizer": optimizer.state_dict()}, training)
    for path in (plain, training):
        state = read_checkpoint(path, "open_clip", fresh())
        assert_same_state(state, model.state_dict())
        assert_same_features(load_strict(fresh(), state), model, images, texts)


def test_open_clip_format_refuses_a_prefix_and_points_to_wrappers(tmp_path):
    model = tiny(seed=1)
    path = tmp_path / "prefixed.pt"
    torch.save({f"module.{key}": value for key, value in model.state_dict().items()}, path)
    with pytest.raises(CheckpointMismatch, match="'module.': read the file with format 'wrappers'"):
        read_checkpoint(path, "open_clip", fresh())
    assert_same_state(read_checkpoint(path, "wrappers", fresh()), model.state_dict())


def test_ddp_state_dict_and_ddp_training_checkpoint(tmp_path):
    model = tiny(seed=3)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        torch.save(ddp.state_dict(), tmp_path / "ddp.pt")
        torch.save({"epoch": 10, "name": "ce-clip", "state_dict": ddp.state_dict()}, tmp_path / "ddp_training.pt")
    finally:
        dist.destroy_process_group()
    assert all(key.startswith("module.") for key in torch.load(tmp_path / "ddp.pt"))
    images, texts = inputs(seed=4)
    for name in ("ddp.pt", "ddp_training.pt"):
        state = read_checkpoint(tmp_path / name, "wrappers", fresh())
        assert_same_state(state, model.state_dict())
        assert_same_features(load_strict(fresh(), state), model, images, texts)


class HoldsCLIP(L.LightningModule):
    """A LightningModule holding the CLIP as an attribute, beside a head of its own (a method's extra weights)."""

    def __init__(self, clip: nn.Module):
        super().__init__()
        self.backbone = clip
        self.head = nn.Linear(4, 4)

    def training_step(self, batch, batch_index):
        images, texts = batch
        image_features = F.normalize(self.backbone.encode_image(images), dim=-1)
        text_features = F.normalize(self.backbone.encode_text(texts), dim=-1)
        logits = self.backbone.logit_scale.exp() * image_features @ text_features.T
        return F.cross_entropy(logits, torch.arange(len(images))) + 0.0 * self.head.weight.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_checkpoint(tmp_path):
    module = HoldsCLIP(tiny(seed=5)).train()
    before = {key: value.clone() for key, value in module.backbone.state_dict().items()}
    images, texts = inputs(seed=6)
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, texts[:2]), batch_size=2)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, batches)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    module.eval()
    trained = module.backbone.state_dict()
    assert not torch.equal(trained["visual.conv1.weight"], before["visual.conv1.weight"])  # the step trained it
    state = read_checkpoint(path, "wrappers", fresh())
    assert_same_state(state, trained)  # the head's keys are left out, the CLIP's are all there
    assert_same_features(load_strict(fresh(), state), module.backbone, images, texts)


def test_torch_compile_prefix(tmp_path):
    model = tiny(seed=7)
    path = tmp_path / "compiled.pt"
    torch.save(torch.compile(model).state_dict(), path)
    assert next(iter(torch.load(path))).startswith("_orig_mod.")
    assert_same_state(read_checkpoint(path, "wrappers", fresh()), model.state_dict())


def test_a_prefix_that_fits_part_of_the_keys_is_refused(tmp_path):
    state = tiny(seed=8).state_dict()
    half = {(f"module.{key}" if index % 2 else key): value for index, (key, value) in enumerate(state.items())}
    torch.save(half, tmp_path / "half.pt")
    with pytest.raises(CheckpointMismatch, match="no single key prefix"):
        read_checkpoint(tmp_path / "half.pt", "wrappers", fresh())
    # Outside a Lightning checkpoint, a key beside the prefix is not dropped.
    torch.save({**{f"module.{k}": v for k, v in state.items()}, "head.weight": torch.zeros(2)}, tmp_path / "head.pt")
    with pytest.raises(CheckpointMismatch, match=r"'module.', leaves 0 missing \(\) and 1 unexpected \(head.weight\)"):
        read_checkpoint(tmp_path / "head.pt", "wrappers", fresh())
    # Two CLIPs in one Lightning module: both prefixes fit, so the reader needs to be told which.
    doubled = {"pytorch-lightning_version": "2.6.6",
               "state_dict": {**{f"student.{k}": v for k, v in state.items()},
                              **{f"teacher.{k}": v for k, v in state.items()}}}
    torch.save(doubled, tmp_path / "two.ckpt")
    with pytest.raises(CheckpointMismatch, match="several prefixes"):
        read_checkpoint(tmp_path / "two.ckpt", "wrappers", fresh())
    assert_same_state(read_checkpoint(tmp_path / "two.ckpt", "wrappers", fresh(), prefix="teacher."), state)


# ---------------------------------------------------------------------------------------------------------------
# Strictness


def test_extra_missing_and_reshaped_keys_are_named(tmp_path):
    state = tiny(seed=9).state_dict()
    broken = dict(state)
    broken["extra.weight"] = torch.zeros(3)
    del broken["visual.proj"]
    broken["positional_embedding"] = state["positional_embedding"][:70]
    with pytest.raises(CheckpointMismatch) as raised:
        load_strict(fresh(), broken)
    message = str(raised.value)
    assert "1 missing: visual.proj" in message
    assert "1 unexpected: extra.weight" in message
    assert "1 of another shape: positional_embedding (checkpoint [70, 64], model [77, 64])" in message
    for change, named in ((lambda s: s.pop("ln_final.bias"), "missing: ln_final.bias"),
                          (lambda s: s.update(logit_bias=torch.zeros(1)), "unexpected: logit_bias")):
        altered = dict(state)
        change(altered)
        torch.save(altered, tmp_path / "altered.pt")
        with pytest.raises(CheckpointMismatch, match=named):
            read_checkpoint(tmp_path / "altered.pt", "open_clip", fresh())


def test_unknown_format_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="known formats: " + ", ".join(FORMATS)):
        read_checkpoint(tmp_path / "x.pt", "safetensors", fresh())


def test_pickled_numpy_needs_trust(tmp_path):
    model = tiny(seed=10)
    path = tmp_path / "fsc.pt"
    torch.save({"epoch": np.int64(5), "name": "fsc-clip", "state_dict": model.state_dict(),
                "best_score": np.float64(0.5)}, path)
    with pytest.raises(UntrustedPickle, match="trust_pickle=True"):
        read_checkpoint(path, "open_clip", fresh())
    assert_same_state(read_checkpoint(path, "open_clip", fresh(), trust_pickle=True), model.state_dict())


# ---------------------------------------------------------------------------------------------------------------
# The OpenAI clip package: state dicts (GNM-CLIP) and TorchScript archives


def openai_clip_model() -> ModuleType:
    """`clip.model` of the OpenAI package (PyPI openai-clip). Its `__init__` imports `pkg_resources`, which recent
    setuptools no longer ship, so the model module (torch and numpy only) is loaded from its file if need be."""
    try:
        return importlib.import_module("clip.model")
    except ImportError:
        spec = importlib.util.find_spec("clip")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the OpenAI clip package (openai-clip) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "model.py"
    module_spec = importlib.util.spec_from_file_location("openai_clip_model", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "convert_weights"):
        pytest.skip(f"{path} is not the OpenAI clip package's model")
    return module


def openai_tiny(seed: int, **overrides) -> nn.Module:
    return perturb(openai_clip_model().CLIP(**{**OPENAI_TINY, **overrides}), seed)


@pytest.mark.parametrize("wrapper", ["plain", "model_state_dict", "state_dict"])
def test_openai_state_dict_fp16(tmp_path, wrapper):
    clip_model = openai_clip_model()
    reference = openai_tiny(seed=11)
    clip_model.convert_weights(reference)  # OpenAI's storage: fp16 matrices, fp32 layer norms and embeddings
    stored = reference.state_dict()
    assert stored["visual.conv1.weight"].dtype == torch.float16
    assert stored["ln_final.weight"].dtype == torch.float32
    checkpoint = stored if wrapper == "plain" else {"epoch": 2, wrapper: stored, "loss": 0.3}
    torch.save(checkpoint, tmp_path / "gnm_clip.pt")
    reference.float()  # the fp16-rounded weights, computed in float32 like the model read
    model = fresh(force_quick_gelu=True)
    state = read_checkpoint(tmp_path / "gnm_clip.pt", "openai", model)
    assert all(value.dtype == torch.float32 for value in state.values())
    load_strict(model, state)
    images, texts = inputs(seed=12)
    assert_same_features(model, reference, images, texts)


def test_openai_vit_b_32_fits_open_clip_quickgelu():
    """The clip package's ViT-B/32 (OpenAI's published dimensions) has exactly open_clip's keys and shapes."""
    with torch.device("meta"):
        reference = openai_clip_model().CLIP(embed_dim=512, image_resolution=224, vision_layers=12, vision_width=768,
                                             vision_patch_size=32, context_length=77, vocab_size=49408,
                                             transformer_width=512, transformer_heads=8, transformer_layers=12)
        model = open_clip.CLIP(**open_clip.get_model_config("ViT-B-32-quickgelu"))
    check_fits(model, reference.state_dict())


def register_openai_metadata(model: nn.Module, image_size: int, context_length: int, vocab_size: int) -> None:
    """The entries OpenAI's TorchScript archives carry beside the weights, as buffers of the top module."""
    for name, value in (("input_resolution", image_size), ("context_length", context_length),
                        ("vocab_size", vocab_size)):
        if name in model.__dict__:
            delattr(model, name)  # clip's CLIP keeps some of them as plain attributes
        model.register_buffer(name, torch.tensor(value))


def traced_archive(reference: nn.Module, path: Path, context_length: int) -> None:
    register_openai_metadata(reference, 64, context_length, 49408)
    images, texts = inputs(seed=13, context=context_length)
    archive = torch.jit.trace_module(reference, {"encode_image": images, "encode_text": texts})
    torch.jit.save(archive, str(path))


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:.*torch.jit.*:FutureWarning",
                            "ignore:.*TorchScript archive:UserWarning")
def test_torchscript_archive(tmp_path):
    reference = openai_tiny(seed=14)
    path = tmp_path / "ViT-Tiny.pt"
    traced_archive(reference, path, context_length=77)
    assert {"input_resolution", "context_length", "vocab_size"} <= set(torch.jit.load(str(path)).state_dict())
    model = fresh(force_quick_gelu=True)
    state = read_checkpoint(path, "torchscript", model)
    assert not {"input_resolution", "context_length", "vocab_size"} & set(state)
    load_strict(model, state)
    assert_same_features(model, reference, *inputs(seed=15))
    with pytest.raises(ValueError, match="TorchScript archive: read it with format 'torchscript'"):
        read_checkpoint(path, "openai", model)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:.*torch.jit.*:FutureWarning")
def test_torchscript_metadata_must_agree(tmp_path):
    path = tmp_path / "context64.pt"
    traced_archive(openai_tiny(seed=16, context_length=64), path, context_length=64)
    with pytest.raises(CheckpointMismatch, match="context_length is 64 in the checkpoint but 77 in the model"):
        read_checkpoint(path, "torchscript", fresh(force_quick_gelu=True))
    model = fresh(force_quick_gelu=True, force_context_length=64)
    load_strict(model, read_checkpoint(path, "torchscript", model))


# ---------------------------------------------------------------------------------------------------------------
# LoRA (DAC, TSVLC, FSC-CLIP)


def lora_model(seed: int) -> nn.Module:
    return perturb(open_clip.CLIP(**LORA_CONFIG), seed)


def lora_factors(base: Dict[str, Tensor], seed: int) -> Dict[str, Tensor]:
    """Random factors in the published layout for every adapted weight of `base` (both towers, conv1)."""
    generator = torch.Generator().manual_seed(seed)

    def pair(rows_a: int, cols_a: int, rows_b: int) -> Tuple[Tensor, Tensor]:
        return (0.2 * torch.randn(rows_a, cols_a, generator=generator),
                0.2 * torch.randn(rows_b, rows_a, generator=generator))

    factors = {}
    for key, weight in base.items():
        if key.endswith("attn.in_proj_weight"):
            factors[f"{key}_lora_A"], factors[f"{key}_lora_B"] = pair(RANK, weight.shape[1], weight.shape[0])
        elif key.endswith(("attn.out_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")):
            stem = key[: -len(".weight")]
            factors[f"{stem}.lora_A"], factors[f"{stem}.lora_B"] = pair(RANK, weight.shape[1], weight.shape[0])
    out_channels, in_channels, kernel, _ = base["visual.conv1.weight"].shape
    factors["visual.conv1.lora_A"], factors["visual.conv1.lora_B"] = pair(RANK * kernel, in_channels * kernel,
                                                                          out_channels * kernel)
    return factors


class LoraLinear(nn.Module):
    """loralib's Linear forward: F.linear(x, W, b) + (x @ A.T @ B.T) * s."""

    def __init__(self, linear: nn.Linear, a: Tensor, b: Tensor, scale: float):
        super().__init__()
        self.linear, self.a, self.b, self.scale = linear, a, b, scale

    @property
    def weight(self) -> Tensor:  # open_clip reads the text tower's dtype from its first block's mlp.c_fc.weight
        return self.linear.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) + (x @ self.a.T @ self.b.T) * self.scale


class LoraAttention(nn.Module):
    """loralib's MultiheadAttention (batch first): LoRA on the packed input projection and the output one."""

    def __init__(self, attn: nn.MultiheadAttention, factors: Dict[str, Tensor], scale: float):
        super().__init__()
        self.attn, self.factors, self.scale = attn, factors, scale

    def forward(self, q, k, v, need_weights=False, attn_mask=None):
        attn, f = self.attn, self.factors
        batch, length, width = q.shape
        heads = attn.num_heads
        qkv = F.linear(q, attn.in_proj_weight, attn.in_proj_bias) + (q @ f["in_A"].T @ f["in_B"].T) * self.scale
        q, k, v = qkv.view(batch, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        context = context.transpose(1, 2).reshape(batch, length, width)
        out = attn.out_proj(context) + (context @ f["out_A"].T @ f["out_B"].T) * self.scale
        return out, None


class LoraConv(nn.Module):
    """loralib's Conv2d: conv(x, W) plus conv(x, (B @ A).view(W.shape)) * s."""

    def __init__(self, conv: nn.Conv2d, a: Tensor, b: Tensor, scale: float):
        super().__init__()
        self.conv, self.a, self.b, self.scale = conv, a, b, scale

    def forward(self, x: Tensor) -> Tensor:
        delta = (self.b @ self.a).view(self.conv.weight.shape)
        return self.conv(x) + F.conv2d(x, delta, stride=self.conv.stride) * self.scale


def lora_reference(base_model: nn.Module, factors: Dict[str, Tensor], scale: float) -> nn.Module:
    """`base_model` with the LoRA terms applied in the forward pass, unmerged, as the training code ran them."""
    for tower in (base_model.visual.transformer, base_model.transformer):
        prefix = "visual.transformer" if tower is base_model.visual.transformer else "transformer"
        for index, block in enumerate(tower.resblocks):
            stem = f"{prefix}.resblocks.{index}."
            for name in ("c_fc", "c_proj"):
                a, b = factors[f"{stem}mlp.{name}.lora_A"], factors[f"{stem}mlp.{name}.lora_B"]
                setattr(block.mlp, name, LoraLinear(getattr(block.mlp, name), a, b, scale))
            block.attn = LoraAttention(block.attn, {
                "in_A": factors[f"{stem}attn.in_proj_weight_lora_A"],
                "in_B": factors[f"{stem}attn.in_proj_weight_lora_B"],
                "out_A": factors[f"{stem}attn.out_proj.lora_A"], "out_B": factors[f"{stem}attn.out_proj.lora_B"]},
                scale)
    base_model.visual.conv1 = LoraConv(base_model.visual.conv1, factors["visual.conv1.lora_A"],
                                       factors["visual.conv1.lora_B"], scale)
    return base_model.eval()


def test_lora_full_state_dict_merges_as_trained(tmp_path):
    base_model = lora_model(seed=20)
    base = base_model.state_dict()
    factors = lora_factors(base, seed=21)
    assert factors["visual.conv1.lora_A"].shape == (128, 96) and factors["visual.conv1.lora_B"].shape == (2048, 128)
    path = tmp_path / "dac.pt"
    torch.save({"epoch": 5, "name": "dac", "state_dict": {f"module.{k}": v for k, v in {**base, **factors}.items()},
                "optimizer": {}}, path)
    model = open_clip.CLIP(**LORA_CONFIG).eval()
    state = read_checkpoint(path, "lora", model)
    assert not any("lora" in key for key in state)
    for key, weight in base.items():  # merged weights against a float64 reference
        a, b = factors.get(key + "_lora_A"), factors.get(key + "_lora_B")
        if a is None and key.endswith(".weight"):
            a, b = factors.get(key[: -len(".weight")] + ".lora_A"), factors.get(key[: -len(".weight")] + ".lora_B")
        expected = weight.double() if a is None else weight.double() + 0.25 * (b.double() @ a.double()).view(
            weight.shape)
        assert_scaled_close(state[key], expected, 1e-6, key)
    load_strict(model, state)
    images, texts = inputs(seed=22)
    reference = lora_reference(load_strict(open_clip.CLIP(**LORA_CONFIG), base), factors, scale=0.25)
    assert_same_features(model, reference, images, texts)
    with torch.no_grad():  # the LoRA terms matter: the base alone computes other features
        assert not scaled_close(base_model.encode_text(texts), reference.encode_text(texts), 1e-2)
        assert not scaled_close(base_model.encode_image(images), reference.encode_image(images), 1e-2)


def test_lora_scale_option(tmp_path):
    base = lora_model(seed=23).state_dict()
    factors = lora_factors(base, seed=24)
    torch.save({**base, **factors}, tmp_path / "lora.pt")
    state = read_checkpoint(tmp_path / "lora.pt", "lora", open_clip.CLIP(**LORA_CONFIG), lora_scale=1.0)
    key = "transformer.resblocks.1.mlp.c_fc.weight"
    expected = base[key].double() + factors[key[: -len(".weight")] + ".lora_B"].double() @ factors[
        key[: -len(".weight")] + ".lora_A"].double()
    assert_scaled_close(state[key], expected, 1e-6)


def test_lora_delta_only_with_base(tmp_path):
    base = lora_model(seed=25).state_dict()
    factors = lora_factors(base, seed=26)
    torch.save({**base, **factors}, tmp_path / "full.pt")
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in factors.items()}}, tmp_path / "delta.pt")
    model = open_clip.CLIP(**LORA_CONFIG)
    full = read_checkpoint(tmp_path / "full.pt", "lora", model)
    assert_same_state(read_checkpoint(tmp_path / "delta.pt", "lora", model, base=base), full)
    with pytest.raises(ValueError, match=r"LoRA factors only: give the base they were trained on \(base=...\)"):
        read_checkpoint(tmp_path / "delta.pt", "lora", model)


def test_lora_refuses_another_base_and_accepts_fp16_storage(tmp_path):
    base = lora_model(seed=27).state_dict()
    factors = lora_factors(base, seed=28)
    model = open_clip.CLIP(**LORA_CONFIG)
    torch.save({**base, **factors}, tmp_path / "lora.pt")
    other = lora_model(seed=29).state_dict()
    with pytest.raises(BaseMismatch, match=rf"{len(base)} of {len(base)} base tensors differ .*\(ln_final.bias, "):
        read_checkpoint(tmp_path / "lora.pt", "lora", model, base=other)
    nudged = {**base, "logit_scale": base["logit_scale"] + 0.01}
    with pytest.raises(BaseMismatch, match=rf"1 of {len(base)} base tensors differ .*\(logit_scale\)"):
        read_checkpoint(tmp_path / "lora.pt", "lora", model, base=nudged)
    # Stored in fp16, the base is still recognised as the fp32 base it was saved from.
    torch.save({**{k: v.half() for k, v in base.items()}, **factors}, tmp_path / "lora16.pt")
    state = read_checkpoint(tmp_path / "lora16.pt", "lora", model, base=base)
    assert torch.equal(state["ln_final.weight"], base["ln_final.weight"].half().float())


def test_lora_missing_factor_is_a_mismatch(tmp_path):
    base = lora_model(seed=30).state_dict()
    factors = lora_factors(base, seed=31)
    del factors["transformer.resblocks.0.mlp.c_fc.lora_B"]
    torch.save({**base, **factors}, tmp_path / "lora.pt")
    with pytest.raises(CheckpointMismatch, match=r"transformer.resblocks.0.mlp.c_fc.weight \(lora_B missing\)"):
        read_checkpoint(tmp_path / "lora.pt", "lora", open_clip.CLIP(**LORA_CONFIG), base=base)
    wrong = lora_factors(base, seed=31)
    wrong["visual.conv1.lora_B"] = wrong["visual.conv1.lora_B"][:, :64].contiguous()
    torch.save({**base, **wrong}, tmp_path / "shapes.pt")
    with pytest.raises(CheckpointMismatch, match=r"LoRA factors of visual.conv1.weight"):
        read_checkpoint(tmp_path / "shapes.pt", "lora", open_clip.CLIP(**LORA_CONFIG))


# ---------------------------------------------------------------------------------------------------------------
# Text context 64 (CLoVe) and WiSE-FT


def test_context_64_loads_only_into_a_64_context_model(tmp_path):
    model64 = tiny(seed=40, force_context_length=64)
    assert model64.state_dict()["positional_embedding"].shape[0] == 64
    path = tmp_path / "clove_without_patching.pt"
    torch.save({"epoch": 1, "state_dict": model64.state_dict()}, path)
    read = fresh(force_context_length=64)
    load_strict(read, read_checkpoint(path, "open_clip", read))
    # A 77-context model whose first 64 positions are the checkpoint's computes the same features for texts
    # shorter than 64 tokens (causal tower, pooled at EOT).
    extra_rows = torch.randn(13, 64, generator=torch.Generator().manual_seed(41))
    state77 = {**model64.state_dict(),
               "positional_embedding": torch.cat([model64.state_dict()["positional_embedding"], extra_rows])}
    model77 = load_strict(fresh(), state77)
    images, texts64 = inputs(seed=42, context=64)
    texts77 = F.pad(texts64, (0, 13))
    with torch.no_grad():
        assert_scaled_close(read.encode_text(texts64), model77.encode_text(texts77), RTOL)
        assert_scaled_close(read.encode_image(images), model77.encode_image(images), RTOL)
    with pytest.raises(CheckpointMismatch, match=r"has 64 rows, the model's text context is 77.*"
                                                 r"force_context_length=64"):
        read_checkpoint(path, "open_clip", fresh())


def test_wise_ft_and_truncate_context_against_float64():
    openai = tiny(seed=43).state_dict()
    clove = tiny(seed=44, force_context_length=64).state_dict()
    truncated = truncate_context(openai, 64)
    assert torch.equal(truncated["positional_embedding"], openai["positional_embedding"][:64])
    assert openai["positional_embedding"].shape[0] == 77  # the input is not changed
    patched = wise_ft(truncated, clove, 0.6)
    for key in clove:
        expected = 0.4 * truncated[key].double() + 0.6 * clove[key].double()
        assert_scaled_close(patched[key], expected, 1e-7, key)
        assert patched[key].dtype == torch.float32
    load_strict(fresh(force_context_length=64), patched)
    with pytest.raises(CheckpointMismatch, match=r"positional_embedding \(second \[64, 64\], first \[77, 64\]\)"):
        wise_ft(openai, clove, 0.6)
    with pytest.raises(CheckpointMismatch, match="cannot keep 80 rows"):
        truncate_context(openai, 80)
    with pytest.raises(ValueError, match="not in"):
        wise_ft(truncated, clove, 1.5)
