"""What a newcomer meets in the first hour: each mistake ends the real command in one line that names it (no
traceback) before any work starts, the advice a refusal gives is a command that works, and the demo's clean-up
leaves the study's caches alone."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import REPO_ROOT
from datamodules.cache import keyed_caches, open_cache
from evaluation import leakage
from fitting import StopAfter, TINY, tiny_config
from lightning_modules.fit import check_inputs, run
from modeling.encoders import build_model
from modeling.export import export_model
from testkit.standin.two_by_two import write_bivlc

PRETRAIN = REPO_ROOT / "configs" / "demo" / "pretrain.yaml"


def command(module: str, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m module args` in `cwd`, offline. The bound only guards against a hang: each refusal here comes in
    seconds, and the longest run (a two-step resume) in well under a minute."""
    cwd.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT), **env}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=600)


def fit_args(shapes_root: Path, *overrides: str) -> list:
    """fit's command line for the tiny model on the tiny shapes world (tests/fitting.py `tiny_config`), run
    directories under `runs/` of the working directory."""
    return ["--config", str(PRETRAIN), f"model.name={TINY}", f"data.root={shapes_root}", "runs_root=runs",
            "data.batch_size=8", "data.num_workers=0", "data.masks=false", "trainer.max_steps=2",
            "trainer.enable_progress_bar=false", *overrides]


