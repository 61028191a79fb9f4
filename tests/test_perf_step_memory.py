"""perf.step's memory report: the MACCO variants' configs and the peak RSS of one fresh process per variant."""
from __future__ import annotations

import json
import subprocess

import pytest

from perf import step

TINY = ["--model", "ViT-Tiny-16-64", "--batch-size", "2", "--repeats", "1", "--warmup", "0"]


@pytest.mark.parametrize("name, key_padding_mask", [("macco", False), ("macco_ours", True)])
def test_macco_variants_train_their_recipes_settings(name, key_padding_mask):
    """`macco` is the paper config (the official code's method and optim settings), `macco_ours` our recipe."""
    variant = step.Variant(name, step.parse_args(["--methods", name, *TINY]))
    method, optim = variant.module.cfg.method, variant.module.cfg.optim
    assert method.name == "macco" and method.key_padding_mask is key_padding_mask
    assert (optim.logit_scale_group == "head") is (name == "macco")
    assert variant.module.model_name == "ViT-Tiny-16-64"  # perf.step's model, not the recipe's
    assert variant.module.encoders.recompute_activations  # MACCO's towers keep less for the backward


def test_peak_rss_comes_from_one_fresh_process_per_variant(tmp_path, monkeypatch):
    commands = []
    run = subprocess.run
    monkeypatch.setattr(step.subprocess, "run", lambda command, **kw: commands.append(command) or run(command, **kw))
    out = tmp_path / "perf.json"
    result = step.main(["--peak-rss", "--methods", "clip_ft", *TINY, "--out", str(out)])
    assert [command[command.index("--single") + 1] for command in commands] == ["clip_ft"]
    row = result["methods"]["clip_ft"]
    # torch, open_clip and spaCy alone take a few hundred MiB; a tiny model's steps add little
    assert 0.2 < row["peak_rss_gib"] < 8 and len(row["step_times_s"]) == 1
    assert result["timing"].startswith("sequential") and json.loads(out.read_text()) == result
