"""study.term_gradients: per-term gradient norms per tower against a plain backward of each term, MACCO's
stop-gradients seen through it, and the command end to end on the tiny shapes world."""
from __future__ import annotations

import json

import pytest
import torch
from fitting import TINY, a_batch, tiny_config

from core.config import REPO_ROOT
from lightning_modules.fit import build_module
from study.term_gradients import TOWERS, main, term_report
from tolerance import scaled_close

MACCO = ["method.name=macco", "data.masks=true"]


def macco_module_and_batch(shapes_root, mask_cache, tmp_path):
    cfg = tiny_config(shapes_root, tmp_path, *MACCO, f"preprocess.cache_root={mask_cache}")
    torch.manual_seed(0)
    module = build_module(cfg)
    module.train()
    return module, a_batch(module, cfg)


def reference_gradients(module, batch, term: str) -> dict:
    """One term's gradient per tower by the obvious route: backward of that term alone into .grad, then the
    parameters sorted by their names (visual.* image; other clip.* text but logit_scale; the rest other)."""
    module.zero_grad(set_to_none=True)
    terms, _ = module.compute_terms(batch)
    terms[term].backward()
    parts = {tower: [] for tower in TOWERS}
    clip_names = {id(p): name for name, p in module.clip.named_parameters()}
    for p in module.parameters():
        name = clip_names.get(id(p))
        tower = ("other" if name is None or name == "logit_scale" else
                 "image" if name.startswith("visual.") else "text")
        parts[tower].append(torch.zeros_like(p).double().flatten() if p.grad is None else p.grad.double().flatten())
    module.zero_grad(set_to_none=True)
    return {tower: torch.cat(vectors) for tower, vectors in parts.items()}


def test_each_terms_norm_and_cosine_match_a_plain_backward_and_macco_stop_gradients_show(shapes_root, mask_cache,
                                                                                      tmp_path):
    module, batch = macco_module_and_batch(shapes_root, mask_cache, tmp_path)
    report = term_report(module, batch)
    assert set(report) == {"mca_loss", "mir_loss", "mlm_loss", "mim_loss"}
    expected = {term: reference_gradients(module, batch, term) for term in report}
    for tower in TOWERS:
        total = sum(grads[tower] for grads in expected.values())
        for term, grads in expected.items():
            norm = float(grads[tower].norm())
            assert scaled_close(report[term][tower]["norm"], norm, rtol=1e-4), (term, tower)
            if norm > 0:
                cos = float(grads[tower] @ total / (norm * total.norm()))
                assert report[term][tower]["cos_total"] == pytest.approx(cos, abs=1e-4), (term, tower)
    # L_mlm and L_mim never reach the image encoder (detached keys / queries); the contrastive terms do.
    assert report["mlm_loss"]["image"]["norm"] == 0.0 and report["mim_loss"]["image"]["norm"] == 0.0
    assert report["mca_loss"]["image"]["norm"] > 0 and report["mlm_loss"]["text"]["norm"] > 0
    assert report["mim_loss"]["text"]["norm"] > 0  # its keys are the full text tokens, not detached
    # several terms pull the text tower: none of them points exactly where the sum does
    assert all(abs(report[term]["text"]["cos_total"]) < 0.999 for term in report)


class NonFiniteTerms(torch.nn.Module):
    def compute_terms(self, batch):
        return {"itc_loss": torch.tensor(1.0), "attr_loss": torch.tensor(float("nan"))}, {}


def test_a_non_finite_term_is_an_error_not_a_nan_in_the_table():
    with pytest.raises(FloatingPointError, match="attr_loss"):
        term_report(NonFiniteTerms(), {})


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
    main(["--config", str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), "--batches", "2", "--out", str(out),
          f"model.name={TINY}", f"data.root={shapes_root}", f"runs_root={tmp_path}", "data.batch_size=8",
          "data.num_workers=0", *MACCO, f"preprocess.cache_root={mask_cache}"])
    written = json.loads(out.read_text())
    assert written["batches"] == 2 and set(written["terms"]) == {"mca_loss", "mir_loss", "mlm_loss", "mim_loss"}
    printed = capsys.readouterr().out
    assert "| mim_loss |" in printed and "mean over 2 batches of 8" in printed


def test_zero_batches_is_refused():
    with pytest.raises(SystemExit, match="at least 1"):
        main(["--batches", "0"])
