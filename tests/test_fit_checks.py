"""fit's command line: options and overrides in any order, and what it refuses before building anything (a method
name typo, a method without the masks it reads, a benchmark name typo), each in one message, never a traceback."""
from __future__ import annotations

import importlib

import pytest

from core.config import REPO_ROOT
from lightning_modules import load_run_config
from lightning_modules import METHODS, fit
from fitting import NEEDS_MASKS, TINY

PRETRAIN = str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml")


def fit_refusal(monkeypatch, *argv: str) -> str:
    """fit's main on `argv`, which must end with a printed message before any model is built."""
    monkeypatch.setattr(fit, "build_module", lambda cfg: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as refused:
        fit.main(list(argv))
    assert isinstance(refused.value.code, str)  # printed to stderr, exit status 1
    return refused.value.code


def tiny_args(shapes_root, tmp_path, *overrides: str) -> list:
    return ["--config", PRETRAIN, f"model.name={TINY}", f"data.root={shapes_root}", f"runs_root={tmp_path}",
            "data.num_workers=0", *overrides]


def test_a_method_name_typo_is_one_line_naming_the_closest_and_every_method(shapes_root, tmp_path, monkeypatch):
    message = fit_refusal(monkeypatch, *tiny_args(shapes_root, tmp_path, "method.name=clip_fft"))
    assert message == ("config error: method.name='clip_fft' is not a registered method; did you mean 'clip_ft'? "
                       "(methods: clip_cae, clip_ft, macco, smartclip, tfglobal, tflocal)")
    assert not list(tmp_path.iterdir())


def test_methods_declare_the_masks_they_read():
    declared = {name: cls.required_masks for name, cls in METHODS.items()}
    assert declared == {"clip_ft": (), "clip_cae": ("obj_mask", "comp_mask"), "macco": ("comp_mask", "patch_mask"),
                        "smartclip": (), "tflocal": (), "tfglobal": ()}
    # the methods test_fit must give the preprocessing cache to train at all
    assert {name for name, masks in declared.items() if masks} == set(NEEDS_MASKS)


@pytest.mark.parametrize("method", sorted(NEEDS_MASKS))
def test_a_method_without_the_masks_it_reads_is_refused_before_the_first_step(shapes_root, tmp_path, monkeypatch,
                                                                              method):
    message = fit_refusal(monkeypatch, *tiny_args(shapes_root, tmp_path, f"method.name={method}", "data.masks=false"))
    masks = " and ".join(METHODS[method].required_masks)
    assert message == (f"training cannot start: data.masks=false: method {method} reads {masks} from every "
                       "batch: set data.masks=true and run python -m datamodules.preprocess with this run's "
                       "--config files and overrides first")
    assert not list(tmp_path.iterdir())


def test_a_benchmark_name_typo_is_refused_with_the_closest(shapes_root, tmp_path, monkeypatch):
    message = fit_refusal(monkeypatch, *tiny_args(shapes_root, tmp_path, "evaluation.benchmarks=[sugarcrep]",
                                                  "evaluation.every_n_steps=2"))
    assert "evaluation.benchmarks: 'sugarcrep' is not a registered benchmark; did you mean 'sugarcrepe'?" in message


# Every CLI that takes --config files and key=value overrides.
CONFIG_CLIS = ["lightning_modules.fit", "datamodules.preprocess", "datamodules.features", "perf.loader",
               "study.term_gradients"]


@pytest.mark.parametrize("module", CONFIG_CLIS)
def test_config_files_and_overrides_may_interleave(module, tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("experiment: a\noptim:\n  lr: 0.1\n  warmup_steps: 7\n")
    second.write_text("optim:\n  lr: 0.2\n")
    parse_args = importlib.import_module(module).parse_args
    args = parse_args(["optim.lr=0.3", "--config", str(first), "seed=3", "--config", str(second), "seed=4"])
    assert args.config == [str(first), str(second)]
    assert args.overrides == ["optim.lr=0.3", "seed=3", "seed=4"]
    # every file merges before every override, each in the order given: the override given first still wins
    cfg = load_run_config(args.config, args.overrides)
    assert (cfg.experiment, cfg.optim.lr, cfg.optim.warmup_steps, cfg.seed) == ("a", 0.3, 7, 4)


def test_perf_step_options_and_overrides_may_interleave():
    args = importlib.import_module("perf.step").parse_args(["seed=3", "--model", TINY, "optim.lr=0.3",
                                                             "--repeats", "2", "seed=4"])
    assert (args.model, args.repeats, args.overrides) == (TINY, 2, ["seed=3", "optim.lr=0.3", "seed=4"])
