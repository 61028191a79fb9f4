"""The command lines that take --config files and key=value overrides: options and overrides in any order."""
from __future__ import annotations

import importlib

import pytest

from core.config import load_config
from test_fit import TINY

# Every CLI that takes --config files and key=value overrides.
CONFIG_CLIS = ["lightning_modules.fit", "datamodules.preprocess", "datamodules.features", "perf.loader",
               "perf.term_gradients"]


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
    cfg = load_config(args.config, args.overrides)
    assert (cfg.experiment, cfg.optim.lr, cfg.optim.warmup_steps, cfg.seed) == ("a", 0.3, 7, 4)


def test_perf_step_options_and_overrides_may_interleave():
    args = importlib.import_module("perf.step").parse_args(["seed=3", "--model", TINY, "optim.lr=0.3",
                                                             "--repeats", "2", "seed=4"])
    assert (args.model, args.repeats, args.overrides) == (TINY, 2, ["seed=3", "optim.lr=0.3", "seed=4"])
