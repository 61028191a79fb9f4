"""The GPU throughput benchmark (`python -m perf.gpu`): its CPU mode end to end (the JSON and Markdown it writes),
its refusal without CUDA, the device peak table, and the pieces it relies on (perf.step's cached-feature batch of
the aligners, the scorer's device)."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from modeling.encoders import build_model
from evaluation.scorers import ClipScorer
from lightning_modules.methods.tflocal import is_feature_batch
from perf import gpu, step
from tolerance import assert_scaled_close

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TINY = "ViT-Tiny-16-64"


class SlowClock:
    """perf.gpu's clock on a machine as slow as can be: each reading is 1000 s after the one before. Under a time
    budget every row and section after the first would be skipped as "time budget spent"."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1000.0
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One CPU-mode run without a time budget, through the path of a node without spaCy: caption records written
    beforehand, read at run time. perf.gpu reads a clock that makes the machine look arbitrarily slow: what the
    tests check must not depend on how fast the machine is (the step times are perf.step's own, still real)."""
    out = tmp_path_factory.mktemp("perf_gpu")
    gpu.main(["--write-records", "--record-count", "4", "--out", str(out / "records.json")])
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gpu, "time", SlowClock())
            gpu.main(["--cpu-smoke", "--no-budget", "--records", str(out / "records.json"), "--peak-tflops", "2.5",
                      "--out", str(out / "gpu")])
    finally:
        step.PREPARED_RECORDS.clear()
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text()


def test_every_method_row_has_its_numbers(smoke):
    result, _ = smoke
    assert result["schema"] == gpu.SCHEMA and result["mode"] == "cpu_smoke"
    assert list(result["training"]) == list(gpu.LEAD_ROWS)
    for label, row in result["training"].items():
        assert tuple(row) == gpu.TRAINING_KEYS
        assert row["status"] == "ok", (label, row["error"])
        assert row["precision"] == {"clip_ft+tf32": "tf32", "clip_ft+32-true": "32-true"}.get(label, "bf16-mixed")
        assert row["batch_size"] == 4 and row["timed_steps"] == 2 == len(row["step_times_s"])
        assert row["median_step_s"] > 0 and row["samples_per_s"] == pytest.approx(4 / row["median_step_s"])
        assert row["peak_memory_gib"] > 0 and row["memory_kind"] == "cpu_saved_for_backward"
        assert row["loss_finite"] and row["grads_finite"] and row["parameters_with_grad"] > 0
    gradient_based = {label for label, row in result["training"].items() if row["double_backward"]}
    assert gradient_based == {"cae_gradcam", "cae_gradient", "cae_grad_eclip"}


def test_frozen_backbone_rows_train_the_aligner_only(smoke):
    rows = smoke[0]["training"]
    aligner = rows["tflocal"]["trainable_parameters"]
    assert aligner == rows["tfglobal"]["trainable_parameters"] == rows["tflocal_hard16"]["trainable_parameters"]
    assert aligner < rows["clip_ft"]["trainable_parameters"]


def test_every_row_counts_its_flops_and_gives_the_mfu_of_its_precision(smoke):
    """FLOPs of forward and backward for every method; the MFU against the peak of the row's precision (TF32:
    half the bf16 peak; plain fp32: none) and against the matmul measured in it."""
    result, _ = smoke
    device = result["device"]
    assert device["bf16_peak_tflops"] == 2.5 and device["peak_source"] == "--peak-tflops"
    row = result["training"]["clip_ft"]
    assert "aten.convolution" in row["flops_by_op"] and "aten.convolution_backward" in row["flops_by_op"]
    peaks = {"bf16-mixed": 2.5, "tf32": 1.25, "32-true": None}
    matmuls = {"bf16-mixed": "matmul_bf16_tflops", "tf32": "matmul_tf32_tflops", "32-true": "matmul_fp32_tflops"}
    for label, row in result["training"].items():
        assert row["flops_per_step"] == sum(row["flops_by_op"].values()) > 0, label
        achieved = row["flops_per_step"] / row["median_step_s"] / 1e12
        assert row["achieved_tflops"] == pytest.approx(achieved)
        peak = peaks[row["precision"]]
        assert row["peak_tflops"] == peak and row["mfu"] == (None if peak is None else pytest.approx(achieved / peak))
        assert row["mfu_of_matmul"] == pytest.approx(achieved / device[matmuls[row["precision"]]])
    # The same model and batch in every precision: the same FLOPs.
    flops = {result["training"][label]["flops_per_step"] for label in ("clip_ft", "clip_ft+tf32", "clip_ft+32-true")}
    assert len(flops) == 1


