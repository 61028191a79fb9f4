"""CLIs check their inputs before building anything: clear errors naming the key, no folder left behind."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import datamodules.preprocess as preprocess
from core.config import REPO_ROOT
from datamodules import features
from datamodules.inputs import InputError, check_data_inputs, check_feature_inputs, check_preprocess_inputs
from parsers.grounding import GrounderInputError, NoGrounder, build_grounder
from fitting import tiny_config

DEMO = str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml")


@pytest.fixture(scope="module")
def bert_files(tmp_path_factory) -> Path:
    """A directory shaped like a saved BERT (config + vocabulary): what the check looks for, nothing loads it."""
    directory = tmp_path_factory.mktemp("bert")
    (directory / "config.json").write_text("{}")
    (directory / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n")
    return directory


def groundingdino_overrides(root: Path, cache: Path, *extra: str) -> list:
    return [f"data.root={root}", f"preprocess.cache_root={cache}", "preprocess.grounder=groundingdino", *extra]


# Runs the CLI's main in a fresh interpreter and reports which heavy modules the refusal had imported.
PROBE = """
import sys
from datamodules.preprocess import main
try:
    main(sys.argv[1:])
except SystemExit as end:
    print(end, file=sys.stderr)
    heavy = [name for name in ("torch", "groundingdino", "spacy", "lightning") if name in sys.modules]
    print("imported:", ",".join(heavy) or "nothing heavy")
    sys.exit(1)
