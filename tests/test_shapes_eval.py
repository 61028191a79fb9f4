"""The demo's evaluator: 2x2 swap scores with strict comparisons, per-type accuracy, retrieval R@1."""
from __future__ import annotations

import pytest
import torch

from datamodules.shapes import generate
from lightning_modules.encoders import build_model
from lightning_modules.export import export_model
from lightning_modules.shapes_eval import aggregate_swap, evaluate_export, swap_outcomes


def test_swap_outcomes_text_image_group_and_ties():
    right = swap_outcomes(torch.tensor([[0.9, 0.1], [0.2, 0.8]]))
    assert right["text"] and right["image"] and right["group"] and right["caption_choices"] == [True, True]
    # image 0 prefers caption 1: text fails; columns still pick the right image
    text_wrong = swap_outcomes(torch.tensor([[0.5, 0.6], [0.1, 0.9]]))
    assert not text_wrong["text"] and text_wrong["image"] and not text_wrong["group"]
    tie = swap_outcomes(torch.tensor([[0.5, 0.5], [0.1, 0.9]]))
    assert not tie["text"] and tie["caption_choices"] == [False, True]  # a tie is wrong


def test_aggregate_swap_in_percent_by_type():
    items = [{"type": "relation", **swap_outcomes(torch.tensor([[0.9, 0.1], [0.2, 0.8]]))},
             {"type": "relation", **swap_outcomes(torch.tensor([[0.5, 0.6], [0.1, 0.9]]))},
             {"type": "object", **swap_outcomes(torch.tensor([[0.1, 0.9], [0.9, 0.1]]))}]
    result = aggregate_swap(items)
    assert result["text"] == pytest.approx(100 / 3) and result["group"] == pytest.approx(100 / 3)
    assert result["image"] == pytest.approx(200 / 3)
    assert result["acc_relation"] == 75.0 and result["acc_object"] == 0.0


def test_evaluate_export_end_to_end(tmp_path):
    generate(tmp_path / "shapes", n_train=4, n_val=6, image_size=64, seed=0, n_swap=6)
    built = build_model("ViT-Tiny-16-64", None, "configs/models")
    export_model(built.model, built.name, tmp_path / "export")
    result = evaluate_export(tmp_path / "export", tmp_path / "shapes")
    assert {"text", "image", "group", "acc_attribute", "acc_relation", "acc_object", "i2t_r1", "t2i_r1"} <= set(result)
    assert all(0.0 <= value <= 100.0 for value in result.values())
    assert any(result["i2t_r1"] == pytest.approx(100.0 * k / 6) for k in range(7))  # 6 validation images
