"""study.position_probe: the label on hand-made scenes, and a short real run end to end."""
from __future__ import annotations

import json

import pytest

from datamodules.shapes import Scene, SceneObject
from study.position_probe import earlier_colour_is_left, main, usable


def scene(first: tuple, second: tuple) -> Scene:
    """Two objects given as (colour, x0): squares of side 10 at y 0."""
    objects = tuple(SceneObject(i + 1, "square", color, "small", (x0, 0, x0 + 10, 10))
                    for i, (color, x0) in enumerate((first, second)))
    return Scene(64, objects)


def test_the_label_is_the_earlier_colour_on_the_left_whatever_the_listing_order():
    assert earlier_colour_is_left(scene(("red", 0), ("blue", 40)))      # red comes before blue in COLORS
    assert not earlier_colour_is_left(scene(("red", 40), ("blue", 0)))
    assert earlier_colour_is_left(scene(("blue", 40), ("red", 0)))      # listed second, still the earlier colour
    assert not earlier_colour_is_left(scene(("blue", 0), ("red", 40)))


def test_only_differently_coloured_objects_clearly_apart_are_used():
    assert usable(scene(("red", 0), ("blue", 40)), margin=0.15)
    assert not usable(scene(("red", 0), ("red", 40)), margin=0.15)
    assert not usable(scene(("red", 0), ("blue", 5)), margin=0.15)     # 5 px < 0.15 * 64


@pytest.mark.parametrize("pos_embed", [None, "sin_cos_2d"])
def test_a_short_probe_trains_and_reports_its_history(tmp_path, pos_embed):
    out = tmp_path / "probe.json"
    argv = ["--model", "ViT-Tiny-16-64", "--steps", "4", "--eval-every", "2", "--n-train", "32", "--n-val", "16",
            "--batch-size", "8", "--out", str(out)] + (["--pos-embed", pos_embed] if pos_embed else [])
    history = main(argv)
    assert [entry["step"] for entry in history] == [2, 4]
    assert all(0.0 <= entry["val_accuracy"] <= 1.0 and entry["loss"] > 0 for entry in history)
    assert json.loads(out.read_text())["history"] == history


def test_the_position_override_reaches_the_tower():
    from pathlib import Path

    from study.position_probe import build_tower

    learnable = build_tower("ViT-Tiny-16-64", Path("configs/models"), None, None)
    sincos = build_tower("ViT-Tiny-16-64", Path("configs/models"), "sin_cos_2d", None)
    assert learnable.positional_embedding.requires_grad
    # open_clip's fixed 2-D sin-cos table: frozen, and its CLS row is zeros.
    assert not sincos.positional_embedding.requires_grad
    assert float(sincos.positional_embedding[0].abs().sum()) == 0.0


def test_pos_scale_multiplies_the_learnable_table_and_refuses_a_fixed_one():
    from pathlib import Path

    import torch

    from study.position_probe import build_tower

    torch.manual_seed(0)
    plain = build_tower("ViT-Tiny-16-64", Path("configs/models"), None, None)
    torch.manual_seed(0)  # the same draw, then scaled
    scaled = build_tower("ViT-Tiny-16-64", Path("configs/models"), None, None, pos_scale=10.0)
    assert torch.allclose(scaled.positional_embedding, 10.0 * plain.positional_embedding, rtol=1e-6)
    assert scaled.positional_embedding.requires_grad
    with pytest.raises(ValueError, match="learnable"):
        build_tower("ViT-Tiny-16-64", Path("configs/models"), "sin_cos_2d", None, pos_scale=10.0)
