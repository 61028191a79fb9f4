"""The training step reads no value back from the device where the host can measure it first.

On a GPU every read of a device value (`int(t)`, `bool(t)`, `t.tolist()`, boolean indexing, `nonzero`) waits for
the queued kernels. `CompositionalCLIPModule.on_before_batch_transfer` measures on the host batch what the step
would otherwise read (caption lengths, CAE's replacement words, the feature sets' lengths), and the losses check
on the device. Here, on the CPU: every method's terms from a batch that went through that hook equal, bit for bit,
those from the batch without it (the step then measures on the device, as it did before), and the reads left in
the step are those listed in `INHERENT_READS`, each for a shape only the device values decide.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_modules.base import HOST_LENGTHS
from lightning_modules.fit import build_datamodule, build_module
from lightning_modules.methods.tflocal import aligner_itm
from fitting import aligner_config, method_overrides, tiny_config

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select", "cpu",
         "numpy"}


class DeviceReads(TorchFunctionMode):
    """Counts the torch calls that read tensor values back to Python (a device sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads[name] += 1
        if name == "__getitem__" and _boolean_index(args[1]):
            self.reads["boolean index"] += 1
        if name == "repeat_interleave" and isinstance(kwargs.get("repeats", args[1] if len(args) > 1 else None),
                                                     torch.Tensor):
            self.reads["repeat_interleave"] += 1
        return func(*args, **kwargs)


def _boolean_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


# Each method variant: its overrides, and the reads its step still makes (shapes decided by device values).
VARIANTS = {
    "clip_ft": ([], {}),
    "clip_ft+negatives": (["method.hard_negatives.captions=2"], {}),
    "clip_cae:attention": (["method.attribution.name=attention"], {}),
    "clip_cae:gradient": (["method.attribution.name=gradient"], {}),
    # The paper's perturbation: the spliced captions' length and the packed continuations' lengths and rows.
    "clip_cae:perturbation": (["method.attribution.name=perturbation", "method.attribution.replacement=kind",
                               "method.attribution.num_replacements=2"],
                              {"__int__": 4, "boolean index": 2, "nonzero": 1}),
    # MACCO's masked-token prediction: the logits of the masked positions, and their targets.
    "macco": ([], {"boolean index": 2}),
    "smartclip": ([], {}),
    "smartclip+negatives": (["method.hard_negatives.captions=2"], {}),
    "tflocal:pixels": (["method.name=tflocal", "method.hard_negatives.captions=2"], {}),
}


def variant_config(name: str, shapes_root: Path, mask_cache: Path, runs: Path):
    overrides, _ = VARIANTS[name]
    method = name.split(":")[0].split("+")[0]
    return tiny_config(shapes_root, runs, *method_overrides(method, mask_cache), *overrides)


def module_and_batch(cfg):
    torch.manual_seed(0)
    module = build_module(cfg).train()
    datamodule = build_datamodule(cfg, module)
    datamodule.setup("fit")
    if hasattr(module, "replacement_vocabulary"):
        module.replacement_vocabulary = datamodule.replacement_vocabulary
    return module, next(iter(datamodule.train_dataloader()))


def terms_of(module, batch) -> dict:
    torch.manual_seed(1)
    terms, report = module.compute_terms(batch)
    return {**terms, **report}


def reads_of(module, batch) -> dict:
    """The device reads of one step (counted apart from the terms compared: with a torch function mode active,
    PyTorch's fused attention path steps aside, which moves the float rounding)."""
    with DeviceReads() as reads:
        terms_of(module, batch)
    return dict(reads.reads)


def assert_identical(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_host_measured_batches_give_identical_terms_and_only_the_inherent_reads(shapes_root, mask_cache, tmp_path,
                                                                               name):
    module, batch = module_and_batch(variant_config(name, shapes_root, mask_cache, tmp_path))
    host = module.on_before_batch_transfer(dict(batch), 0)
    assert host[HOST_LENGTHS] and set(host) - set(batch) <= {HOST_LENGTHS, "word_replacements"}
    assert_identical(terms_of(module, host), terms_of(module, batch))
    assert reads_of(module, host) == VARIANTS[name][1]


@pytest.mark.parametrize("loss, negatives", [("infonce", None), ("itm", None), ("infonce", 2)])
def test_feature_batches_are_trimmed_on_the_host(shapes_root, feature_cache, tmp_path, loss, negatives):  # noqa: F811
    overrides = [f"method.aligner_loss={loss}"] + ([] if negatives is None else
                                                   [f"method.aligner_negatives={negatives}"])
    module, batch = module_and_batch(aligner_config(shapes_root, tmp_path, feature_cache, *overrides))
    host = module.on_before_batch_transfer(dict(batch), 0)
    assert set(host[HOST_LENGTHS]) == {"text", "neg_text"}
    assert_identical(terms_of(module, host), terms_of(module, batch))
    # Scoring the n hardest partners only: how many pairs their union holds is read back.
    assert reads_of(module, host) == ({} if negatives is None else {"nonzero": 1})


def reference_itm(grid: torch.Tensor, hard) -> torch.Tensor:
    """The binary matching loss as it selected its terms (the device-side version weights them instead)."""
    diagonal = torch.eye(grid.shape[0], dtype=torch.bool)
    positives = grid[diagonal]
    negatives = grid[~diagonal & torch.isfinite(grid)]
    if hard is not None:
        negatives = torch.cat([negatives, hard.flatten()])
    positive = torch.nn.functional.binary_cross_entropy_with_logits(positives, torch.ones_like(positives))
    if negatives.numel() == 0:
        return positive
    return 0.5 * (positive + torch.nn.functional.binary_cross_entropy_with_logits(negatives,
                                                                                  torch.zeros_like(negatives)))


@pytest.mark.parametrize("unscored, hard", [(0.0, None), (0.4, None), (0.4, 3), (1.0, None), (1.0, 2)])
def test_itm_weights_equal_the_selected_terms_in_float64(unscored, hard):
    """Without any scored negative (unscored=1, no hard captions) the loss is the positive term alone."""
    generator = torch.Generator().manual_seed(0)
    grid = torch.randn(6, 6, generator=generator, dtype=torch.float64) * 4
    off_diagonal = ~torch.eye(6, dtype=torch.bool)
    grid[(torch.rand(6, 6, generator=generator, dtype=torch.float64) < unscored) & off_diagonal] = float("-inf")
    hard_scores = None if hard is None else torch.randn(6, hard, generator=generator, dtype=torch.float64)
    ours = aligner_itm(grid, hard_scores)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, reference_itm(grid, hard_scores), rtol=1e-14, atol=0)
