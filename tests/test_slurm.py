"""Sweeps on a real single-node SLURM cluster (munged + slurmctld + slurmd started here), with a requeue.

Needs Debian's slurm-wlm and munge. Locally the test is skipped when they are missing (`-m "not slurm"`
deselects it); under CI (CI=true, as .ci/run sets) it installs them with apt-get and runs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from datamodules.shapes import generate
from slurm.runs import RUN_LOG, export_complete
from slurm import sweep as sweep_module
from testkit.localcluster import LocalSlurm
from slurm.sweep import expand, load_sweep, local_threads, main as sweep_main, run_local, SweepError, write_sweep_file

REPO = Path(__file__).resolve().parents[1]
STEPS = 150


def ensure_slurm_installed() -> None:
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    if not os.environ.get("CI") or os.geteuid() != 0:
        pytest.skip("slurm-wlm and munge are not installed (CI installs them)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"], check=True, env=env,
                   capture_output=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ensure_slurm_installed()
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def write_sweep(tmp_path: Path, shapes: Path) -> Path:
    spec = {"name": "requeue_test", "runs_root": str(tmp_path / "runs"),
            "configs": [str(REPO / "configs" / "demo" / "pretrain.yaml")],
            "grid": {"seed": [0, 1]},
            "overrides": ["model.name=ViT-Tiny-16-64", f"model.config_dir={REPO / 'configs' / 'models'}",
                          f"data.root={shapes}", "data.masks=false", "data.batch_size=8", "data.num_workers=0",
                          f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=5", "trainer.limit_val_batches=0",
                          "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=5"],
            "slurm": {"cpus_per_task": 1, "time": "00:20:00"}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_grid_expansion_names_runs_from_their_choices(tmp_path):
    runs = expand({"method": {"ft": ["method.name=clip_ft"], "cae": ["method.name=clip_cae", "x.yaml"]},
                   "seed": [0, 1]}, ["base.yaml"], ["trainer.max_steps=5"])
    assert [run.name for run in runs] == ["method-ft_seed-0", "method-ft_seed-1", "method-cae_seed-0",
                                          "method-cae_seed-1"]
    assert runs[2].configs == ["base.yaml", "x.yaml"]
    assert runs[2].overrides == ["trainer.max_steps=5", "method.name=clip_cae", "seed=0"]
    assert runs[0].fit_args("r")[-2:] == ["experiment=method-ft_seed-0", "runs_root=r"]


def test_an_exclusion_may_list_several_labels_of_an_axis(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("name: x\ngrid:\n  method: {ft: [m=ft], cae: [m=cae], macco: [m=macco]}\n"
                    "  check: {w: [w=1], mask: [k=1]}\n  seed: [0]\n"
                    "exclude:\n  - {method: [ft, cae], check: mask}\n  - {method: macco, check: [w]}\n")
    assert [run.name for run in load_sweep(path).runs] == ["method-ft_check-w_seed-0", "method-cae_check-w_seed-0",
                                                           "method-macco_check-mask_seed-0"]
    path.write_text(path.read_text().replace("[ft, cae]", "[ft, cea]"))
    with pytest.raises(SweepError, match="exclude names method: cea"):
        load_sweep(path)


def test_excluded_combinations_are_left_out_and_typos_named(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("name: x\ngrid:\n  negatives: {without: [a=0], with: [a=1]}\n  method: {ft: [m=ft], tfl: [m=tfl]}\n"
                    "  seed: [0, 1]\nexclude:\n  - {negatives: without, method: tfl}\n")
    names = [run.name for run in load_sweep(path).runs]
    assert len(names) == 6 and not any("without_method-tfl" in name for name in names)
    assert "negatives-with_method-tfl_seed-1" in names and "negatives-without_method-ft_seed-0" in names
    path.write_text(path.read_text().replace("method: tfl}", "method: tflocal}"))
    with pytest.raises(SweepError, match="exclude names method: tflocal"):
        load_sweep(path)


def test_dry_run_prints_the_array_script_and_every_run(tmp_path, capsys):
    path = write_sweep(tmp_path, tmp_path / "shapes")
    sweep_main([str(path), "--dry-run"])
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-1" in out and "#SBATCH --signal=SIGUSR1@90" in out and "#SBATCH --requeue" in out
    assert "# task 0:" in out and "# task 1:" in out and "seed=1" in out
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    assert len(load_sweep(path).runs) == 2


def data_root(tmp_path: Path) -> Path:
    """The files fit checks for under the default data settings (nothing is read: the runs are stand-ins)."""
    root = tmp_path / "data"
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / "annotations" / "dataset_coco.json").write_text("{}")
    return root


def grid_sweep(tmp_path: Path) -> Path:
    """A 2 x 2 x 2 grid (negatives x method x seed) with one combination excluded: 6 runs."""
    path = tmp_path / "grid.yaml"
    path.write_text(f"name: grid\nruns_root: {tmp_path / 'runs'}\ngrid:\n"
                    "  negatives: {with: [method.hard_negatives.captions=1],\n"
                    "              without: [method.hard_negatives.captions=0]}\n"
                    "  method: {ft: [method.name=clip_ft], tfl: [method.name=tflocal]}\n"
                    "  seed: [0, 1]\nexclude:\n  - {negatives: without, method: tfl}\n"
                    f"overrides: [data.root={data_root(tmp_path)}]\n")
    return path


def test_only_runs_part_of_the_grid_and_keeps_the_full_task_indices(tmp_path, capsys, monkeypatch):
    path = grid_sweep(tmp_path)
    ran = tmp_path / "ran.txt"
    monkeypatch.setattr(sweep_module, "task_command", python_command(
        f"open({str(ran)!r}, 'a').write(f'{{index}}\\n')"))
    sweep_main([str(path), "--local", "only.method=ft", "only.seed=1"])
    runs = load_sweep(path).runs
    names = [runs[int(index)].name for index in ran.read_text().split()]
    assert sorted(names) == ["negatives-with_method-ft_seed-1", "negatives-without_method-ft_seed-1"]
    # sweep.json keeps the whole grid: the indices run are the full sweep's, so the report sees every run.
    document = json.loads((tmp_path / "runs" / "grid" / "sweep.json").read_text())
    assert [run["name"] for run in document["runs"]] == [run.name for run in runs] and len(runs) == 6
    assert "[2/2]" in capsys.readouterr().out
    # Two labels of one axis are alternatives; the dry run's array lists the selected tasks only.
    sweep_main([str(path), "only.negatives=with,without", "--dry-run", "only.seed=0"])
    out = capsys.readouterr().out
    assert "#SBATCH --array=0,2,4" in out and out.count("# task ") == 3
    sweep_main([str(path), "--dry-run"])
    assert "#SBATCH --array=0-5" in capsys.readouterr().out


def test_only_typos_and_empty_selections_are_refused(tmp_path):
    path = grid_sweep(tmp_path)
    with pytest.raises(SystemExit, match=r"only.method=clip_ft: the grid has no such axis and label.*'ft', 'tfl'"):
        sweep_main([str(path), "--dry-run", "only.method=ft,clip_ft"])
    with pytest.raises(SystemExit, match="only.methods=ft: the grid has no such"):
        sweep_main([str(path), "--dry-run", "only.methods=ft"])
    with pytest.raises(SystemExit, match="selects none of the 6 runs"):
        sweep_main([str(path), "--dry-run", "only.negatives=without", "only.method=tfl"])


def test_unknown_sweep_keys_are_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ngrids: {seed: [0]}\n")
    with pytest.raises(SystemExit, match="unknown keys.*grids"):
        sweep_main([str(path), "--dry-run"])


def checked_sweep(tmp_path: Path, grid: dict, overrides: list, configs: list = ()) -> Path:
    """A sweep over the tiny demo config whose runs the checks below look at (none is trained)."""
    spec = {"name": "checked", "runs_root": str(tmp_path / "runs"),
            "configs": [str(REPO / "configs" / "demo" / "pretrain.yaml"), *configs], "grid": grid,
            "overrides": [f"data.root={tmp_path / 'shapes'}", *overrides]}
    path = tmp_path / "checked.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def refusal(argv: list) -> str:
    with pytest.raises(SystemExit) as refused:
        sweep_main(argv)
    assert isinstance(refused.value.code, str)  # printed, exit status 1
    return refused.value.code


def test_every_run_is_checked_as_fit_checks_it_before_a_dry_run(tmp_path, capsys):
    grid = {"method": {"ft": ["method.name=clip_ft"], "cae": ["method.name=clip_cae"],
                       "macco": ["method.name=macco", "data.masks=false"]}, "seed": [0, 1]}
    message = refusal([str(checked_sweep(tmp_path, grid, ["trainer.max_stepz=5"])), "--dry-run"])
    # an override typo of every run: named once, with the closest key
    assert ("every run (tasks 0-5): unknown config key 'trainer.max_stepz' in override 'trainer.max_stepz=5'; "
            "did you mean 'trainer.max_steps'?") in message
    grid["method"]["ft"] = ["method.name=clip_fft"]
    grid["seed"] = [0]
    message = refusal([str(checked_sweep(tmp_path, grid, [], [str(REPO / "configs" / "demo" / "cea.yaml")])),
                       "--dry-run"])
    assert f"config file not found: {REPO / 'configs' / 'demo' / 'cea.yaml'}; did you mean " \
           f"{REPO / 'configs' / 'demo' / 'cae.yaml'}?" in message
    grid["method"].pop("cae")
    message = refusal([str(checked_sweep(tmp_path, grid, [])), "--dry-run"])
    assert ("task 0 (method-ft_seed-0): method.name='clip_fft' is not a registered method; did you mean "
            "'clip_ft'? (methods: clip_cae, clip_ft, macco, smartclip, tfglobal, tflocal)") in message
    # what fit refuses of a method: MACCO reads the preprocessing cache's masks
    assert "task 1 (method-macco_seed-0): data.masks=false: method macco reads comp_mask and patch_mask" in message
    assert "python -m datamodules.preprocess" in message
    assert capsys.readouterr().out == "" and not (tmp_path / "runs").exists()  # nothing printed or written


def test_a_valid_sweep_passes_and_missing_data_is_a_warning_unless_the_runs_run_here(tmp_path, capsys,
                                                                                    monkeypatch):
    grid = {"method": {"ft": ["method.name=clip_ft"], "macco": ["method.name=macco"]}, "seed": [0, 1]}
    path = checked_sweep(tmp_path, grid, ["trainer.max_steps=5"])
    assert sweep_main([str(path), "--dry-run"]) is None
    captured = capsys.readouterr()
    assert "# task 3:" in captured.out
    # a login node need not see the data the compute nodes read: reported, and fit checks it again there
    assert f"warning: every run (tasks 0-3): data.root={tmp_path / 'shapes'}: no such directory" in captured.err
    ran = []
    monkeypatch.setattr(sweep_module, "task_command", lambda sweep_file, index: ran.append(index) or ["true"])
    message = refusal([str(path), "--local"])
    assert f"every run (tasks 0-3): data.root={tmp_path / 'shapes'}: no such directory" in message
    assert ran == [] and not (tmp_path / "runs").exists()


def test_a_submission_with_a_bad_run_submits_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_module, "submit", lambda script: pytest.fail("submitted"))
    path = checked_sweep(tmp_path, {"seed": [0, 1]}, ["data.on_bad_image=skp"])
    message = refusal([str(path)])
    assert "data.on_bad_image='skp' is not one of error, skip; did you mean 'skip'?" in message
    assert not (tmp_path / "runs").exists()


def local_sweep(tmp_path: Path, seeds: int = 3, study: dict | None = None, **extra) -> Path:
    """A sweep of `seeds` runs whose commands the tests replace with trivial ones (nothing is trained); `extra`:
    more keys of the sweep file (`overrides` are added to the data root's)."""
    spec = {"name": "local", "runs_root": str(tmp_path / "runs"), "grid": {"seed": list(range(seeds))},
            "overrides": [f"data.root={data_root(tmp_path)}", *extra.pop("overrides", [])]}
    spec.update({"study": study} if study is not None else {})
    spec.update(extra)
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def python_command(code: str, export: bool = True):
    """A run command that executes `code` with `index` (the run's task index) defined, then, like a finished
    fit, writes the run's export (unless `export` is false; `code` may exit first)."""
    finish = ("import json, pathlib\n"
              "document = json.loads(pathlib.Path(sweep_file).read_text())\n"
              "out = pathlib.Path(document['runs_root']) / document['runs'][index]['name'] / 'export'\n"
              "out.mkdir(parents=True, exist_ok=True)\n(out / 'model.json').write_text('{}')\n") if export else ""
    return lambda sweep_file, index: [sys.executable, "-c",
                                      f"index = {index}\nsweep_file = {str(sweep_file)!r}\n{code}\n{finish}"]


def test_local_jobs_run_at_once_with_their_share_of_threads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweep_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    path = local_sweep(tmp_path, seeds=2)
    sweep = load_sweep(path)
    # Run 0 finishes only once run 1 has started: one run at a time would time out here.
    flag = tmp_path / "run-1-started"
    code = (f"import os, pathlib, sys, time\nprint('threads', os.environ['OMP_NUM_THREADS'], "
            f"os.environ['MKL_NUM_THREADS'])\nflag = pathlib.Path({str(flag)!r})\n"
            "if index == 1: flag.touch()\n"
            "deadline = time.time() + 60\n"
            "while index == 0 and not flag.exists() and time.time() < deadline: time.sleep(0.05)\n"
            "if not flag.exists(): sys.exit(3)\n")
    failed = run_local(sweep, write_sweep_file(sweep), jobs=2, command=python_command(code))
    assert failed == []
    out = capsys.readouterr().out
    assert "2 at a time, 2 threads each" in out
    finished = sorted(line.split(" done in")[0] for line in out.splitlines() if " done in " in line)
    assert finished in (["[1/2] seed-0", "[2/2] seed-1"], ["[1/2] seed-1", "[2/2] seed-0"])  # as they finish
    for name in ("seed-0", "seed-1"):
        assert "threads 2 2" in (sweep.directory / name / RUN_LOG).read_text()


def test_local_threads_share_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(sweep_module.os, "sched_getaffinity", lambda pid: set(range(6)))
    assert [local_threads(jobs) for jobs in (1, 2, 4, 6, 8)] == [6, 3, 1, 1, 1]


def test_a_failed_run_is_reported_and_the_others_still_run(tmp_path, capsys, monkeypatch):
    path = local_sweep(tmp_path, seeds=3)
    monkeypatch.setattr(sweep_module, "task_command",
                        python_command("import sys\nprint('output of', index)\nif index == 1: sys.exit(7)"))
    with pytest.raises(SystemExit, match=r"1 of 3 runs failed .*: seed-1$"):
        sweep_main([str(path), "--local", "--jobs", "1"])
    out = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "local"
    assert f"[2/3] seed-1 failed (rc 7, log {run_dir / 'seed-1' / RUN_LOG})" in out
    assert "[1/3] seed-0 done in" in out and "[3/3] seed-2 done in" in out
    assert "output of 1" in (run_dir / "seed-1" / RUN_LOG).read_text()


def test_a_run_that_ends_without_an_export_is_not_done(tmp_path, capsys):
    """Exit status 0 alone is no proof that a run finished: only its export is."""
    sweep = load_sweep(local_sweep(tmp_path, seeds=2))
    failed = run_local(sweep, write_sweep_file(sweep), command=python_command("pass", export=False))
    assert sorted(failed) == ["seed-0", "seed-1"]
    assert "seed-0 ended without an export of its config (rc 0" in capsys.readouterr().out


def test_runs_with_an_export_are_skipped_so_a_rerun_resumes(tmp_path, capsys):
    sweep = load_sweep(local_sweep(tmp_path, seeds=3))
    for name in ("seed-0", "seed-2"):
        (sweep.directory / name / "export").mkdir(parents=True)
        (sweep.directory / name / "export" / "model.json").write_text("{}")
    ran = tmp_path / "ran"
    failed = run_local(sweep, write_sweep_file(sweep), command=python_command(
        f"open({str(ran)!r}, 'a').write(str(index))"))
    assert failed == [] and ran.read_text() == "1"
    out = capsys.readouterr().out
    assert "[1/3] seed-0 skipped: finished (its export records this config)" in out and "[2/3] seed-2 skipped" in out
    assert "[3/3] seed-1 done in" in out


def test_an_aligner_export_is_complete_only_with_its_aligner(tmp_path):
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    assert not export_complete(run)
    (run / "export" / "model.json").write_text("{}")
    (run / "config.yaml").write_text("method: {name: tflocal}\n")
    assert not export_complete(run)  # killed between the CLIP export and the aligner's
    (run / "export" / "aligner.json").write_text("{}")
    assert export_complete(run)
    (run / "config.yaml").write_text("method: {name: clip_ft}\n")
    (run / "export" / "aligner.json").unlink()
    assert export_complete(run)


def test_the_study_block_is_copied_into_sweep_json(tmp_path, monkeypatch):
    study = {"data": "data/world", "baseline": "clip_ft", "splits": ["test", "test_unseen"]}
    path = local_sweep(tmp_path, seeds=1, study=study)
    monkeypatch.setattr(sweep_module, "task_command", python_command("pass"))
    sweep_main([str(path), "--local"])
    document = json.loads((tmp_path / "runs" / "local" / "sweep.json").read_text())
    assert document["study"] == study and document["runs"][0]["choices"] == {"seed": "seed-0"}
    path.write_text(yaml.safe_dump({"name": "x", "study": ["not", "a", "mapping"]}))
    with pytest.raises(SystemExit, match="study must be a mapping"):
        sweep_main([str(path), "--dry-run"])
    with pytest.raises(SystemExit, match="needs --local"):
        sweep_main([str(local_sweep(tmp_path)), "--jobs", "2"])


# ----- a results bundle: runs it holds are skipped, a record of another run stops the sweep ----------------------
def bundled_sweep(tmp_path: Path) -> Path:
    """Three runs from a backbone export, with a bundle folder named in the sweep file."""
    backbone = tmp_path / "backbone" / "export"
    backbone.mkdir(parents=True)
    (backbone / "model.json").write_text('{"model": "ViT-Tiny-16-64", "weights": "open_clip.pt"}')
    (backbone / "open_clip.pt").write_bytes(b"backbone weights")
    return local_sweep(tmp_path, seeds=3, bundle=str(tmp_path / "results"),
                       overrides=[f"model.pretrained={backbone}", "model.name=ViT-Tiny-16-64"])


def write_record(sweep: sweep_module.Sweep, index: int, *overrides: str) -> dict:
    """The bundle's record of run `index` written by the study's own writer (`study.bundle.run_record`, from the
    config.yaml of a run folder; scores left out), from its config with `overrides` on top (another config than the
    run's, when given). The sweep reads it through the file contract of core/run_records.py, without the study: these
    tests check that reader against that writer."""
    from core.run_records import run_record_path
    from study.bundle import run_record
    from study.records import write_json_gz

    run = sweep.runs[index]
    config = sweep_module.run_config(sweep_module.Run(run.name, run.configs, run.overrides + list(overrides),
                                                      run.choices), str(sweep.directory))
    run_dir = Path(sweep.bundle).parent / "record_sources" / run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    record = run_record(run_dir, run.name, run.choices, scores={}, curves={}, errors=[])
    write_json_gz(run_record_path(Path(sweep.bundle), sweep.name, run.name), record)
    return record


def test_the_sweep_digests_a_run_as_the_config_yaml_that_fit_writes_for_it(tmp_path, monkeypatch):
    """The digest the sweep compares (from the sweep file) is the one the report records (from the run's
    config.yaml, as fit writes it: resolved, the per-device batches added), on one device or on four."""
    from omegaconf import OmegaConf

    from core.config import save_config
    from lightning_modules import fit, load_run_config
    from lightning_modules.resume import config_digest

    monkeypatch.chdir(REPO)
    sweep = load_sweep(REPO / "configs" / "sweeps" / "study.yaml")
    for run in (sweep.runs[0], sweep.runs[-1]):  # CLIP-FT with negatives; TFGlobal
        expected = config_digest(sweep_module.run_config(run, str(sweep.directory)))
        for devices in (1, 4):
            args = fit.parse_args(run.fit_args(str(sweep.directory)) + [f"trainer.devices={devices}"])
            cfg = fit.with_per_device_batches(load_run_config(args.config, args.overrides), devices)
            save_config(cfg, tmp_path / "config.yaml")
            written = OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml"), resolve=True)
            assert config_digest(written) == expected, (run.name, devices)
        other = fit.parse_args(run.fit_args(str(sweep.directory)) + ["trainer.max_steps=601"])
        assert config_digest(OmegaConf.to_container(load_run_config(other.config, other.overrides))) != expected


def test_runs_whose_results_the_bundle_holds_are_skipped(tmp_path, capsys, monkeypatch):
    path = bundled_sweep(tmp_path)
    sweep = load_sweep(path)
    write_record(sweep, 0)
    write_record(sweep, 2, "data.num_workers=7", "trainer.devices=1")  # keys that cannot change a result
    ran = tmp_path / "ran"
    monkeypatch.setattr(sweep_module, "task_command", python_command(f"open({str(ran)!r}, 'a').write(str(index))"))
    sweep_main([str(path), "--local"])
    assert ran.read_text() == "1"
    out = capsys.readouterr().out
    assert f"[1/3] seed-0 skipped: its results are in the bundle {tmp_path / 'results'}" in out
    assert "[2/3] seed-2 skipped" in out and "[3/3] seed-1 done in" in out
    assert json.loads((tmp_path / "runs" / "local" / "sweep.json").read_text())["bundle"] == str(tmp_path / "results")
    # A SLURM array leaves them out, and so does each array task that meets one.
    sweep_main([str(path), "--dry-run"])
    out = capsys.readouterr().out
    assert "#SBATCH --array=1" in out and "seed-0" in out and "(in the bundle: skipped)" in out
    monkeypatch.setattr("lightning_modules.fit.main", lambda argv: pytest.fail("a bundled task trained"))
    sweep_module.main(["--task", str(tmp_path / "runs" / "local" / "sweep.json"), "0"])
    assert "seed-0: its results are in the bundle" in capsys.readouterr().out


def test_a_record_of_another_config_or_backbone_stops_the_sweep_before_anything_runs(tmp_path, monkeypatch):
    path = bundled_sweep(tmp_path)
    sweep = load_sweep(path)
    write_record(sweep, 0)
    write_record(sweep, 1, "optim.lr=0.5")
    monkeypatch.setattr(sweep_module, "task_command", lambda sweep_file, index: pytest.fail("a run ran"))
    message = refusal([str(path), "--local"])
    assert "the bundle" in message and "task 1 (seed-1): its config differs from the bundle's record" in message
    assert "optim.lr: 0.5 (bundle) ->" in message and "seed-0" not in message
    write_record(sweep, 1)
    (tmp_path / "backbone" / "export" / "open_clip.pt").write_bytes(b"a backbone trained again, differently")
    message = refusal([str(path), "--dry-run"])
    assert "tasks 0 (seed-0), 1 (seed-1): its backbone" in message and "not the backbone the bundled runs" in message
    assert "carry no record of those" in message
    # Where both exports record how they were trained, the refusal names what differed.
    from core.run_records import run_record_path
    from study.records import write_json_gz

    numerics = {"device": "cpu AVX512", "threads": 1, "processes": 1, "precision": "32-true", "torch": "2.5.1"}
    for index in (0, 1):
        record = write_record(sweep, index)
        record["backbone"].update(sha256="0" * 64, numerics=numerics)
        write_json_gz(run_record_path(Path(sweep.bundle), sweep.name, sweep.runs[index].name), record)
    (tmp_path / "backbone" / "export" / "model.json").write_text(json.dumps(
        {"model": "ViT-Tiny-16-64", "weights": "open_clip.pt", "numerics": {**numerics, "threads": 2}}))
    message = refusal([str(path), "--dry-run"])
    assert "(trained differently: threads: 1 (bundle) -> 2 (now))" in message
    (tmp_path / "backbone" / "export" / "model.json").write_text(json.dumps(
        {"model": "ViT-Tiny-16-64", "weights": "open_clip.pt", "numerics": numerics}))
    assert "(trained with the same recorded numerics: its config, data or other libraries differ)" in refusal(
        [str(path), "--dry-run"])
    shutil.rmtree(tmp_path / "backbone")  # not trained yet: cannot be checked here
    message = refusal([str(path), "--local"])
    assert "is not here, so its record" in message and "train the backbones first" in message
    assert not (tmp_path / "runs").exists()


def squeue_ids(cluster: LocalSlurm, job: str) -> list:
    out = cluster.command("squeue", "-h", "-r", "-j", job, "-o", "%i %T").stdout.split("\n")
    return [line.split() for line in out if line.strip()]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slurm
def test_sweep_on_real_slurm_with_a_requeued_task_resuming(cluster, tmp_path):
    shapes = tmp_path / "shapes"
    generate(shapes, n_train=64, n_val=8, image_size=64, seed=0)
    path = write_sweep(tmp_path, shapes)
    submitted = subprocess.run([sys.executable, "-m", "slurm.sweep", str(path)], cwd=REPO, env=cluster.env,
                               capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.split("array job ")[1].split(":")[0]
    sweep_dir = tmp_path / "runs" / "requeue_test"
    first_run = sweep_dir / "seed-0"
    wait_for(lambda: (first_run / "checkpoints" / "last.ckpt").is_file(), 300, "the first checkpoint of task 0")
    requeued = cluster.command("scontrol", "requeue", f"{job}_0")
    assert requeued.returncode == 0, requeued.stderr
    wait_for(lambda: any(state == "PENDING" for i, state in squeue_ids(cluster, job) if i == f"{job}_0"), 60,
             "task 0 back in the queue")
    cluster.command("scontrol", "update", f"JobId={job}_0", "StartTime=now")  # skip SLURM's requeue delay
    wait_for(lambda: not squeue_ids(cluster, job), 480, "both tasks to finish")
    for name in ("seed-0", "seed-1"):
        model = json.loads((sweep_dir / name / "export" / "model.json").read_text())
        assert model["global_step"] == STEPS, name
        assert [p.name for p in (sweep_dir / name / "tb").iterdir()] == ["version_0"], name
    log = next(sweep_dir.glob("slurm-*_0.out")).read_text()
    assert "Resuming from" in log, log[-3000:]
    assert len(list((first_run / "tb" / "version_0").glob("events.out.tfevents.*"))) == 2  # the same curves grew


def test_one_override_moves_every_run_of_a_sweep_to_a_gpu(tmp_path, capsys):
    """`trainer.accelerator=gpu` on the command line joins every run's overrides (names and directories unchanged),
    and the array asks for a GPU per task, since the sweep file asks for none."""
    path = write_sweep(tmp_path, tmp_path / "shapes")
    cpu_names = [run.name for run in load_sweep(path).runs]
    sweep_main([str(path), "--dry-run", "trainer.accelerator=gpu"])
    out = capsys.readouterr().out
    assert "#SBATCH --gres=gpu:1" in out and "#SBATCH --ntasks-per-node=1" in out
    tasks = [line for line in out.splitlines() if line.startswith("# task")]
    assert len(tasks) == 2
    assert all(f"trainer.accelerator=gpu experiment=seed-{index}" in line for index, line in enumerate(tasks))
    gpu = load_sweep(path, ["trainer.accelerator=gpu"])
    assert [run.name for run in gpu.runs] == cpu_names
    assert all(run.overrides[-1] == "trainer.accelerator=gpu" for run in gpu.runs)
    assert gpu.slurm["gpus_per_node"] == 1 and load_sweep(path).slurm["gpus_per_node"] == 0


def test_a_mistyped_override_of_every_run_is_named_before_anything_runs(tmp_path):
    path = write_sweep(tmp_path, tmp_path / "shapes")
    with pytest.raises(SystemExit, match="did you mean 'trainer.accelerator'"):
        sweep_main([str(path), "--dry-run", "trainer.acelerator=gpu"])
    assert not (tmp_path / "runs").exists()
