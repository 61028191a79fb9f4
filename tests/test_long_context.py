"""Long-CLIP's positional-embedding stretch (SmartCLIP's long-caption recipe) on a tiny model: the stretch against
a slow reference, 248-token captions, frozen leading positions through real optimizer steps, and the export
loaded by plain open_clip with the stretched context length."""
from __future__ import annotations

import json

import open_clip
import pytest
import torch
from fitting import tiny_config
from tolerance import scaled_close

from lightning_modules import load_run_config
from modeling.encoders import build_model
from lightning_modules.fit import build_datamodule, run
from modeling.long_context import stretch_factor, stretch_positional_embedding, stretched_model_name
from lightning_modules.methods.smartclip import SmartCLIP

TINY = "ViT-Tiny-16-64"  # 77 text positions, width 64
# ~115 tokens: two words placed after position 77 tell a 248-token encoder's captions apart.
LONG_CAPTION = " ".join(["a red cube left of a blue ball"] * 14)


def reference_stretch(old: torch.Tensor, keep: int, factor: int) -> torch.Tensor:
    """Long-CLIP's stretch, position by position as its formula reads (modeling/long_context.py)."""
    length = old.shape[0]
    rows = [old[p] for p in range(keep)]
    for p in range(keep, length - 1):  # interpolated between p and p + 1
        rows += [((factor - j) * old[p]) / factor + (j * old[p + 1]) / factor for j in range(factor)]
    step = old[length - 1] - old[length - 2]  # the last position: extrapolated by its own step
    rows += [old[length - 1] + (j * step) / factor for j in range(factor)]
    return torch.stack(rows)


def test_the_stretch_equals_the_reference_and_keeps_the_leading_positions():
    torch.manual_seed(0)
    old = torch.randn(77, 16) * 0.02
    assert stretch_factor(77, 248, 20) == 4 and 4 * 77 - 3 * 20 == 248
    exact = stretch_positional_embedding(old, 20, 4, torch.float32)
    assert exact.shape == (248, 16) and exact.dtype == torch.float32
    assert scaled_close(exact, reference_stretch(old.double(), 20, 4), 1e-6)  # float32 rounding, ~1e-7
    assert torch.equal(exact[:20], old[:20])  # kept as they are
    assert torch.equal(exact[20:244:4], old[20:76])  # every 4th position is an old one
    assert torch.equal(exact[244], old[76])
    assert not torch.allclose(exact[245:], old[76].expand(3, -1))  # extrapolated beyond the last
    # Long-CLIP's own arithmetic: fp16, bit for bit
    half = stretch_positional_embedding(old, 20, 4, torch.float16)
    assert torch.equal(half, reference_stretch(old.half(), 20, 4).float())
    assert torch.equal(half[:20], old[:20].half().float()) and not torch.equal(half, exact)


def test_only_integer_stretches_are_accepted():
    assert stretch_factor(32, 92, 12) == 4 and stretch_factor(77, 134, 20) == 2
    for context_length in (200, 249, 77):
        with pytest.raises(ValueError, match="integer f >= 2"):
            stretch_factor(77, context_length, 20)
    with pytest.raises(ValueError, match="keep_positions"):
        stretch_factor(77, 248, 76)
    assert stretched_model_name("ViT-B-16-quickgelu", 248) == "ViT-B-16-ctx248-quickgelu"
    assert stretched_model_name(TINY, 248) == f"{TINY}-ctx248"


def smartclip(*overrides: str) -> SmartCLIP:
    torch.manual_seed(0)
    return SmartCLIP(load_run_config([], [f"model.name={TINY}", "method.name=smartclip", *overrides]))


def test_the_module_stretches_the_text_context_and_its_tokenizer():
    plain, long = smartclip(), smartclip("model.context_length=248")
    old = plain.clip.positional_embedding.detach()
    assert long.model_name == f"{TINY}-ctx248" and long.model_config["text_cfg"]["context_length"] == 248
    assert long.clip.context_length == long.tokenizer.context_length == 248
    assert long.clip.attn_mask.shape == (248, 248)
    assert torch.equal(long.clip.positional_embedding, stretch_positional_embedding(old, 20, 4, torch.float16))
    assert torch.equal(long.kept_text_positions, old[:20].half().float())
    assert plain.kept_text_positions is None and plain.tokenizer.context_length == 77
    exact = smartclip("model.context_length=248", "model.stretch_dtype=float32")
    assert torch.equal(exact.clip.positional_embedding[:20], old[:20])
    with pytest.raises(ValueError, match="shorter"):
        smartclip("model.context_length=40")


