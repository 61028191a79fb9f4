"""perf.step's memory report: the MACCO variants' configs and the peak RSS of one fresh process per variant."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

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


def test_the_batch_captions_come_from_the_given_tsv_and_the_report_says_so(tmp_path):
    """The batch is the TSV's first captions when it holds enough, else the built-in ones; the report names the
    source; a --captions that is not a file, or holds less than a batch, is refused before any model is built."""
    from test_coco_datamodule import write_negclip_tsv

    rows = [(f"caption number {i} of a real file", f"coco/val2014/COCO_val2014_{i:012d}.jpg", ["neg"])
            for i in range(3)]
    tsv = write_negclip_tsv(tmp_path / "valid_neg_clip.tsv", rows)
    assert step.real_captions(2, tsv) == ["caption number 0 of a real file", "caption number 1 of a real file"]
    assert step.batch_captions(3, tsv)[1] == str(tsv)
    assert step.batch_captions(4, tsv) == ([step.FALLBACK_CAPTIONS[i % len(step.FALLBACK_CAPTIONS)] for i in range(4)],
                                           step.BUILT_IN)
    assert step.batch_captions(2, tmp_path / "absent.tsv")[1] == step.BUILT_IN

    variant = step.Variant("clip_ft", step.parse_args(["--methods", "clip_ft", *TINY, "--captions", str(tsv)]))
    assert torch.equal(variant.batch["text"].cpu(), variant.module.tokenizer(step.real_captions(2, tsv)))
    result = step.main(["--methods", "clip_ft", *TINY, "--captions", str(tsv), "--out", str(tmp_path / "p.json")])
    assert result["captions"] == str(tsv)
    with pytest.raises(SystemExit, match="--captions .*absent.tsv is not a file"):
        step.main(["--methods", "clip_ft", *TINY, "--captions", str(tmp_path / "absent.tsv")])
    with pytest.raises(SystemExit, match="holds fewer than --batch-size 4 captions"):  # not silently built-in
        step.main(["--methods", "clip_ft", *TINY, "--batch-size", "4", "--captions", str(tsv)])
