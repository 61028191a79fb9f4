"""Weight interpolation (WiSE-FT, evaluation/interpolation.py): the ends bit for bit, the path in between, the
export option, the evaluation option (nothing written but results), refusals."""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import open_clip
import pytest
import torch

from modeling.export import load_export
from evaluation import evaluate, interpolation
from evaluation.interpolation import (InterpolationError, check_same_architecture, interpolate_state, load_endpoints,
                                      parse_alphas)
from lightning_modules.fit import run
from fitting import TINY, tiny_config


@pytest.fixture(scope="module")
def runs(shapes_root, tmp_path_factory) -> dict:
    """A backbone trained from scratch (2 steps), a full fine-tuning and a LoRA fine-tuning from its export."""
    root = tmp_path_factory.mktemp("interpolation_runs")
    run(tiny_config(shapes_root, root, "experiment=backbone", "trainer.max_steps=2"))
    backbone = root / "backbone" / "export"
    common = [f"model.pretrained={backbone}", "trainer.max_steps=2", "optim.lr=1e-2"]
    run(tiny_config(shapes_root, root, "experiment=full", *common))
    run(tiny_config(shapes_root, root, "experiment=lora", *common, "model.lora.rank=4"))
    return {"root": root, "backbone": root / "backbone", "full": root / "full", "lora": root / "lora"}