def test_captions_beyond_77_tokens_are_encoded():
    module = smartclip("model.context_length=248").eval()
    tail_changed = LONG_CAPTION.rsplit(" ", 2)[0] + " green square"
    ids = module.tokenizer([LONG_CAPTION, tail_changed])
    assert ids.shape == (2, 248) and int(ids[0].argmax()) > 100  # EOS beyond 100: nothing truncated
    assert torch.equal(ids[0, :100], ids[1, :100])  # the two differ only after position 100
    with torch.no_grad():
        pooled = module.encoders.encode_text(ids).pooled
        assert scaled_close(pooled, module.clip.encode_text(ids), 1e-6)  # the same forward as open_clip's
    assert not scaled_close(pooled[0], pooled[1], 1e-3)  # the tail changes the embedding
    short = smartclip().tokenizer([LONG_CAPTION, tail_changed])
    assert torch.equal(short[0], short[1])  # at 77 tokens both truncate to the same ids


def test_training_keeps_the_leading_positions_and_the_export_loads_in_open_clip(shapes_root, tmp_path):  # noqa: F811
    cfg = tiny_config(shapes_root, tmp_path, "method.name=smartclip", "model.context_length=248",
                      "trainer.max_steps=3", "optim.warmup_steps=0", "optim.lr=1e-2", "optim.weight_decay=0.1",
                      "optim.backbone_decay_1d=true", "trainer.limit_val_batches=0")
    torch.manual_seed(0)
    module = SmartCLIP(cfg)
    initial = module.clip.positional_embedding.detach().clone()
    trainer = run(cfg)
    trained = trainer.lightning_module
    positions = trained.clip.positional_embedding.detach()
    assert torch.equal(positions[:20], initial[:20])  # frozen through 3 AdamW steps with weight decay
    assert (positions[20:] - initial[20:]).abs().amax(dim=1).min() > 0  # every later position trained

    export = tmp_path / "demo_pretrain" / "export"
    metadata = json.loads((export / "model.json").read_text())
    assert metadata["model"] == f"{TINY}-ctx248"
    config = json.loads((export / "model_configs" / f"{TINY}-ctx248.json").read_text())
    assert config["text_cfg"]["context_length"] == 248
    open_clip.add_model_config(export / "model_configs")  # plain open_clip from here on
    model, _, _ = open_clip.create_model_and_transforms(metadata["model"], pretrained=str(export / "open_clip.pt"))
    tokenizer = open_clip.get_tokenizer(metadata["model"])
    assert tokenizer.context_length == 248
    ids = tokenizer([LONG_CAPTION, "a red square"])
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.eval(), trained.eval()
        assert scaled_close(model.encode_text(ids), trained.clip.encode_text(ids), 1e-6)
        assert scaled_close(model.encode_image(images), trained.clip.encode_image(images), 1e-6)
    # and the export is a starting point again: its own config is found beside its weights
    rebuilt = build_model(metadata["model"], str(export), None)
    assert rebuilt.tokenizer.context_length == 248 and rebuilt.model.positional_embedding.shape == (248, 64)


def test_the_datamodule_tokenises_to_the_stretched_context(shapes_root, tmp_path):  # noqa: F811
    cfg = tiny_config(shapes_root, tmp_path, "method.name=smartclip", "model.context_length=248")
    module = SmartCLIP(cfg)
    datamodule = build_datamodule(cfg, module)
    datamodule.setup("fit")
    assert datamodule.train_dataset.context_length == datamodule.val_dataset.context_length == 248
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["text"].shape == (cfg.data.batch_size, 248)
    terms, _ = module.compute_terms(batch)  # the mask network reads all 248 positions
    assert all(torch.isfinite(value) for value in terms.values())


def test_the_kept_positions_get_no_gradient_before_the_optimizer_step():
    module = smartclip("model.context_length=248")
    module.clip.positional_embedding.grad = torch.ones(248, 64)
    module.on_before_optimizer_step(None)
    grad = module.clip.positional_embedding.grad
    assert torch.all(grad[:20] == 0) and torch.all(grad[20:] == 1)
    plain = smartclip()  # nothing is frozen without a stretch
    plain.clip.positional_embedding.grad = torch.ones(77, 64)
    plain.on_before_optimizer_step(None)
    assert torch.all(plain.clip.positional_embedding.grad == 1)