"""


def run_cli(code_or_module: list, tmp_path: Path, hf_home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home), "PYTHONPATH": str(REPO_ROOT)}
    # The bound only guards against a hang: the refusal itself takes about a second (no model, no torch).
    return subprocess.run([sys.executable, *code_or_module], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_groundingdino_without_a_checkpoint_is_refused_before_anything_is_imported(shapes_root, tmp_path):
    cache = tmp_path / "cache"
    args = ["--config", DEMO, *groundingdino_overrides(shapes_root, cache)]
    cli = run_cli(["-m", "datamodules.preprocess", *args], tmp_path, tmp_path / "hf")
    assert cli.returncode != 0
    assert "preprocess.groundingdino_checkpoint=None" in cli.stderr and "random weights" in cli.stderr
    assert "preprocess.allow_random_detector=true" in cli.stderr  # the message names the option to set
    # The default text encoder is a hub name; offline and not in the (empty) hub cache, that is reported too.
    assert "preprocess.text_encoder=bert-base-uncased" in cli.stderr and "offline" in cli.stderr
    assert not cache.exists()
    probe = run_cli(["-c", PROBE, *args], tmp_path, tmp_path / "hf")
    assert "allow_random_detector" in probe.stderr
    assert "imported: nothing heavy" in probe.stdout  # refused before torch (let alone the detector) loads


def groundingdino_files_config(root: Path, tmp_path: Path, text_encoder: Path):
    return tiny_config(root, tmp_path, *groundingdino_overrides(
        root, tmp_path / "cache", f"preprocess.groundingdino_checkpoint={tmp_path / 'gd.pth'}",
        f"preprocess.groundingdino_config={tmp_path / 'gd.py'}", f"preprocess.text_encoder={text_encoder}"))


def test_every_groundingdino_input_is_checked(shapes_root, tmp_path, bert_files):
    with pytest.raises(InputError) as error:
        check_preprocess_inputs(groundingdino_files_config(shapes_root, tmp_path, tmp_path / "bert"))
    message = str(error.value)
    for key, path in (("groundingdino_checkpoint", "gd.pth"), ("groundingdino_config", "gd.py"),
                      ("text_encoder", "bert")):
        assert f"preprocess.{key}={tmp_path / path}: no such" in message, key
    (tmp_path / "gd.pth").write_bytes(b"weights")
    (tmp_path / "gd.py").write_text("")
    check_preprocess_inputs(groundingdino_files_config(shapes_root, tmp_path, bert_files))  # all present


def test_random_detector_weights_only_when_asked_for(shapes_root, tmp_path, bert_files):
    overrides = groundingdino_overrides(shapes_root, tmp_path / "cache", f"preprocess.text_encoder={bert_files}")
    with pytest.raises(InputError, match="allow_random_detector"):
        check_preprocess_inputs(tiny_config(shapes_root, tmp_path, *overrides))
    allowed = tiny_config(shapes_root, tmp_path, *overrides, "preprocess.allow_random_detector=true")
    check_preprocess_inputs(allowed)
    grounder = preprocess.make_grounder(allowed.data, allowed.preprocess)  # the model itself loads on first use
    assert grounder.settings()["random_init_seed"] == 0 and grounder.checkpoint is None


def test_the_grounder_itself_refuses_random_weights(bert_files):
    with pytest.raises(GrounderInputError, match="allow_random_weights=True"):
        build_grounder("groundingdino", checkpoint=None, text_encoder=str(bert_files))
    with pytest.raises(GrounderInputError, match="no such file"):
        build_grounder("groundingdino", checkpoint="/nowhere/gd.pth", text_encoder=str(bert_files))


def test_missing_data_is_reported_with_every_key_at_once(shapes_root, tmp_path):
    with pytest.raises(InputError, match=r"data.root=.*nowhere: no such directory"):
        check_data_inputs(tiny_config(tmp_path / "nowhere", tmp_path))
    cfg = tiny_config(shapes_root, tmp_path, "data.train_annotations=annotations/missing.json",
                      "data.val_images=images/none", f"data.exclude_image_ids={tmp_path / 'ids.txt'}")
    with pytest.raises(InputError) as error:
        check_data_inputs(cfg)
    message = str(error.value)
    assert message.startswith("training cannot start")
    assert "data.train_annotations=annotations/missing.json" in message and "data.val_images=images/none" in message
    assert "data.exclude_image_ids" in message
    check_data_inputs(tiny_config(shapes_root, tmp_path))  # the real world passes
    check_data_inputs(tiny_config(shapes_root, tmp_path, "data.val_images=images/none"), need_images=False)
    with pytest.raises(InputError, match="train_annotations is not set"):
        check_data_inputs(tiny_config(shapes_root, tmp_path, "data.train_annotations=''"))


def test_preprocess_and_features_check_data_before_building(shapes_root, tmp_path, monkeypatch):
    def not_reached(*args):
        raise AssertionError("a model was built before the inputs were checked")

    monkeypatch.setattr(preprocess, "build_parser", not_reached)
    monkeypatch.setattr(features, "build_frozen_backbone", not_reached)
    missing = tiny_config(shapes_root, tmp_path, "data.val_annotations=annotations/missing.json",
                          f"data.features_cache={tmp_path / 'features'}", f"preprocess.cache_root={tmp_path / 'c'}")
    with pytest.raises(InputError, match="data.val_annotations=annotations/missing.json"):
        preprocess.run(missing)
    with pytest.raises(InputError, match="data.val_annotations=annotations/missing.json"):
        features.run(missing)
    with pytest.raises(InputError, match="data.features_cache is not set"):
        check_feature_inputs(tiny_config(shapes_root, tmp_path))
    with pytest.raises(SystemExit, match="feature caching cannot start"):
        features.main(["--config", DEMO, f"data.root={tmp_path / 'nowhere'}", f"data.features_cache={tmp_path}"])
    assert not (tmp_path / "c").exists() and not (tmp_path / "features").exists()


class BrokenGrounder(NoGrounder):
    """Fails like a detector whose weights cannot be loaded: at the first images."""

    def ground(self, requests):
        raise RuntimeError("cannot load the detector")


def test_a_preprocessing_job_that_fails_before_its_first_shard_leaves_no_cache(shapes_root, tmp_path, monkeypatch):
    monkeypatch.setattr(preprocess, "make_grounder", lambda data, prep: BrokenGrounder())
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="cannot load"):
        preprocess.run(tiny_config(shapes_root, tmp_path, f"preprocess.cache_root={cache}"))
    assert not cache.exists()


def test_a_feature_job_that_fails_before_its_first_shard_leaves_no_cache(shapes_root, tmp_path, monkeypatch):
    def fails(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(features, "encode_shard", fails)
    cache = tmp_path / "features"
    with pytest.raises(RuntimeError, match="out of memory"):
        features.run(tiny_config(shapes_root, tmp_path, "method.name=tflocal", f"data.features_cache={cache}"))
    assert not cache.exists()
