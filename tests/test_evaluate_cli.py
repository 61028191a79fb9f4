"""The evaluation CLI when things go wrong, and what its results record about the weights they scored.

A benchmark that fails after others finished; a run without an export; an empty or undecodable benchmark
image; a run exported again between two evaluations into one folder; where `--tensorboard` wrote.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling.encoders import build_model
from modeling.export import export_model
from evaluation import evaluate
from evaluation.benchmarks import BENCHMARKS
from testkit.standin.sts import write_sickr, write_stsb
from testkit.standin.sugarcrepe import write_sugarcrepe
from testkit.standin.two_by_two import write_winoground
from evaluation.harness import (build_benchmarks, default_roots, read_outcomes, rewrite_tables, run_benchmark,
                                write_results)
from evaluation.scorers import FunctionScorer

REPO = Path(__file__).resolve().parents[1]
TINY = "ViT-Tiny-16-64"
SUGARCREPE_ITEMS = 28


def export_tiny(run: Path, seed: int, step: int) -> Path:
    """A random tiny model's export in `run/export`, as fit leaves it at `step`; returns the weights file."""
    torch.manual_seed(seed)
    built = build_model(TINY, None, "configs/models")
    return export_model(built.model, built.name, run / "export", {"global_step": step})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def tiny_run(tmp_path) -> Path:
    run = tmp_path / "run"
    export_tiny(run, seed=0, step=3)
    return run


