"""The GPU node check (`python -m gpucheck`) in its CPU mode: every stage end to end from a prepared bundle, what a
kill part-way leaves, a stage cut off by its timeout, and the bundle's preparation and size report. No assertion
depends on how fast the machine is: a timeout here only guards against a hang, or cuts off a stage that waits
forever."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpucheck import bundle as gpu_bundle
from gpucheck import check as gpu_check
from gpucheck import stages as gpu_stages

REPO = Path(__file__).resolve().parents[1]
TINY_WORLD = {"n_train": 16, "n_val": 8, "image_size": 64, "seed": 0}
HANG_GUARD_S = 3600  # only a hung check reaches it


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """A bundle as `make gpu-prepare` writes it, without wheels (this interpreter has every package)."""
    folder = tmp_path_factory.mktemp("bundle")
    gpu_bundle.prepare(folder, TINY_WORLD, record_count=8)
    return folder


def check_command(bundle: Path, tmp: Path, *extra: str) -> list:
    return [sys.executable, "-m", "gpucheck", "--device", "cpu", "--bundle", str(bundle), "--work",
            str(tmp / "work"), "--out", str(tmp / "out" / "check"), *extra]


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def finished(bundle, tmp_path_factory) -> tuple:
    """One whole check in its CPU mode, run as the command line runs it."""
    tmp = tmp_path_factory.mktemp("check")
    done = subprocess.run(check_command(bundle, tmp), cwd=REPO, env=environment(), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    return done, json.loads((tmp / "out" / "check.json").read_text()), (tmp / "out" / "check.md").read_text(), tmp


def test_every_stage_passes_and_writes_json_markdown_and_log(finished):
    done, result, markdown, tmp = finished
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert result["schema"] == gpu_check.SCHEMA and result["finished"]
    assert {name: entry["status"] for name, entry in result["stages"].items()} == dict.fromkeys(gpu_stages.STAGES,
                                                                                               "ok")
    for name in gpu_stages.STAGES:
        assert f"| {name} | ok |" in markdown
    log = (tmp / "out" / "check.log").read_text()
    assert all(f"stage {name} (timeout" in log for name in gpu_stages.STAGES)


def test_environment_records_versions_commit_and_bundle(finished, bundle):
    environment_result = finished[1]["stages"]["environment"]["result"]
    assert environment_result["packages"]["torch"]["version"] and environment_result["missing_modules"] == []
    assert environment_result["torch"]["torch"] and environment_result["bundle"]["within_limit"]
    assert environment_result["bundle"] == json.loads((bundle / gpu_bundle.MANIFEST).read_text())
    assert "## Environment" in finished[2]


def test_every_method_fits_through_the_command_then_resumes_exports_and_evaluates(finished):
    fit = finished[1]["stages"]["fit"]["result"]
    settings = gpu_stages.CPU_CHECK
    assert sorted(fit["runs"]) == sorted(gpu_stages.FIT_RUNS)
    for name, run in fit["runs"].items():
        assert run["status"] == "ok" and run["rc"] == 0, (name, run.get("output_tail"))
        assert run["exported_step"] == settings.steps
    assert fit["resume"]["resumed"] and fit["resume"]["exported_step"] == settings.resume_steps
    assert fit["export"]["status"] == "ok" and fit["export"]["global_step"] == settings.resume_steps
    assert fit["evaluation"]["status"] == "ok" and fit["evaluation"]["shapes_swap"]["n"] > 0
    for name in gpu_stages.FIT_RUNS:
        assert f"| {name} | ok | {settings.steps} | {settings.steps} |" in finished[2]


def test_numerics_compare_every_method_between_two_devices(finished):
    """In the CPU mode both sides are the CPU: the same step, so the terms are equal (a gradient summed by several
    threads may differ in its last bits)."""
    numerics = finished[1]["stages"]["numerics"]["result"]
    assert sorted(numerics["methods"]) == sorted(gpu_stages.FIT_RUNS)
    for name, row in numerics["methods"].items():
        assert row["status"] == "ok", (name, row.get("error"))
        assert row["term_gap"] == 0.0 and row["gradient_gap"] < 1e-6 and row["parameters_with_grad"] > 0
        assert set(row["cpu_terms"]) == set(row["device_terms"]) and row["device_reads_per_step"] is None


def test_the_throughput_table_is_perf_gpus(finished):
    throughput = finished[1]["stages"]["throughput"]["result"]
    rows = throughput["training"]
    expected = gpu_stages.CPU_CHECK.throughput[gpu_stages.CPU_CHECK.throughput.index("--methods") + 1].split(",")
    assert list(rows) == expected and all(row["status"] == "ok" for row in rows.values())
    assert all(row["mfu_of_matmul"] is not None for row in rows.values())
    assert "| clip_ft+32-true | 4 | 32-true | ok |" in finished[2]


def wait_for(condition, what: str) -> None:
    """Poll until `condition()` holds (a hang guard only: the condition does not depend on speed)."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > HANG_GUARD_S:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(1.0)