def test_grounding_and_evaluation_sections(smoke):
    result, _ = smoke
    grounding = result["grounding"]
    assert grounding["status"] == "ok", grounding["error"]
    assert grounding["image_size"] == 224 and grounding["images_per_s"] > 0
    assert grounding["pairs_per_s"] == pytest.approx(grounding["images_per_s"] * grounding["phrases_per_image"])
    evaluation = result["evaluation"]
    assert evaluation["status"] == "ok", evaluation["error"]
    sugarcrepe = evaluation["benchmarks"]["sugarcrepe"]
    assert sugarcrepe["items"] == 14 and sugarcrepe["items_per_s"] == pytest.approx(14 / sugarcrepe["seconds"])


def test_markdown_has_a_row_per_method_and_each_section(smoke):
    _, markdown = smoke
    for label in gpu.LEAD_ROWS:
        assert f"| {label} | 4 | {label.partition('+')[2] or 'bf16-mixed'} | ok | " in markdown
    assert "## GroundingDINO preprocessing" in markdown and "| 224 (max 373) | 1 | 1 | 1 |" in markdown
    assert "| sugarcrepe | ok | 14 |" in markdown
    assert "2.5 TFLOP/s (--peak-tflops)" in markdown
    assert "s (no time budget)." in markdown


def test_the_budget_is_a_choice():
    assert gpu.parse_args(["--no-budget"]).no_budget and gpu.parse_args([]).budget_s is None
    with pytest.raises(SystemExit):
        gpu.parse_args(["--no-budget", "--budget-s", "60"])


def test_refuses_without_cuda_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as refusal:
        gpu.main(["--out", str(tmp_path / "gpu")])
    message = refusal.value.code
    assert isinstance(message, str) and "\n" not in message  # printed to stderr, exit status 1
    assert "no CUDA device" in message and "python -m perf.gpu --cpu-smoke" in message
    assert not list(tmp_path.iterdir())


def test_unknown_rows_fail_before_any_work():
    with pytest.raises(SystemExit, match="unknown perf.step variant 'clip_fx'"):
        gpu.main(["--cpu-smoke", "--methods", "clip_ft,clip_fx"])
    with pytest.raises(SystemExit, match="positive integer"):
        gpu.main(["--cpu-smoke", "--methods", "tflocal@x"])
    with pytest.raises(SystemExit, match="the precision after \\+ is one of"):
        gpu.main(["--cpu-smoke", "--methods", "clip_ft+fp32"])
    assert gpu.parse_row("tflocal@64", 256, fixed_batch=False) == ("tflocal", 64, "bf16-mixed")
    assert gpu.parse_row("tflocal@64", 4, fixed_batch=True) == ("tflocal", 4, "bf16-mixed")
    assert gpu.parse_row("clip_ft@32+tf32", 256, fixed_batch=False) == ("clip_ft", 32, "tf32")


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.5), ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA L40S", 362.05),
    ("NVIDIA L40", 181.05), ("NVIDIA L4", 121.0), ("NVIDIA A10", 125.0), ("NVIDIA A10G", None),
    ("Tesla V100-SXM2-32GB", None)])
def test_bf16_peak_table(name, peak):
    value, source = gpu.bf16_peak(name, None)
    assert value == peak
    assert ("datasheet" in source) == (peak is not None)
    assert gpu.bf16_peak(name, 123.0) == (123.0, "--peak-tflops")