@pytest.fixture
def data_root(tmp_path) -> Path:
    root = tmp_path / "benchmarks"
    write_sugarcrepe(root / "sugarcrepe", n_items=SUGARCREPE_ITEMS)
    write_sickr(root / "sickr", n_items=12)
    return root


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """`python -m evaluation ...` in a real process, as a researcher runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "evaluation", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def common(run: Path, data_root: Path, out: Path) -> list:
    return ["--run", str(run), "--data-root", str(data_root), "--out", str(out), "--num-workers", "0",
            "--no-progress"]


# ---------------------------------------------------------------- a benchmark failing after others finished


def test_a_failing_benchmark_keeps_those_that_finished_and_exits_non_zero(tiny_run, data_root, tmp_path,
                                                                          monkeypatch, capsys):
    """--all: sugarcrepe finishes, sickr fails, stsb (after it) still runs; both finished ones are on disk."""
    write_stsb(data_root / "stsb", n_items=10)
    out = tmp_path / "eval"
    on_disk_when_sickr_ran = []

    def planted_failure(self, scorer, progress=False):
        on_disk_when_sickr_ran.append((out / "sugarcrepe" / "outcomes.jsonl").is_file()
                                      and "sugarcrepe" in json.loads((out / "aggregates.json").read_text())[
                                          "benchmarks"])
        raise RuntimeError("planted failure")

    monkeypatch.setattr(BENCHMARKS["sickr"], "outcomes", planted_failure)
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([*common(tiny_run, data_root, out), "--all"])
    assert exit_info.value.code not in (None, 0)
    assert "1 of 3 benchmarks failed (sickr)" in str(exit_info.value.code) and str(out) in str(exit_info.value.code)
    assert "failed: sickr: RuntimeError: planted failure" in capsys.readouterr().err
    assert on_disk_when_sickr_ran == [True]  # written as it finished, not at the end
    assert len(read_outcomes(out / "sugarcrepe" / "outcomes.jsonl")) == SUGARCREPE_ITEMS
    assert len(read_outcomes(out / "stsb" / "outcomes.jsonl")) == 10
    assert not (out / "sickr").exists()
    document = json.loads((out / "aggregates.json").read_text())
    assert set(document["benchmarks"]) == {"sugarcrepe", "stsb"}
    with open(out / "results.csv", newline="") as handle:
        rows = {row["benchmark"] for row in csv.DictReader(handle)}
    assert rows == {"sugarcrepe", "stsb", "vl_compo_comp_avg", "fsc_clip_comp"}  # the suites SugarCrepe is part of
    assert "sugarcrepe" not in document["combined"]["vl_compo_comp_avg"]["missing"]
    markdown = (out / "results.md").read_text()
    assert f"| sugarcrepe | {SUGARCREPE_ITEMS} |" in markdown and "| stsb | 10 |" in markdown


def test_an_undecodable_image_fails_its_benchmark_in_one_line_in_a_real_process(tiny_run, data_root, tmp_path):
    """A non-empty file that is not an image, decoded in a DataLoader worker: the benchmark is named with the
    file, no traceback, exit status 1, and the benchmark scored before it is kept."""
    images = Path(write_winoground(data_root / "winoground", n_items=3)["images"])
    broken = images / "ex_1_img_0.png"
    broken.write_bytes(b"these bytes are not a PNG image")
    out = tmp_path / "eval"
    result = run_cli("--run", str(tiny_run), "--all", "--data-root", str(data_root), "--out", str(out),
                     "--num-workers", "1", "--no-progress")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("failed: ")]
    assert failed == [f"failed: winoground: UnreadableImageError: cannot read benchmark image {broken}: cannot "
                      f"identify image file '{broken}'; copy it again from the benchmark's release"]
    assert "1 of 3 benchmarks failed (winoground)" in result.stderr
    assert set(json.loads((out / "aggregates.json").read_text())["benchmarks"]) == {"sugarcrepe", "sickr"}


# ---------------------------------------------------------------- bad input: one line, no traceback


def forbid_model_building(monkeypatch) -> None:
    def no_model(args):
        raise AssertionError("a model was built although the input is bad")

    monkeypatch.setattr(evaluate, "build_scorer", no_model)


def test_a_run_without_an_export_is_one_line_naming_the_run_before_any_model_is_built(data_root, tmp_path,
                                                                                      monkeypatch):
    run = tmp_path / "runs" / "unfinished"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(f"experiment: unfinished\nruns_root: {run.parent}\nresume: true\n")
    forbid_model_building(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--run", str(run), "--benchmarks", "sugarcrepe", "--data-root", str(data_root)])
    message = str(exit_info.value.code)
    assert "\n" not in message and message.startswith(f"run {run} has no export yet")
    assert f"python -m lightning_modules.fit --config {run / 'config.yaml'}" in message
    assert not (run / "eval").exists()


def test_a_missing_run_folder_is_one_line(data_root, tmp_path):
    with pytest.raises(SystemExit, match=f"^no run folder {tmp_path / 'nowhere'}: --run takes"):
        evaluate.main(["--run", str(tmp_path / "nowhere"), "--benchmarks", "sugarcrepe", "--data-root",
                       str(data_root)])


def test_an_empty_image_stops_before_any_model_is_built_naming_the_file(tiny_run, data_root, tmp_path,
                                                                        monkeypatch):
    empty = sorted((data_root / "sugarcrepe" / "val2017").iterdir())[2]
    empty.write_bytes(b"")
    forbid_model_building(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([*common(tiny_run, data_root, tmp_path / "eval"), "--benchmarks", "sugarcrepe,sickr"])
    message = str(exit_info.value.code)
    assert message == (f"sugarcrepe: 1 image files are empty (0 bytes): {empty}; copy them again from the "
                       f"benchmark's release")
    assert not (tmp_path / "eval").exists()


# ---------------------------------------------------------------- what was scored


def records(out: Path) -> dict:
    """Per benchmark: (global_step, weights_sha256) from aggregates.json, its own metadata.json and the CSV."""
    document = json.loads((out / "aggregates.json").read_text())
    with open(out / "results.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    found = {}
    for name, entry in document["benchmarks"].items():
        own = json.loads((out / name / "metadata.json").read_text())["metadata"]
        csv_records = {(int(row["global_step"]), row["weights_sha256"]) for row in rows if row["benchmark"] == name}
        found[name] = {(entry["metadata"]["global_step"], entry["metadata"]["weights_sha256"]),
                       (own["global_step"], own["weights_sha256"]), *csv_records}
    return found


def test_a_run_exported_again_is_told_apart_by_step_and_hash(tiny_run, data_root, tmp_path, capsys):
    out = tmp_path / "eval"
    first = sha256(tiny_run / "export" / "open_clip.pt")
    evaluate.main([*common(tiny_run, data_root, out), "--benchmarks", "sugarcrepe,sickr"])
    assert records(out) == {"sugarcrepe": {(3, first)}, "sickr": {(3, first)}}
    assert json.loads((out / "aggregates.json").read_text())["mixed_weights"] == {}
    assert "Mixed weights" not in (out / "results.md").read_text()

    second = sha256(export_tiny(tiny_run, seed=1, step=7))  # training went on and exported again
    assert second != first
    capsys.readouterr()
    evaluate.main([*common(tiny_run, data_root, out), "--benchmarks", "sugarcrepe"])
    assert records(out) == {"sugarcrepe": {(7, second)}, "sickr": {(3, first)}}
    document = json.loads((out / "aggregates.json").read_text())
    mixed = document["mixed_weights"]
    source = f"{TINY} from {tiny_run / 'export'}"
    assert list(mixed) == [source]
    assert mixed[source] == {f"step 7, sha256 {second[:12]}": ["sugarcrepe"],
                                                f"step 3, sha256 {first[:12]}": ["sickr"]}
    markdown = (out / "results.md").read_text()
    assert "**Mixed weights**" in markdown
    assert f"| step 7, sha256 {second[:12]} |" in markdown and f"| step 3, sha256 {first[:12]} |" in markdown
    assert "was scored from 2 different weights" in capsys.readouterr().err

    evaluate.main([*common(tiny_run, data_root, out), "--benchmarks", "sickr"])  # the stale one again
    assert records(out) == {"sugarcrepe": {(7, second)}, "sickr": {(7, second)}}
    assert json.loads((out / "aggregates.json").read_text())["mixed_weights"] == {}


def test_a_checkpoint_file_records_its_hash_and_a_tag_records_the_tag(tiny_run, data_root, tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes((tiny_run / "export" / "open_clip.pt").read_bytes())
    argv = ["--benchmarks", "sickr", "--data-root", str(data_root), "--num-workers", "0", "--no-progress"]
    evaluate.main(["--model", TINY, "--pretrained", str(checkpoint), "--out", str(tmp_path / "file"), *argv])
    metadata = json.loads((tmp_path / "file" / "sickr" / "metadata.json").read_text())["metadata"]
    assert metadata["weights_sha256"] == sha256(checkpoint) and "global_step" not in metadata
    evaluate.main(["--model", TINY, "--pretrained", str(tiny_run / "export"), "--out", str(tmp_path / "dir"), *argv])
    metadata = json.loads((tmp_path / "dir" / "aggregates.json").read_text())["metadata"]
    assert metadata["weights_sha256"] == sha256(checkpoint) and metadata["global_step"] == 3
    evaluate.main(["--model", TINY, "--out", str(tmp_path / "random"), *argv])  # random init: no file to hash
    metadata = json.loads((tmp_path / "random" / "aggregates.json").read_text())["metadata"]
    assert metadata["pretrained"] is None and "weights_sha256" not in metadata


def test_weights_replaced_while_loading_are_refused(tiny_run, data_root, tmp_path, monkeypatch):
    """The hash recorded must be the hash of the weights loaded: an export written meanwhile is refused."""
    build = evaluate.build_scorer

    def export_during_the_build(args):
        export_tiny(tiny_run, seed=1, step=9)
        return build(args)

    monkeypatch.setattr(evaluate, "build_scorer", export_during_the_build)
    with pytest.raises(SystemExit, match="open_clip.pt was replaced while the model was being loaded"):
        evaluate.main([*common(tiny_run, data_root, tmp_path / "eval"), "--benchmarks", "sickr"])
    assert not (tmp_path / "eval").exists()


def test_outcomes_replaced_behind_their_metadata_are_not_attributed_to_it(data_root, tmp_path):
    """metadata.json carries the hash of the outcomes it describes; outcomes written without it (an interrupted
    write, a hand edit) are shown as scored by an unknown run, never under another run's weights."""
    sugarcrepe = build_benchmarks(["sugarcrepe"], default_roots(data_root, {}), {})["sugarcrepe"]
    out = tmp_path / "eval"
    write_results(out, [run_benchmark(sugarcrepe, FunctionScorer(lambda ref, text: 0.0))],
                  {"model": "x", "weights_sha256": "aaaa"})
    assert json.loads((out / "aggregates.json").read_text())["benchmarks"]["sugarcrepe"]["metadata"] == {
        "model": "x", "weights_sha256": "aaaa"}
    outcomes = out / "sugarcrepe" / "outcomes.jsonl"
    outcomes.write_text("".join(outcomes.read_text().splitlines(keepends=True)[1:]))  # one item dropped by hand
    rewrite_tables(out)
    assert json.loads((out / "aggregates.json").read_text())["benchmarks"]["sugarcrepe"]["metadata"] == {
        "scored_by": "unknown: its metadata.json does not describe its outcomes.jsonl"}


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_says_where_the_events_went_and_logs_at_the_export_step(tiny_run, data_root, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tb"
    evaluate.main([*common(tiny_run, data_root, tmp_path / "eval"), "--benchmarks", "sickr", "--tensorboard",
                   str(log_dir)])
    assert f"TensorBoard events in {log_dir}\n" in capsys.readouterr().out
    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert tags and all(event.step == 3 for tag in tags for event in events.Scalars(tag))