def stage_status(path: Path, name: str):
    try:
        return json.loads(path.read_text())["stages"].get(name, {}).get("status")
    except (OSError, ValueError):
        return None


def processes_using(marker: str) -> list:
    """Ids of the processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_check_killed_mid_way_keeps_the_stages_it_finished(bundle, tmp_path, sig):
    """Killed while fitting: the environment stage's results stay, in the JSON and the Markdown; the stage that
    was running ends with the check (SIGKILL: its processes end too, through the death signal)."""
    results = tmp_path / "out" / "check.json"
    process = subprocess.Popen(check_command(bundle, tmp_path, "--stages", "environment,fit"), cwd=REPO,
                               env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: stage_status(results, "fit") == "running", "the fit stage to start")
        process.send_signal(sig)
        process.wait(timeout=HANG_GUARD_S)
        wait_for(lambda: not processes_using(str(tmp_path / "work")), "the fit stage's processes to end")
    finally:
        for pid in processes_using(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
    kept = json.loads(results.read_text())
    assert kept["stages"]["environment"]["status"] == "ok" and kept["stages"]["environment"]["result"]["torch"]
    assert kept["stages"]["fit"]["status"] == ("running" if sig == signal.SIGKILL else "stopped")
    assert "| environment | ok |" in (tmp_path / "out" / "check.md").read_text()


def test_a_stage_that_outruns_its_timeout_is_killed_with_its_children(bundle, tmp_path, monkeypatch):
    """A stage that never ends (it waits for a signal) is cut off at its timeout with every process it started,
    recorded as a timeout, and the next stage still runs."""
    marker = f"hang-{tmp_path.name}"
    waits_forever = ("import signal, subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                     f"'import signal; signal.pause()', '{marker}']); signal.pause()")

    def command(name, settings, bundle_dir, work, document):
        if name == "environment":
            return [sys.executable, "-c", waits_forever, marker]
        return [sys.executable, "-c", f"import json; open({str(document)!r}, 'w').write(json.dumps({{'ran': 1}}))"]

    monkeypatch.setattr(gpu_check, "stage_command", command)
    monkeypatch.setitem(gpu_check.SETTINGS, "cpu", gpu_stages.CheckSettings(
        **{**gpu_stages.CPU_CHECK.__dict__, "stage_timeout_s": {**gpu_stages.CPU_CHECK.stage_timeout_s,
                                                                "environment": 0.5}}))
    monkeypatch.setattr(gpu_check, "POLL_S", 0.1)
    code = gpu_check.main(["--device", "cpu", "--bundle", str(bundle), "--work", str(tmp_path / "work"), "--out",
                           str(tmp_path / "check"), "--stages", "environment,numerics"])
    result = json.loads((tmp_path / "check.json").read_text())
    assert code == 1
    assert result["stages"]["environment"]["status"] == "timeout" and result["stages"]["environment"]["rc"] is None
    assert result["stages"]["numerics"] == {**result["stages"]["numerics"], "status": "ok", "result": {"ran": 1}}
    assert "killed at its 0 s timeout" in (tmp_path / "check.log").read_text()
    assert not processes_using(marker)


def test_rerunning_some_stages_keeps_the_others(bundle, tmp_path, monkeypatch):
    def command(name, settings, bundle_dir, work, document):
        return [sys.executable, "-c", f"import json; open({str(document)!r}, 'w').write(json.dumps({{'stage': "
                                      f"{name!r}}}))"]

    monkeypatch.setattr(gpu_check, "stage_command", command)
    common = ["--device", "cpu", "--bundle", str(bundle), "--work", str(tmp_path / "work"), "--out",
              str(tmp_path / "check")]
    assert gpu_check.main(common) == 0
    first = json.loads((tmp_path / "check.json").read_text())["stages"]
    assert gpu_check.main([*common, "--stages", "numerics"]) == 0
    second = json.loads((tmp_path / "check.json").read_text())["stages"]
    assert second["environment"] == first["environment"] and second["numerics"]["result"] == {"stage": "numerics"}
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--stages", "fitt"])


def test_the_bundle_reports_its_size_and_refuses_one_over_the_limit(bundle, tmp_path, capsys):
    written = json.loads((bundle / gpu_bundle.MANIFEST).read_text())
    assert written["parts_bytes"][gpu_bundle.WORLD] > 0 and written["parts_bytes"][gpu_bundle.CACHE] > 0
    assert written["total_bytes"] == sum(written["parts_bytes"].values()) + written["tracked_files_bytes"]
    assert written["within_limit"] and written["max_mib"] is None and len(written["commit"]) == 40
    assert json.loads((bundle / gpu_bundle.RECORDS).read_text())["captions"] == 8  # perf.gpu's, by its command
    copy = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(bundle), str(copy)], check=True)
    with pytest.raises(SystemExit, match="over --max-mib 0.001"):
        gpu_bundle.main(["--out", str(copy), "--max-mib", "0.001", "--record-count", "8"])
    assert "MiB with the tracked files (limit 0.001 MiB)" in capsys.readouterr().out
    assert not json.loads((copy / gpu_bundle.MANIFEST).read_text())["within_limit"]
