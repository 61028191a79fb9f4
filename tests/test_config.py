"""Every shipped YAML validates; typos name the closest key; merge order is base <- files <- overrides."""
from __future__ import annotations

from pathlib import Path

import open_clip
import pytest

from core.config import REPO_ROOT, ConfigError, load_config
from modeling.encoders import register_model_configs
from lightning_modules import METHODS

SHIPPED = sorted(p for p in (REPO_ROOT / "configs").rglob("*.yaml") if "sweeps" not in p.parts)


def test_configs_are_found():
    names = {p.relative_to(REPO_ROOT / "configs").as_posix() for p in SHIPPED}
    assert {"base.yaml", "clip_ft.yaml", "demo/pretrain.yaml", "demo/clip_ft.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_shipped_yaml_validates(path):
    cfg = load_config([path])
    assert cfg.method.name in METHODS
    register_model_configs(cfg.model.config_dir)
    assert cfg.model.name in open_clip.list_models()


def test_typo_in_override_names_the_closest_key():
    with pytest.raises(ConfigError, match=r"'trainer\.max_stepz'.*did you mean 'trainer\.max_steps'"):
        load_config([], ["trainer.max_stepz=3"])


def test_typo_in_a_file_names_the_file_and_the_closest_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  batch_sise: 8\n")
    with pytest.raises(ConfigError, match=r"data\.batch_sise.*bad\.yaml.*data\.batch_size"):
        load_config([path])


def test_wrong_type_and_bad_choice_are_errors():
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config([], ["optim.lr=fast"])
    with pytest.raises(ConfigError, match="on_bad_image"):
        load_config([], ["data.on_bad_image=ignore"])
    with pytest.raises(ConfigError, match="data.on_bad_image='skp' is not one of error, skip; did you mean 'skip'"):
        load_config([], ["data.on_bad_image=skp"])


def test_merge_order(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("experiment: a\noptim:\n  lr: 0.1\n  warmup_steps: 7\n")
    second.write_text("optim:\n  lr: 0.2\n")
    cfg = load_config([first, second], ["experiment=c"])
    assert (cfg.experiment, cfg.optim.lr, cfg.optim.warmup_steps) == ("c", 0.2, 7)
    assert cfg.runs_root == "runs"  # from base.yaml


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="not found"):
        load_config([Path("configs/nope.yaml")])
    demo = REPO_ROOT / "configs" / "demo"
    with pytest.raises(ConfigError) as missing:
        load_config([demo / "cea.yaml"])
    assert str(missing.value) == f"config file not found: {demo / 'cea.yaml'}; did you mean {demo / 'cae.yaml'}?"
    with pytest.raises(ConfigError, match="key=value"):
        load_config([], ["trainer.max_steps"])


# Recipes whose paper trains on other data than COCO captions (the leakage guard in fit still applies).
NOT_COCO_CAPTIONS = {"smartclip_long.yaml": "share-captioner_coco_lcs_sam_1246k_1107.json"}  # ShareGPT4V
RECIPES = sorted(p for p in (REPO_ROOT / "configs").glob("*.yaml") if p.name != "base.yaml")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_coco_recipes_train_without_karpathy_test_images(path):
    """Karpathy train + restval (validation on Karpathy val), or NegCLIP's own TSVs; never COCO 2017's
    captions_train2017.json, which holds most Karpathy-test images."""
    data = load_config([path]).data
    if path.name in NOT_COCO_CAPTIONS:
        assert data.train_annotations == NOT_COCO_CAPTIONS[path.name]
        return
    if data.train_annotations.endswith(".tsv"):
        assert (data.train_annotations, data.val_annotations) == ("negclip/train_neg_clip.tsv",
                                                                  "negclip/valid_neg_clip.tsv")
        return
    assert data.train_annotations == data.val_annotations == "annotations/dataset_coco.json"
    assert list(data.train_karpathy_splits) == ["train", "restval"] and list(data.val_karpathy_splits) == ["val"]


def test_the_default_data_is_karpathys_split():
    data = load_config([]).data
    assert data.train_annotations.endswith("dataset_coco.json") and list(data.train_karpathy_splits) == [
        "train", "restval"]


SWEEPS = sorted((REPO_ROOT / "configs" / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_run_of_every_shipped_sweep_validates(path, monkeypatch):
    # A sweep's config paths and overrides are relative to the repository root, as `make study` runs them.
    from slurm.sweep import check_runs, load_sweep
    monkeypatch.chdir(REPO_ROOT)
    sweep = load_sweep(path)
    assert sweep.runs
    check_runs(sweep, range(len(sweep.runs)), data_here=False)  # as fit checks each run before training
    for run in sweep.runs:
        cfg = load_config(run.configs, run.overrides + [f"experiment={run.name}"])
        assert cfg.method.name in METHODS
        register_model_configs(cfg.model.config_dir)
        assert cfg.model.name in open_clip.list_models()


def test_the_study_gives_every_fine_tuning_method_the_same_budget():
    from slurm.sweep import load_sweep
    runs = load_sweep(REPO_ROOT / "configs" / "sweeps" / "study.yaml").runs
    budgets = {}
    for run in runs:
        cfg = load_config(run.configs, run.overrides)
        if cfg.method.name not in ("tflocal", "tfglobal"):
            budgets[run.name] = (cfg.trainer.max_steps, cfg.data.batch_size, cfg.model.pretrained, cfg.data.root)
    assert len(budgets) == 60
    assert set(budgets.values()) == {(600, 64, "runs/study/backbones/seed-0/export", "data/study")}


# ----- each method owns its options ---------------------------------------------------------------------------
def test_a_key_of_another_method_is_refused_naming_its_owner():
    from lightning_modules import load_run_config

    with pytest.raises(ConfigError, match=r"'method.mlm_weight' .* is an option of method macco, and this run's "
                                          r"method is clip_ft"):
        load_run_config([], ["method.mlm_weight=0"])
    with pytest.raises(ConfigError, match=r"method.hard_mask.*option of method smartclip.*method is macco; its "
                                          r"options: .*method.mlm_weight"):
        load_run_config([REPO_ROOT / "configs" / "macco.yaml"], ["method.hard_mask=false"])


def test_a_typo_in_a_method_key_names_the_closest_of_that_method():
    from lightning_modules import load_run_config

    with pytest.raises(ConfigError, match=r"unknown config key 'method.mlm_weigth'.*did you mean 'method.mlm_weight'"):
        load_run_config([], ["method.name=macco", "method.mlm_weigth=3"])
    with pytest.raises(ConfigError, match=r"method.name='maco' is not a registered method; did you mean 'macco'"):
        load_run_config([], ["method.name=maco"])
    with pytest.raises(ConfigError, match=r"method.aligner_loss='itn' is not one of infonce, itm; did you mean"):
        load_run_config([], ["method.name=tflocal", "method.aligner_loss=itn"])


def test_the_method_section_holds_its_own_options_only():
    from lightning_modules import load_run_config

    cfg = load_run_config([REPO_ROOT / "configs" / "smartclip.yaml"])
    assert "mlm_weight" not in cfg.method and "attribution" not in cfg.method and cfg.method.hard_mask
    assert cfg.method.hard_negatives == {"captions": 0, "images": False}


def test_without_the_registry_method_keys_are_left_to_training():
    """Preprocessing loads training configs without the method classes: their own keys pass unchecked."""
    cfg = load_config([REPO_ROOT / "configs" / "macco.yaml"])
    assert cfg.method.mlm_weight == 20.0


def test_derived_per_device_batches_cannot_be_set():
    with pytest.raises(ConfigError, match="per_device_batch_size .*derived from data.batch_size"):
        load_config([], ["data.per_device_batch_size=4"])
    assert load_config([], ["data.per_device_batch_size=4"], saved=True).data.per_device_batch_size == 4


def test_the_global_batch_splits_over_devices_and_accumulation_or_is_refused():
    from lightning_modules.fit import split_global_batch

    assert split_global_batch("data.batch_size", 256, 4) == 64
    assert split_global_batch("data.batch_size", 1024, 1, accumulate=4) == 256
    with pytest.raises(ConfigError, match=r"data.batch_size=256 is the global batch and does not divide over 3 "
                                          r"device\(s\).*multiple of 3 \(e.g. 255 or 258\)"):
        split_global_batch("data.batch_size", 256, 3)
    with pytest.raises(ConfigError, match="multiple of 8"):
        split_global_batch("data.batch_size", 4, 8)


@pytest.mark.parametrize("threads, accelerator, devices, expected", [
    ("16", "cpu", 1, 0), ("16", "gpu", 1, 8), ("16", "cuda", 2, 7), ("2", "gpu", 1, 1), ("1", "gpu", 1, 1)])
def test_auto_loader_workers_follow_the_accelerator_and_the_cpu_share(monkeypatch, threads, accelerator, devices,
                                                                     expected):
    from core.config import loader_workers

    monkeypatch.setenv("OMP_NUM_THREADS", threads)  # what a local sweep gives each of its runs
    assert loader_workers("auto", accelerator, devices) == expected
    assert loader_workers(3, accelerator, devices) == 3


def test_loader_workers_refuse_what_is_neither_a_count_nor_auto():
    from core.config import loader_workers

    for bad in (-1, "four", 2.5, True):
        with pytest.raises(ConfigError, match="data.num_workers"):
            loader_workers(bad, "cpu")


@pytest.mark.parametrize("stage", ["backbone", "finetune"])
def test_the_study_moves_to_a_gpu_with_one_override(stage, monkeypatch):
    """On the CPU the study decodes in the training process; with trainer.accelerator=gpu it gets loader
    processes, and stays in float32 so that the objective is the same on either device."""
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    config = REPO_ROOT / "configs" / "study" / f"{stage}.yaml"
    on_cpu = load_config([config])
    on_gpu = load_config([config], ["trainer.accelerator=gpu"])
    assert (on_cpu.trainer.accelerator, on_cpu.data.num_workers) == ("cpu", 0)
    assert (on_gpu.trainer.accelerator, on_gpu.data.num_workers) == ("gpu", 3)
    assert on_cpu.trainer.precision == on_gpu.trainer.precision == "32-true"
