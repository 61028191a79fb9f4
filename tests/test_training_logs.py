"""What training reports while it runs: learning rates at the step they apply to, loss and throughput in the bar."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_modules import callbacks
from lightning_modules.base import warmup_cosine
from lightning_modules.callbacks import SamplesPerSecond
from lightning_modules.fit import run
from fitting import STEPS_PER_EPOCH, tiny_config

LOG_EVERY = 3  # divides neither the 4 batches of an epoch nor the 2 optimizer steps of an accumulated epoch


def scalar_events(run_dir, tag: str) -> list:
    events = EventAccumulator(str(run_dir / "tb" / "version_0"))
    events.Reload()
    return events.Scalars(tag)


@pytest.mark.parametrize("accumulate, max_steps", [(1, 10), (2, 7)])  # 2.5 and 3.5 epochs
def test_learning_rates_are_logged_at_the_step_they_apply_to(shapes_root, tmp_path, accumulate, max_steps):
    cfg = tiny_config(shapes_root, tmp_path, f"trainer.max_steps={max_steps}", "trainer.limit_val_batches=0",
                      f"trainer.log_every_n_steps={LOG_EVERY}", f"trainer.accumulate_grad_batches={accumulate}",
                      "optim.warmup_steps=4", "optim.min_lr_ratio=0.1")  # lr differs at neighbouring steps
    trainer = run(cfg)
    assert trainer.global_step == max_steps and max_steps > 2 * STEPS_PER_EPOCH // accumulate
    groups = trainer.lightning_module.param_groups()
    assert {"backbone", "logit_scale"} <= {group["name"] for group in groups}
    for group in groups:
        logged = scalar_events(tmp_path / "demo_pretrain", f"lr/{group['name']}")
        steps = [event.step for event in logged]
        assert steps == list(range(0, max_steps, LOG_EVERY)), group["name"]  # once each, across epochs
        for event in logged:
            multiplier = warmup_cosine(event.step, group["warmup_steps"], max_steps, cfg.optim.min_lr_ratio)
            assert event.value == pytest.approx(group["lr"] * multiplier, rel=1e-5), (group["name"], event.step)


def test_the_progress_bar_shows_the_loss_and_the_throughput(shapes_root, tmp_path):
    trainer = run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=3", "trainer.limit_val_batches=0"))
    shown = trainer.progress_bar_metrics
    assert "train/loss" in shown and shown["train/samples_per_s"] > 0
    assert "train/itc_loss" not in shown  # the single terms stay in TensorBoard, the bar stays readable
    assert len(scalar_events(tmp_path / "demo_pretrain", "train/samples_per_s")) == 2  # from the 2nd batch on


class RecordingModule:
    def __init__(self):
        self.logged = []

    def log(self, name, value, **options):
        self.logged.append((name, value, options))


def test_throughput_is_the_median_interval_so_one_pause_does_not_show(monkeypatch):
    clock = iter([0.0, 1.0, 2.0, 60.0, 61.0, 62.0])  # a 58 s benchmark evaluation between batches 3 and 4
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    meter, module = SamplesPerSecond(window=5), RecordingModule()
    trainer = SimpleNamespace(world_size=2)
    for index in range(6):
        meter.on_train_batch_end(trainer, module, None, {"text": [0] * 8}, index)
    values = [value for name, value, _ in module.logged]
    assert values == [16.0, 16.0, 16.0, 16.0, 16.0]  # 8 samples x 2 ranks per second; the pause is ignored
    assert all(options["prog_bar"] for _, _, options in module.logged)


def test_validation_time_is_not_counted(monkeypatch):
    clock = iter([0.0, 1.0, 30.0, 31.0])  # validation from 1 s to 30 s
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    meter, module = SamplesPerSecond(), RecordingModule()
    trainer = SimpleNamespace(world_size=1)
    meter.on_train_batch_end(trainer, module, None, {"text": [0] * 4}, 0)
    meter.on_train_batch_end(trainer, module, None, {"text": [0] * 4}, 1)
    meter.on_validation_end(trainer, module)
    meter.on_train_batch_end(trainer, module, None, {"text": [0] * 4}, 2)
    assert [value for _, value, _ in module.logged] == [4.0, 4.0]