def weights(export_dir: Path) -> dict:
    return torch.load(export_dir / "open_clip.pt")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float32 tensor (tells -0.0 from 0.0, which torch.equal does not)."""
    return tensor.contiguous().view(torch.int32)


def test_alpha_0_and_1_exports_are_the_pretrained_and_finetuned_exports_bit_for_bit(runs, tmp_path):
    interpolation.main(["--run", str(runs["full"]), "--alphas", "0,1,0.25", "--out", str(tmp_path)])
    ends = {"alpha-0": runs["backbone"] / "export", "alpha-1": runs["full"] / "export"}
    for folder, end in ends.items():
        written, expected = weights(tmp_path / folder), weights(end)
        assert list(written) == list(expected)
        assert all(torch.equal(bits(written[key]), bits(expected[key])) for key in expected), folder
        assert hashlib.sha256((tmp_path / folder / "open_clip.pt").read_bytes()).digest() == \
            hashlib.sha256((end / "open_clip.pt").read_bytes()).digest()
    start, end, middle = weights(ends["alpha-0"]), weights(ends["alpha-1"]), weights(tmp_path / "alpha-0.25")
    for key in middle:
        reference = (0.75 * start[key].double() + 0.25 * end[key].double()).float()
        assert torch.equal(middle[key], reference), key
    assert any(not torch.equal(middle[key], start[key]) for key in middle)
    meta = json.loads((tmp_path / "alpha-0.25" / "model.json").read_text())
    assert meta["model"] == TINY and meta["wise_ft"]["alpha"] == 0.25
    assert meta["wise_ft"]["backbone"]["pretrained"] == str(runs["backbone"] / "export")
    assert meta["wise_ft"]["finetuned"] == str(runs["full"] / "export")
    # a plain open_clip checkpoint: open_clip builds it as it is
    open_clip.add_model_config(tmp_path / "alpha-0.25" / "model_configs")
    model = open_clip.create_model(TINY, pretrained=str(tmp_path / "alpha-0.25" / "open_clip.pt"))
    assert all(torch.equal(model.state_dict()[key], middle[key]) for key in middle)


def test_a_lora_run_interpolates_its_merged_adapters(runs):
    """The fine-tuned end of a LoRA run is its export (the adapters merged): only the adapted layers move along
    the path, linearly."""
    endpoints = load_endpoints(runs["lora"] / "export")
    start = endpoints.pretrained.model.state_dict()
    end = endpoints.finetuned.model.state_dict()
    moved = [key for key in end if not torch.equal(start[key], end[key])]
    assert moved and all(key.endswith(("out_proj.weight", "c_fc.weight", "c_proj.weight")) for key in moved)
    half = interpolate_state(start, end, 0.5)
    for key in moved:
        assert torch.allclose(half[key] - start[key], (end[key] - start[key]) / 2, atol=1e-7)


def test_evaluation_scores_each_alpha_in_memory_and_keeps_per_item_outcomes(runs, shapes_root, tmp_path):
    out = tmp_path / "eval"
    common = ["--benchmarks", "shapes_swap", f"roots.shapes_swap={shapes_root}", "--no-progress"]
    evaluate.main(["--run", str(runs["full"]), "--alphas", "0,0.5,1", "--out", str(out), *common])
    assert sorted(path.name for path in out.iterdir()) == ["alpha-0", "alpha-0.5", "alpha-1"]
    assert not list(out.rglob("*.pt"))  # the interpolated models are never written
    for folder in ("alpha-0", "alpha-0.5", "alpha-1"):
        assert (out / folder / "shapes_swap" / "outcomes.jsonl").is_file()
        metadata = json.loads((out / folder / "shapes_swap" / "metadata.json").read_text())["metadata"]
        assert metadata["wise_ft"]["alpha"] == float(folder.partition("-")[2])
        assert metadata["weights_sha256"] == hashlib.sha256((runs["full"] / "export" / "open_clip.pt")
                                                            .read_bytes()).hexdigest()
    # the ends score as the two exports do, item by item
    for folder, run_dir in (("alpha-0", runs["backbone"]), ("alpha-1", runs["full"])):
        evaluate.main(["--run", str(run_dir), "--out", str(tmp_path / run_dir.name), *common])
        assert (out / folder / "shapes_swap" / "outcomes.jsonl").read_text() == \
            (tmp_path / run_dir.name / "shapes_swap" / "outcomes.jsonl").read_text()


def test_different_architectures_are_refused_before_anything_is_written(runs, shapes_root, tmp_path):
    other = tmp_path / "other"
    run(tiny_config(shapes_root, other, "experiment=shapes", "model.name=ViT-Shapes-16-64", "trainer.max_steps=1"))
    refusal = "different architectures: ViT-Shapes-16-64 has embed_dim=128, ViT-Tiny-16-64 has 64"
    with pytest.raises(SystemExit, match=refusal):
        interpolation.main(["--run", str(runs["full"]), "--alphas", "0.5", "--out", str(tmp_path / "out"),
                            "--pretrained", str(other / "shapes" / "export")])
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit, match="different architectures"):
        evaluate.main(["--run", str(runs["full"]), "--alphas", "0.5", "--out", str(tmp_path / "eval"),
                       "--pretrained", str(other / "shapes" / "export"), "--benchmarks", "shapes_swap",
                       f"roots.shapes_swap={shapes_root}"])
    assert not (tmp_path / "eval").exists()
    a, b = load_export(runs["full"] / "export"), load_export(other / "shapes" / "export")
    with pytest.raises(InterpolationError, match="different architectures"):
        check_same_architecture(a, b)
    check_same_architecture(a, load_export(runs["backbone"] / "export"))


def test_a_run_from_random_weights_has_no_pretrained_end(runs, tmp_path):
    with pytest.raises(SystemExit, match="started from random weights.*--pretrained"):
        interpolation.main(["--run", str(runs["backbone"]), "--alphas", "0.5", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    # an explicit pretrained end is accepted
    interpolation.main(["--run", str(runs["full"]), "--alphas", "0", "--out", str(tmp_path / "explicit"),
                        "--pretrained", str(runs["backbone"] / "export")])
    assert torch.equal(weights(tmp_path / "explicit" / "alpha-0")["text_projection"],
                       weights(runs["backbone"] / "export")["text_projection"])


@pytest.mark.parametrize("text,message", [("0,1.5", r"in \[0, 1\]"), ("a", "comma-separated"),
                                          ("0.5,0.5", "repeated"), ("nan", r"in \[0, 1\]")])
def test_alphas_are_checked(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_alphas(text)
    assert parse_alphas("0, 0.25,1") == [0.0, 0.25, 1.0]


def test_a_long_context_run_interpolates_with_its_stretched_backbone(runs, shapes_root):
    """The pretrained end of a run that stretched its text context (Long-CLIP) is the stretched backbone it
    started from: same architecture, the kept positions identical at both ends."""
    root = runs["root"]
    run(tiny_config(shapes_root, root, "experiment=long", f"model.pretrained={runs['backbone'] / 'export'}",
                    "model.context_length=248", "trainer.max_steps=2", "optim.lr=1e-2"))
    endpoints = load_endpoints(root / "long" / "export")
    assert endpoints.pretrained.name == endpoints.finetuned.name == f"{TINY}-ctx248"
    start, end = (e.model.positional_embedding.detach() for e in (endpoints.pretrained, endpoints.finetuned))
    assert start.shape[0] == 248 and torch.equal(start[:20], end[:20]) and not torch.equal(start, end)
    half = interpolate_state(endpoints.pretrained.model.state_dict(), endpoints.finetuned.model.state_dict(), 0.5)
    assert torch.equal(half["positional_embedding"][:20], start[:20])
