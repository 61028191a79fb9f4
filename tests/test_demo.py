"""The demo table: the harness scores an exported model on the shapes world (swap set and retrieval)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modeling.encoders import build_model
from modeling.export import export_model
from datamodules.shapes import generate
from study.demo import COLUMNS, evaluate_export, markdown_table


def test_evaluate_export_end_to_end(tmp_path, monkeypatch):
    generate(tmp_path / "shapes", n_train=4, n_val=6, image_size=64, seed=0, n_swap=6)
    torch.manual_seed(0)
    built = build_model("ViT-Tiny-16-64", None, "configs/models")
    export_model(built.model, built.name, tmp_path / "export")
    monkeypatch.chdir(tmp_path)  # relative paths, as make demo passes them
    result = evaluate_export(Path("export"), Path("shapes"))
    assert {key for key, _ in COLUMNS} <= set(result)
    assert result["images"] == 6  # retrieval over the 6 validation images
    assert -100.0 <= result["attr_gap"] <= 100.0
    assert any(result["i2t_r1"] == pytest.approx(100.0 * k / 6) for k in range(7))
    table = markdown_table({"random": result})
    assert table.count("\n") == 2 and "| random |" in table


def test_a_row_scored_with_sgi_and_the_run_syntax(tmp_path):
    from study.demo import parse_args, parse_run

    args = parse_args(["runs.sgi=runs/x@sgi", "--data-root", "world", "runs.ft=runs/y"])
    assert [parse_run(label, target) for label, target in args.runs.items()] == [
        ("sgi", Path("runs/x"), "sgi"), ("ft", Path("runs/y"), "clip")]
    with pytest.raises(SystemExit, match="unknown scorer"):
        parse_run("a", "runs/z@nope")
    generate(tmp_path / "shapes", n_train=4, n_val=4, image_size=64, seed=0, n_swap=4)
    torch.manual_seed(0)
    built = build_model("ViT-Tiny-16-64", None, "configs/models")
    export_model(built.model, built.name, tmp_path / "export")
    result = evaluate_export(tmp_path / "export", tmp_path / "shapes", scorer_name="sgi")
    assert "group" in result and "i2t_r1" in result and "attr_gap" not in result  # the gap is CLIP's only
    assert "| sgi | " in markdown_table({"sgi": result}) and " - |" in markdown_table({"sgi": result})