def one_line_refusal(result: subprocess.CompletedProcess, after_logs: bool = False) -> str:
    """The refusal a failed command printed: one line on stderr, no traceback (`after_logs`: the last line, after
    the logs of the work it had begun)."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert after_logs or len(lines) == 1, result.stderr[-3000:]
    return lines[-1]


def refused_before_building(result: subprocess.CompletedProcess, cwd: Path) -> str:
    """fit's one-line refusal, found before the trainer was built (it prints the global batch) and before the run
    directory was made."""
    message = one_line_refusal(result)
    assert "global batch" not in result.stdout
    assert not (cwd / "runs").exists()
    return message


# ----- fit: one line, before anything is built ------------------------------------------------------------------
def test_a_gpu_accelerator_where_no_gpu_is_visible_is_one_line(shapes_root, tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so the refusal is the same on a machine that has one
    result = command("lightning_modules.fit", *fit_args(shapes_root, "trainer.accelerator=gpu"), cwd=tmp_path,
                     CUDA_VISIBLE_DEVICES="")
    message = refused_before_building(result, tmp_path)
    assert message.startswith("training cannot start: trainer.accelerator=gpu: ")
    assert "trainer.accelerator=cpu" in message


def test_a_pretrained_export_that_does_not_exist_is_one_line(shapes_root, tmp_path):
    (tmp_path / "runs" / "unfinished").mkdir(parents=True)  # a run that never wrote its export
    for missing in ("runs/nowhere/export", "runs/unfinished/export"):
        result = command("lightning_modules.fit", *fit_args(shapes_root, f"model.pretrained={missing}"),
                         cwd=tmp_path)
        message = one_line_refusal(result)
        assert message.startswith(f"training cannot start: model.pretrained={missing}: no such checkpoint file or "
                                  f"export folder")
        assert "global batch" not in result.stdout and not (tmp_path / "runs" / "demo_pretrain").exists()


def test_a_missing_resume_from_checkpoint_is_one_line(shapes_root, tmp_path):
    missing = tmp_path / "elsewhere" / "last.ckpt"
    result = command("lightning_modules.fit", *fit_args(shapes_root, f"resume_from={missing}"), cwd=tmp_path)
    message = refused_before_building(result, tmp_path)
    assert message.startswith(f"training cannot start: resume_from={missing}: no such checkpoint file")


def test_lora_on_a_randomly_initialised_backbone_is_refused_unless_asked_for(shapes_root, tmp_path):
    result = command("lightning_modules.fit", *fit_args(shapes_root, "model.lora.rank=4"), cwd=tmp_path)
    message = refused_before_building(result, tmp_path)
    assert message.startswith("training cannot start: model.lora.rank=4 with model.pretrained=None: adapters on a "
                              "randomly initialised backbone")
    assert "model.lora.allow_random_backbone=true" in message
    check_inputs(tiny_config(shapes_root, tmp_path, "model.lora.rank=4", "model.lora.allow_random_backbone=true"))
    built = build_model(TINY, None, "configs/models")
    export_model(built.model, built.name, tmp_path / "backbone" / "export")  # weights to adapt: accepted
    check_inputs(tiny_config(shapes_root, tmp_path, "model.lora.rank=4",
                             f"model.pretrained={tmp_path / 'backbone' / 'export'}"))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_cache_shard_met_by_fit_names_it_and_the_command_that_rebuilds_it(shapes_root, mask_cache,
                                                                                     tmp_path, damage):
    cache = tmp_path / "cache"
    shutil.copytree(mask_cache, cache)
    train = next(directory for directory, settings in keyed_caches(cache) if "train" in settings["karpathy_splits"])
    shard = sorted(train.glob("shard-*.jsonl.gz"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    args = fit_args(shapes_root, "data.masks=true", f"preprocess.cache_root={cache}")
    # met when the datamodule opens the cache, once the model is built: before the first step
    message = one_line_refusal(command("lightning_modules.fit", *args, cwd=tmp_path / "work"), after_logs=True)
    assert str(shard) in message and "checksum mismatch" in message
    assert not (tmp_path / "work" / "runs" / "demo_pretrain").exists()  # removed: no step had trained
    # the command named is this run's own preprocessing, and it rebuilds the shard
    rebuild = re.search(r": (python -m datamodules\.preprocess .*) rebuilds it$", message)
    assert rebuild is not None, message
    assert shlex.split(rebuild.group(1))[3:] == args
    result = command(*shlex.split(rebuild.group(1))[2:], cwd=tmp_path / "work")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(list(open_cache(train).read_all())) == 32  # 16 images x 2 captions


# ----- explain ------------------------------------------------------------------------------------------------------
def test_explain_given_a_folder_for_its_image_is_one_line(shapes_root, tmp_path):
    folder = shapes_root / "images" / "val"
    result = command("evaluation.explain", "--model", TINY, "--config-dir", str(REPO_ROOT / "configs" / "models"),
                     "--image", str(folder), "--text", "a red square", "--out", str(tmp_path / "x.png"),
                     cwd=tmp_path)
    message = one_line_refusal(result)
    assert message.startswith(f"--image {folder} is a folder: give one image file")
    assert not (tmp_path / "x.png").exists()


# ----- advice that works ------------------------------------------------------------------------------------------
def test_the_command_evaluate_suggests_for_a_run_without_an_export_resumes_and_finishes_it(shapes_root, tmp_path,
                                                                                        monkeypatch):
    """A run stopped at step 2 of 4 without its export: evaluate's advice, run as printed, resumes it from its
    own config.yaml and exports step 4."""
    monkeypatch.chdir(tmp_path)
    run(tiny_config(shapes_root, Path("runs"), "trainer.max_steps=4", "trainer.limit_val_batches=0"),
        extra_callbacks=[StopAfter(2)])
    run_dir = Path("runs") / "demo_pretrain"
    shutil.rmtree(run_dir / "export")
    result = command("evaluation.evaluate", "--run", str(run_dir), "--benchmarks", "sugarcrepe", cwd=tmp_path)
    message = one_line_refusal(result)
    assert message.startswith(f"run {run_dir} has no export yet")
    suggested = re.search(r"`(python -m lightning_modules\.fit [^`]*)` resumes and finishes it", message)
    assert suggested is not None, message
    argv = shlex.split(suggested.group(1))
    assert argv[:5] == ["python", "-m", "lightning_modules.fit", "--config", str(run_dir / "config.yaml")]
    resumed = command(*argv[2:], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout
    assert json.loads((run_dir / "export" / "model.json").read_text())["global_step"] == 4


def test_the_suggested_resume_pins_what_a_fresh_start_would_change(tmp_path):
    """A run started with resume=false and a named checkpoint: its config.yaml alone would move the run aside or
    resume from that old checkpoint, so the command says resume=true resume_from=null."""
    from core.config import resume_command

    run_dir = tmp_path / "runs" / "x"
    run_dir.mkdir(parents=True)
    config = run_dir / "config.yaml"
    config.write_text(f"experiment: x\nruns_root: {tmp_path / 'runs'}\nresume: false\nresume_from: /old/last.ckpt\n")
    assert resume_command(run_dir) == f"python -m lightning_modules.fit --config {config} resume=true resume_from=null"
    config.write_text(f"experiment: x\nruns_root: {tmp_path / 'elsewhere'}\nresume: true\n")
    assert resume_command(run_dir) is None  # it names another run directory: no command to promise


def coco_captions(path: Path, image_ids) -> Path:
    images = [{"id": i, "file_name": f"{i:012d}.jpg"} for i in image_ids]
    annotations = [{"id": n, "image_id": i, "caption": "a photo"} for n, i in enumerate(image_ids)]
    path.write_text(json.dumps({"images": images, "annotations": annotations}))
    return path


def test_the_leakage_guard_takes_config_overrides_as_fit_does(tmp_path, capsys):
    write_bivlc(tmp_path / "bench" / "bivlc", n_items=12)  # COCO images 0..11
    coco_captions(tmp_path / "train.json", [2, 5, 11, 500])
    excluded = tmp_path / "excluded.json"
    excluded.write_text("[2, 11]")
    common = ["--benchmarks", "bivlc", "--data-root", str(tmp_path / "bench")]
    config = ["--config", str(PRETRAIN), f"data.root={tmp_path}", "data.train_annotations=train.json"]
    assert leakage.main([*config, *common])["bivlc"]["overlap"] == 3
    report = leakage.main([*config, f"data.exclude_image_ids={excluded}", *common])
    assert report["bivlc"]["overlap"] == 1 and report["bivlc"]["examples"] == [5]
    with pytest.raises(SystemExit):
        leakage.main(["--train", str(tmp_path / "train.json"), f"data.exclude_image_ids={excluded}", *common])
    assert "config overrides need --config" in capsys.readouterr().err


# ----- make clean-demo ------------------------------------------------------------------------------------------
def settings_of(annotations: Path) -> str:
    import hashlib

    return json.dumps({"annotations_sha256": hashlib.sha256(annotations.read_bytes()).hexdigest()}, indent=1)


def test_clean_demo_removes_the_demos_runs_and_caches_and_nothing_of_the_study(tmp_path):
    """The real recipe on a copy of the layout the demo, the shapes-world recipes and `make study` leave
    (configs/demo/*.yaml: caches under cache/ and cache/features/; the study's and the demo's runs; configs/study:
    cache/study/ and cache/study_features/, which the demo reads too)."""
    annotations = tmp_path / "data" / "shapes" / "annotations"
    annotations.mkdir(parents=True)
    demo_settings = [settings_of(coco_captions(annotations / f"captions_{split}.json", ids))
                     for split, ids in (("train", [1, 2]), ("val", [3]))]
    other = settings_of(coco_captions(tmp_path / "coco.json", [4]))
    layout = {"cache/aaaa/settings.json": demo_settings[0], "cache/bbbb/settings.json": demo_settings[1],
              "cache/features/cccc/settings.json": demo_settings[0],
              # a COCO cache beside the demo's, and the study's: kept, even with the demo's hash (never looked at)
              "cache/dddd/settings.json": other, "cache/features/eeee/settings.json": other,
              "cache/study/ffff/settings.json": demo_settings[0], "cache/study_features/gggg/settings.json": other,
              "runs/demo/method-clip_ft/config.yaml": "", "runs/demo_pretrain/config.yaml": "",
              "runs/demo_results.json": "", "runs/study/sweep/x": "", "runs/study/backbones/seed-0/export/x": ""}
    for path, text in layout.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    result = subprocess.run(["make", "-f", str(REPO_ROOT / "Makefile"), "-C", str(tmp_path), "clean-demo"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    removed = {"cache/aaaa", "cache/bbbb", "cache/features/cccc", "runs/demo", "runs/demo_pretrain",
               "runs/demo_results.json"}
    for path in layout:
        gone = any(path == name or path.startswith(name + "/") for name in removed)
        assert (tmp_path / path).exists() != gone, path
