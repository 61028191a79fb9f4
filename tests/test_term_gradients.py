"""perf.term_gradients: per-term gradient norms per tower against a plain backward of each term, MACCO's
stop-gradients seen through it, and the command end to end on the tiny shapes world."""
from __future__ import annotations

import json

import pytest
import torch
from test_fit import TINY, a_batch, mask_cache, shapes_root, tiny_config  # noqa: F401 (pytest fixtures)

from core.config import REPO_ROOT
from lightning_modules.fit import build_module
from perf.term_gradients import TOWERS, main, term_report
from tolerance import scaled_close

MACCO = ["method.name=macco", "data.masks=true"]


def macco_module_and_batch(shapes_root, mask_cache, tmp_path):
    cfg = tiny_config(shapes_root, tmp_path, *MACCO, f"preprocess.cache_root={mask_cache}")
    torch.manual_seed(0)
    module = build_module(cfg)
    module.train()
    return module, a_batch(module, cfg)


def reference_norms(module, batch, term: str) -> dict:
    """One term's gradient norm per tower by the obvious route: backward of that term alone into .grad, then
    the parameters sorted by their names (visual.* image; other clip.* text but logit_scale; the rest other)."""
    torch.manual_seed(1)  # the masks of a batch are fixed; the seed keeps any sampling in compute_terms equal
    module.zero_grad(set_to_none=True)
    terms, _ = module.compute_terms(batch)
    terms[term].backward()
    squares = {tower: 0.0 for tower in TOWERS}
    clip_names = {id(p): name for name, p in module.clip.named_parameters()}
    for p in module.parameters():
        if p.grad is None:
            continue
        name = clip_names.get(id(p))
        tower = ("other" if name is None or name == "logit_scale" else
                 "image" if name.startswith("visual.") else "text")
        squares[tower] += float(p.grad.double().pow(2).sum())
    module.zero_grad(set_to_none=True)
    return {tower: value ** 0.5 for tower, value in squares.items()}


def test_each_terms_norms_match_a_plain_backward_and_macco_stop_gradients_show(shapes_root, mask_cache, tmp_path):
    module, batch = macco_module_and_batch(shapes_root, mask_cache, tmp_path)
    torch.manual_seed(1)
    report = term_report(module, batch)
    assert set(report) == {"mca_loss", "mir_loss", "mlm_loss", "mim_loss"}
    for term in report:
        expected = reference_norms(module, batch, term)
        for tower in TOWERS:
            assert scaled_close(report[term][tower]["norm"], expected[tower], rtol=1e-4), (term, tower)
    # L_mlm and L_mim never reach the image encoder (detached keys / queries); the contrastive terms do.
    assert report["mlm_loss"]["image"]["norm"] == 0.0 and report["mim_loss"]["image"]["norm"] == 0.0
    assert report["mca_loss"]["image"]["norm"] > 0 and report["mlm_loss"]["text"]["norm"] > 0
    assert report["mim_loss"]["text"]["norm"] > 0  # its keys are the full text tokens, not detached


def test_a_single_term_points_where_the_total_does(shapes_root, tmp_path):
    cfg = tiny_config(shapes_root, tmp_path, "method.name=clip_ft")
    torch.manual_seed(0)
    module = build_module(cfg)
    report = term_report(module, a_batch(module, cfg))
    assert list(report) == ["itc_loss"]
    for tower in ("text", "image"):
        assert report["itc_loss"][tower]["cos_total"] == pytest.approx(1.0, rel=1e-9)


def test_the_command_writes_its_table(shapes_root, mask_cache, tmp_path, capsys):
    out = tmp_path / "terms.json"
    main(["--config", str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), "--batches", "2", "--json", str(out),
          f"model.name={TINY}", f"data.root={shapes_root}", f"runs_root={tmp_path}", "data.batch_size=8",
          "data.num_workers=0", *MACCO, f"preprocess.cache_root={mask_cache}"])
    written = json.loads(out.read_text())
    assert written["batches"] == 2 and set(written["terms"]) == {"mca_loss", "mir_loss", "mlm_loss", "mim_loss"}
    printed = capsys.readouterr().out
    assert "| mim_loss |" in printed and "mean over 2 batches of 8" in printed


def test_zero_batches_is_refused():
    with pytest.raises(SystemExit, match="at least 1"):
        main(["--batches", "0"])