def test_aligner_variants_time_the_cached_feature_step():
    """perf.step's TFLocal step reads the cache's layout (float16 tokens, no negatives by default), not pixels."""
    args = step.parse_args(["--model", TINY, "--batch-size", "4", "--device", "cpu", "--precision", "32-true"])
    variant = step.Variant("tflocal_hard16", args)
    batch = variant.batch
    assert is_feature_batch(batch) and "neg_text" not in batch and batch["image"].ndim == 3  # tokens, not pixels
    assert batch["image"].dtype == batch["text"].dtype == torch.float16
    assert batch["image_global"].dtype == torch.float32
    module = variant.module
    shape = module.aligner.config
    assert (shape["width"], shape["layers"], shape["heads"]) == (512, 4, 8)  # the paper's aligner
    assert module.in_batch_negatives == 16
    pixels = step.make_batch(module, 4, "cpu")
    with torch.no_grad():
        fresh = module.encode_batch({k: v for k, v in pixels.items() if k != "neg_text"})
    assert_scaled_close(batch["text"].float(), fresh["text"], rtol=1e-3)
    variant.step(timed=True)
    assert len(variant.times) == 1


def test_clip_scorer_puts_the_model_on_its_device():
    """`evaluate --device cuda` sends the inputs to the GPU, so the scorer must move the weights there too."""
    model = build_model(TINY, None, "configs/models").model
    scorer = ClipScorer(model, None, None, device="meta")
    assert all(p.device.type == "meta" for p in scorer.model.parameters())


def test_a_failing_row_is_recorded_and_the_rest_still_run(monkeypatch):
    def fake_run(row, settings, device, deadline):
        if row["variant"] == "macco":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB\n(details)")
        row.update(status="ok", samples_per_s=10.0, median_step_s=0.4, peak_memory_gib=1.0)

    monkeypatch.setattr(gpu, "run_variant", fake_run)
    rows = gpu.training_section(["clip_ft", "macco", "smartclip"], gpu.CPU_SMOKE, {"kind": "cpu"}, 60.0, True)
    assert rows["macco"]["status"] == "error"
    assert rows["macco"]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 80.00 GiB"
    assert rows["clip_ft"]["status"] == rows["smartclip"]["status"] == "ok"
    spent = gpu.training_section(["clip_ft"], gpu.CPU_SMOKE, {"kind": "cpu"}, 0.0, True)
    assert spent["clip_ft"]["status"] == "skipped" and spent["clip_ft"]["error"] == "time budget spent"
    assert gpu.guarded(lambda: 1 / 0) == {"status": "error", "error": "ZeroDivisionError: division by zero"}
    assert gpu.budgeted(0.0, lambda: 1 / 0) == {"status": "skipped", "error": "time budget spent"}


def test_results_are_rewritten_after_every_row_so_a_kill_keeps_them(monkeypatch, tmp_path):
    """A run that dies in its third row leaves the first two rows on disk, in the JSON and the Markdown."""
    def fake_run(row, settings, device, deadline):
        if row["method"] == "smartclip":
            raise KeyboardInterrupt  # stands in for a kill: nothing after it runs
        row.update(status="ok", samples_per_s=10.0, median_step_s=0.4, peak_memory_gib=1.0)

    monkeypatch.setattr(gpu, "run_variant", fake_run)
    monkeypatch.setattr(gpu, "matmul_tflops", lambda *args, **kwargs: 1.0)
    out = tmp_path / "partial"
    with pytest.raises(KeyboardInterrupt):
        gpu.main(["--cpu-smoke", "--no-budget", "--sections", "training", "--out", str(out),
                  "--methods", "clip_ft,macco,smartclip,tflocal"])
    written = json.loads((tmp_path / "partial.json").read_text())
    assert list(written["training"]) == ["clip_ft", "macco"]
    markdown = (tmp_path / "partial.md").read_text()
    assert "| clip_ft | 4 | bf16-mixed | ok | 10.0 |" in markdown and "| macco |" in markdown
    assert "smartclip" not in markdown
