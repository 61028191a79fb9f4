"""End to end: fit on a tiny shapes world, resume parity, gradients of every method, export, NaN guard, CLI."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import open_clip
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from core.config import REPO_ROOT
from lightning_modules import load_run_config
from modeling.export import load_export
from lightning_modules import METHODS
from lightning_modules.base import NonFiniteLossError, total_loss
from lightning_modules.callbacks import cpu_model
from lightning_modules.fit import build_module, run
from fitting import (NEEDS_MASKS, STEPS_PER_EPOCH, TINY, NanAtStep, StopAfter, a_batch, exported_state,
                     method_overrides, tiny_config)
from tolerance import scaled_close

@pytest.mark.parametrize("method,precision", [(name, "32-true") for name in sorted(METHODS)] +
                         [("clip_ft", "bf16-mixed")])
def test_fast_dev_run_of_every_method(shapes_root, mask_cache, tmp_path, method, precision):
    cfg = tiny_config(shapes_root, tmp_path, *method_overrides(method, mask_cache), "trainer.fast_dev_run=2",
                      f"trainer.precision={precision}")
    trainer = run(cfg)
    assert trainer.global_step == 2
    assert (tmp_path / "demo_pretrain" / "export" / "open_clip.pt").is_file()


HARD_NEGATIVES = ["method.hard_negatives.captions=3"]


@pytest.mark.parametrize("method,extra", [(name, []) for name in sorted(METHODS)] + [
    (name, HARD_NEGATIVES) for name in ("clip_ft", "macco", "smartclip")])
def test_every_trainable_parameter_receives_a_gradient(shapes_root, mask_cache, tmp_path, method, extra):
    cfg = tiny_config(shapes_root, tmp_path, *method_overrides(method, mask_cache), *extra)
    L.seed_everything(0)
    module = build_module(cfg).train()
    terms, _ = module.compute_terms(a_batch(module, cfg))
    total_loss(terms).backward()
    for name, param in module.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_hard_negatives_change_the_objective(shapes_root, tmp_path):
    plain = tiny_config(shapes_root, tmp_path)
    negclip = tiny_config(shapes_root, tmp_path, "method.hard_negatives.captions=3")
    losses, batch = [], None
    for cfg in (negclip, plain):
        L.seed_everything(0)
        module = build_module(cfg).train()
        batch = a_batch(module, cfg) if batch is None else batch  # one batch (with neg_text) for both
        losses.append(module.compute_terms(batch)[0]["itc_loss"])
    assert losses[0] > losses[1]  # extra negative columns can only raise the image-to-text loss


@pytest.mark.parametrize("stop, workers", [(STEPS_PER_EPOCH, 0), (3, 0), (6, 2)])
def test_resume_equals_uninterrupted_training(shapes_root, tmp_path, capfd, stop, workers):
    """`stop` steps + stop + rerun of the same command == 2 epochs uninterrupted (random crops on), whether the
    stop is at an epoch boundary or mid-epoch (the loader's position is in the checkpoint), with workers."""
    steps = 2 * STEPS_PER_EPOCH
    overrides = (f"trainer.max_steps={steps}", "data.train_augment=true", "trainer.limit_val_batches=0",
                 f"data.num_workers={workers}")
    run(tiny_config(shapes_root, tmp_path / "a", *overrides), extra_callbacks=[StopAfter(stop)])
    last = torch.load(tmp_path / "a" / "demo_pretrain" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == stop
    epoch, batches_done = divmod(stop - 1, STEPS_PER_EPOCH)  # the loader's position after batch `stop`
    assert last["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": epoch,
                                                                           "batches_done": batches_done + 1}]
    resumed = run(tiny_config(shapes_root, tmp_path / "a", *overrides))
    assert "Resuming from" in capfd.readouterr().out
    straight = run(tiny_config(shapes_root, tmp_path / "b", *overrides))
    assert resumed.global_step == straight.global_step == steps
    a, b = exported_state(tmp_path / "a" / "demo_pretrain"), exported_state(tmp_path / "b" / "demo_pretrain")
    start = load_export_state_of_random_init(shapes_root, tmp_path)
    assert any(not torch.equal(a[k], start[k]) for k in a)  # it trained
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6, msg=key)


def load_export_state_of_random_init(shapes_root, tmp_path) -> dict:
    L.seed_everything(0)
    return {k: v.float() for k, v in build_module(tiny_config(shapes_root, tmp_path)).clip.state_dict().items()}


def test_resume_false_moves_the_old_run_aside(shapes_root, tmp_path):
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=1", "trainer.limit_val_batches=0"))
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=1", "trainer.limit_val_batches=0", "resume=false"))
    assert (tmp_path / "demo_pretrain.previous-1" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "demo_pretrain" / "config.yaml").is_file()


def test_export_loads_in_plain_open_clip_with_identical_features(shapes_root, tmp_path):
    cfg = tiny_config(shapes_root, tmp_path, "trainer.max_steps=3")
    trainer = run(cfg)
    module = trainer.lightning_module.eval()
    export_dir = tmp_path / "demo_pretrain" / "export"
    meta = json.loads((export_dir / "model.json").read_text())
    assert meta["model"] == TINY and meta["global_step"] == 3
    # What the weights' exact bits depend on beyond the config, for a results bundle to compare.
    assert meta["numerics"] == {"device": f"cpu {torch.backends.cpu.get_cpu_capability()}", "cpu": cpu_model(),
                                "processes": 1,
                                "threads": torch.get_num_threads(), "precision": "32-true",
                                "torch": torch.__version__}
    open_clip.add_model_config(export_dir / "model_configs")
    model, _, preprocess = open_clip.create_model_and_transforms(
        meta["model"], pretrained=str(export_dir / "open_clip.pt"))
    model.eval()
    ids = module.tokenizer(["a red square left of a blue circle", "a small green triangle"])
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        # open_clip's forward against the module's encoders: ~1e-6 of the largest feature
        assert scaled_close(model.encode_text(ids), module.encoders.encode_text(ids).pooled, 1e-5)
        assert scaled_close(model.encode_image(images), module.encoders.encode_image(images).pooled, 1e-5)
        rebuilt = load_export(export_dir).model.eval()
        assert scaled_close(rebuilt.encode_image(images), model.encode_image(images), 1e-6)  # the same forward


def test_best_checkpoint_and_tensorboard_and_resolved_config(shapes_root, tmp_path):
    run(tiny_config(shapes_root, tmp_path, f"trainer.max_steps={2 * STEPS_PER_EPOCH}"))
    run_dir = tmp_path / "demo_pretrain"
    assert len(list((run_dir / "checkpoints").glob("best-*.ckpt"))) == 1
    events = EventAccumulator(str(run_dir / "tb" / "version_0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/itc_loss", "train/logit_scale", "train/data/bad_image", "train/data/truncated",
            "val/loss", "val/itc_loss", "lr/backbone", "lr/logit_scale"} <= tags, tags
    assert len(events.Scalars("train/itc_loss")) == 2 * STEPS_PER_EPOCH  # logged every step
    saved = load_run_config([run_dir / "config.yaml"], base=None, saved=True)
    assert saved.model.name == TINY and saved.data.batch_size == 8


def test_non_finite_loss_stops_with_the_step_and_terms_and_keeps_the_checkpoint(shapes_root, tmp_path):
    cfg = tiny_config(shapes_root, tmp_path, "trainer.max_steps=6", "checkpoint.every_n_steps=2",
                      "trainer.limit_val_batches=0")
    with pytest.raises(NonFiniteLossError, match=r"global step 3.*itc_loss=nan"):
        run(cfg, extra_callbacks=[NanAtStep(3)])
    checkpoint = torch.load(tmp_path / "demo_pretrain" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values() if v.is_floating_point())


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "lightning_modules.fit", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_trains_resumes_and_rejects_typos(shapes_root, tmp_path):
    args = ["--config", str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), f"model.name={TINY}",
            f"model.config_dir={REPO_ROOT / 'configs' / 'models'}", f"data.root={shapes_root}", "data.masks=false",
            "data.batch_size=8", "data.num_workers=0", "trainer.max_steps=2", "trainer.enable_progress_bar=false"]
    first = cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "Resuming" not in first.stdout
    assert (tmp_path / "runs" / "demo_pretrain" / "export" / "model.json").is_file()
    second = cli(*args, "trainer.max_steps=3", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Resuming from runs/demo_pretrain/checkpoints/last.ckpt" in second.stdout
    assert json.loads((tmp_path / "runs" / "demo_pretrain" / "export" / "model.json").read_text())["global_step"] == 3
    typo = cli(*args, "trainer.max_stepz=3", cwd=tmp_path)
    assert typo.returncode != 0
    assert "did you mean 'trainer.max_steps'" in typo.stderr


def test_unknown_method_lists_the_registered_ones(shapes_root, tmp_path):
    from core.config import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'clip_ft'.*methods: clip_cae, clip_ft, macco"):
        tiny_config(shapes_root, tmp_path, "method.name=clip_fft")


def logged_scalars(run_dir: Path, tag: str) -> dict:
    events = EventAccumulator(str(run_dir / "tb" / "version_0"))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def test_ddp_on_two_processes_equals_one_process_with_the_global_batch(shapes_root, tmp_path):
    """2 gloo ranks x batch 4 see the same samples and augmentations as 1 process x batch 8 (sharding
    interleaves the seeded permutation), and the exact gathered loss makes the updates equal. The losses written
    on the logging steps are the means over ranks (reduced on those steps only): the single process's losses."""
    common = ["--config", str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), f"model.name={TINY}",
              f"data.root={shapes_root}", "data.num_workers=0", "data.masks=false", "trainer.max_steps=3",
              "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=2"]
    # The same recipe (global batch 8) on 2 processes and on 1: fit splits it per device and records the split.
    ddp = cli(*common, "data.batch_size=8", "trainer.devices=2", "trainer.strategy=ddp", cwd=tmp_path / "ddp")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = cli(*common, "data.batch_size=8", cwd=tmp_path / "single")
    assert single.returncode == 0, single.stderr[-3000:]
    assert "global batch 8 = 2 device(s) x 4 per device" in ddp.stdout
    assert "global batch 8 = 1 device(s) x 8 per device" in single.stdout
    for where, per_device in (("ddp", 4), ("single", 8)):
        saved = load_run_config([tmp_path / where / "runs" / "demo_pretrain" / "config.yaml"], base=None, saved=True)
        assert (saved.data.batch_size, saved.data.per_device_batch_size) == (8, per_device)
    for tag in ("train/loss", "train/itc_loss"):
        ddp_logged = logged_scalars(tmp_path / "ddp" / "runs" / "demo_pretrain", tag)
        single_logged = logged_scalars(tmp_path / "single" / "runs" / "demo_pretrain", tag)
        assert sorted(ddp_logged) == sorted(single_logged) and len(ddp_logged) == 1, tag  # 3 steps, every 2nd
        for step, value in single_logged.items():  # the earlier update moved the weights apart by ulps only
            assert ddp_logged[step] == pytest.approx(value, rel=1e-5), (tag, step)
    a = exported_state(tmp_path / "ddp" / "runs" / "demo_pretrain")
    b = exported_state(tmp_path / "single" / "runs" / "demo_pretrain")
    # 3 AdamW steps at the demo's warmup learning rates (lr * 1/40, 2/40, 3/40 = 2.5e-5, 5e-5, 7.5e-5).
    # Per-rank sums round differently from one batch (as do 1 and 2 threads), which moves a trained weight by
    # an ulp or so (rtol; atol 3e-6, a few % of the movement). The attention key biases are the exception: their
    # true gradient is zero (softmax is shift invariant), so their gradient is rounding noise, which Adam
    # normalises into steps of up to lr * 1.004 each (the bound of |m_hat| / sqrt(v_hat) over 3 steps at betas
    # 0.9 / 0.98): the two runs agree only within twice the sum of those steps (seen apart: 4e-7 on one machine,
    # 4.6e-6 on another). Every other entry is held to the tight tolerance.
    optim = load_run_config([REPO_ROOT / "configs" / "demo" / "pretrain.yaml"]).optim
    noise_bound = 2 * 1.01 * sum(optim.lr * (step + 1) / optim.warmup_steps for step in range(3))
    for key in a:
        tight = torch.ones_like(a[key], dtype=torch.bool)
        if key.endswith("attn.in_proj_bias"):
            width = a[key].shape[0] // 3  # [query; key; value] biases
            tight[width:2 * width] = False
            assert (a[key][~tight] - b[key][~tight]).abs().max() <= noise_bound, key
        assert torch.allclose(a[key][tight], b[key][tight], rtol=1e-6, atol=3e-6), key


def test_fit_with_masks_from_the_preprocessing_cache(shapes_root, tmp_path):
    """The demo's path: preprocess (ground-truth grounder) then train on batches carrying the three masks."""
    from datamodules.preprocess import run as run_preprocess

    cfg = tiny_config(shapes_root, tmp_path, "data.masks=true", f"preprocess.cache_root={tmp_path / 'cache'}",
                      "trainer.max_steps=2", "trainer.limit_val_batches=0")
    run_preprocess(cfg)
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append({key: batch[key] for key in ("obj_mask", "comp_mask", "patch_mask")})

    run(cfg, extra_callbacks=[Record()])
    assert len(seen) == 2
    assert seen[0]["obj_mask"].shape == (8, 77) and seen[0]["patch_mask"].shape == (8, 16)
    assert all(batch["obj_mask"].any() and batch["comp_mask"].any() for batch in seen)


def test_corrupt_training_image_is_skipped_and_counted_in_tensorboard(shapes_root, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shapes_root, data)
    victim = sorted((data / "images" / "train").glob("*.png"))[3]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated PNG: its 2 captions get substitutes
    cfg = tiny_config(data, tmp_path, "data.on_bad_image=skip", f"trainer.max_steps={STEPS_PER_EPOCH}",
                      "trainer.limit_val_batches=0")
    run(cfg)
    events = EventAccumulator(str(tmp_path / "demo_pretrain" / "tb" / "version_0"))
    events.Reload()
    assert sum(e.value for e in events.Scalars("train/data/bad_image")) == 2  # one epoch sees every sample
    with pytest.raises(Exception, match=victim.name):
        run(tiny_config(data, tmp_path / "strict", "trainer.max_steps=4", "trainer.limit_val_batches=0"))


class TrainingModeAtEveryStep(L.Callback):
    def __init__(self):
        self.modes = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.modes.append(module.clip.training)


def test_benchmarks_are_scored_during_training_and_logged(shapes_root, tmp_path):
    from testkit.standin.sugarcrepe import write_sugarcrepe

    write_sugarcrepe(tmp_path / "bench" / "sugarcrepe", n_items=14)
    modes = TrainingModeAtEveryStep()
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=4", "evaluation.benchmarks=[sugarcrepe]",
                    "evaluation.every_n_steps=2", f"evaluation.data_root={tmp_path / 'bench'}"), [modes])
    events = EventAccumulator(str(tmp_path / "demo_pretrain" / "tb" / "version_0"))
    events.Reload()
    logged = events.Scalars("eval/sugarcrepe/overall_micro")
    assert [event.step for event in logged] == [2, 4]
    assert all(0.0 <= event.value <= 100.0 for event in logged)
    assert modes.modes == [True] * 4  # scoring put the model in eval mode; it is back in training mode


def test_a_missing_evaluation_benchmark_stops_before_training(shapes_root, tmp_path):
    from evaluation.benchmarks import MissingBenchmarkData

    with pytest.raises(MissingBenchmarkData, match="replace_obj.json"):
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=4", "evaluation.benchmarks=[sugarcrepe]",
                        "evaluation.every_n_steps=2", f"evaluation.data_root={tmp_path / 'nowhere'}"))
    assert not (tmp_path / "demo_pretrain" / "checkpoints").exists()


def test_fit_adds_the_attribution_monitor_from_the_config(shapes_root, tmp_path):
    from lightning_modules.monitor import AttributionMonitor

    trainer = run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=2", "monitor.every_n_steps=2",
                              "monitor.attributions=[attention]", "monitor.probe_size=4", "monitor.overlay_images=1"))
    monitors = [c for c in trainer.callbacks if isinstance(c, AttributionMonitor)]
    assert len(monitors) == 1 and "attention" in monitors[0].last_results


class Preempted(RuntimeError):
    pass


class SaveHpcThenDie(L.Callback):
    """Stands in for SLURM preemption: Lightning's SIGUSR1 handler writes hpc_ckpt_1.ckpt mid-epoch, then the
    job is gone (no last.ckpt was written: checkpoint.every_n_steps=0 and the epoch did not end)."""

    def __init__(self, run_dir: Path, steps: int):
        self.run_dir, self.steps = run_dir, steps

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.steps:
            trainer.save_checkpoint(self.run_dir / "hpc_ckpt_1.ckpt")
            raise Preempted()


def test_a_mid_epoch_hpc_checkpoint_resumes_to_the_uninterrupted_weights(shapes_root, tmp_path, capfd):
    overrides = (f"trainer.max_steps={2 * STEPS_PER_EPOCH}", "data.train_augment=true", "trainer.limit_val_batches=0")
    run_dir = tmp_path / "a" / "demo_pretrain"
    with pytest.raises(Preempted):
        run(tiny_config(shapes_root, tmp_path / "a", *overrides), extra_callbacks=[SaveHpcThenDie(run_dir, 2)])
    # A failure between steps writes last.ckpt too (stops.SafeStop); a killed job would not have: remove it.
    (run_dir / "checkpoints" / "last.ckpt").unlink()
    run(tiny_config(shapes_root, tmp_path / "a", *overrides))
    assert f"Resuming from {run_dir / 'hpc_ckpt_1.ckpt'}" in capfd.readouterr().out
    run(tiny_config(shapes_root, tmp_path / "b", *overrides))
    a, b = exported_state(run_dir), exported_state(tmp_path / "b" / "demo_pretrain")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6, msg=key)


def test_ddp_stopped_mid_epoch_and_resumed_equals_one_uninterrupted_process(shapes_root, tmp_path):
    """2 gloo ranks stop at step 3 of a 4-step epoch (max_steps), resume to step 6; equal to 6 straight steps
    of one process with the global batch. A constant lr after warmup (min_lr_ratio=1) keeps the schedule
    independent of max_steps, so only the data order can differ."""
    common = ["--config", str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), f"model.name={TINY}",
              f"data.root={shapes_root}", "data.num_workers=0", "data.masks=false", "data.train_augment=true",
              "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "optim.min_lr_ratio=1.0",
              "optim.warmup_steps=2", "optim.lr=1e-3"]
    ddp = [*common, "data.batch_size=8", "trainer.devices=2", "trainer.strategy=ddp"]
    first = cli(*ddp, "trainer.max_steps=3", cwd=tmp_path / "ddp")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = cli(*ddp, "trainer.max_steps=6", cwd=tmp_path / "ddp")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout
    single = cli(*common, "data.batch_size=8", "trainer.max_steps=6", cwd=tmp_path / "single")
    assert single.returncode == 0, single.stderr[-3000:]
    a = without_key_biases(exported_state(tmp_path / "ddp" / "runs" / "demo_pretrain"))
    b = without_key_biases(exported_state(tmp_path / "single" / "runs" / "demo_pretrain"))
    for key in a:
        # 2 gathered ranks and one process sum the loss in different orders: float32 rounding (measured <= 3e-6
        # after 6 steps), far below what one wrong batch moves (Adam steps of ~lr = 1e-3)
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=2e-5, msg=key)


def without_key_biases(state: dict) -> dict:
    """The state with the key part of every attention in_proj_bias zeroed. Softmax attention is invariant to a
    key bias (it adds the same q.b_k to every key's logit), so its true gradient is 0 and AdamW moves it by
    normalised rounding noise alone (~1e-4 between reduction orders): not a property of the data order."""
    state = dict(state)
    for key, value in state.items():
        if key.endswith("attn.in_proj_bias"):
            width = value.shape[0] // 3
            state[key] = torch.cat([value[:width], torch.zeros_like(value[width:2 * width]), value[2 * width:]])
    return state


# ----- NegCLIP with hard-negative images ------------------------------------------------------------------
def write_negclip_tsv_world(root: Path, rows: int = 16) -> Path:
    """A NegCLIP training TSV of `rows` captions, one 64 px image each (COCO-named), 2 hard captions and 3
    neg_image neighbours per row."""
    import csv

    import numpy as np
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    colours = ("red", "green", "blue", "yellow")
    with open(root / "train.tsv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter="\t")
        writer.writerow(["", "title", "filepath", "neg_caption", "neg_image"])
        for i in range(rows):
            name = f"COCO_train2014_{i + 1:012d}.jpg"
            pixels = np.random.default_rng(i).integers(0, 255, (64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "images" / name)
            a, b = colours[i % 4], colours[(i + 1) % 4]
            writer.writerow([i, f"a {a} square left of a {b} circle", f"coco/train2014/{name}",
                             repr([f"a {b} square left of a {a} circle", f"a {a} circle left of a {b} square"]),
                             repr([(i + k) % rows for k in (1, 5, 9)])])
    return root


NEGCLIP_OVERRIDES = ("method.hard_negatives.captions=1", "method.hard_negatives.images=true",
                     "data.train_annotations=train.tsv", "data.train_images=images", "data.val_annotations=null")


def test_negclip_batches_have_2b_images_and_4b_texts_end_to_end(tmp_path):
    root = write_negclip_tsv_world(tmp_path / "data")
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append({key: tuple(value.shape) for key, value in batch.items() if torch.is_tensor(value)})

    trainer = run(tiny_config(root, tmp_path / "runs", *NEGCLIP_OVERRIDES, "trainer.max_steps=2"), [Record()])
    assert trainer.global_step == 2 and len(seen) == 2
    shapes = seen[0]
    assert shapes["image"] == shapes["neg_image"] == (8, 3, 64, 64)
    assert shapes["text"] == shapes["neg_image_text"] == (8, 77)
    assert shapes["neg_text"] == shapes["neg_image_neg_text"] == (8, 1, 77)


class RecordedLoss(torch.nn.Module):
    """Stands in for ClipLoss: keeps what the method hands it, returns the real loss."""

    def __init__(self, loss):
        super().__init__()
        self.loss, self.calls = loss, []

    def forward(self, image, text, logit_scale, negatives=None):
        self.calls.append((image.detach(), text.detach(), None if negatives is None else negatives.detach()))
        return self.loss(image, text, logit_scale, negatives)


def test_clip_ft_scores_2b_images_against_4b_texts_in_training_only(shapes_root, tmp_path):
    cfg = tiny_config(shapes_root, tmp_path, *NEGCLIP_OVERRIDES[:3])
    L.seed_everything(0)
    module = build_module(cfg)
    module.itc = RecordedLoss(module.itc)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(1, 400, (n, 77), generator=g)  # noqa: E731
    batch = {"image": torch.randn(3, 3, 64, 64, generator=g), "neg_image": torch.randn(3, 3, 64, 64, generator=g),
             "text": ids(3), "neg_image_text": ids(3), "neg_text": ids(3)[:, None],
             "neg_image_neg_text": ids(3)[:, None]}
    with torch.no_grad():
        encode_image = lambda x: torch.nn.functional.normalize(module.clip.encode_image(x), dim=-1)  # noqa: E731
        encode_text = lambda x: torch.nn.functional.normalize(module.clip.encode_text(x), dim=-1)  # noqa: E731
        module.train()
        module.compute_terms(batch)
        image, text, negatives = module.itc.calls[-1]
        assert image.shape[0] == 6 and text.shape[0] == 6 and negatives.shape[:2] == (6, 1)  # 2B + 2B + 2B
        assert scaled_close(image, encode_image(torch.cat([batch["image"], batch["neg_image"]])), 1e-5)
        assert scaled_close(text, encode_text(torch.cat([batch["text"], batch["neg_image_text"]])), 1e-5)
        hard = torch.cat([batch["neg_text"], batch["neg_image_neg_text"]])[:, 0]
        assert scaled_close(negatives[:, 0], encode_text(hard), 1e-5)
        module.eval()  # validation: the plain loss of the samples themselves
        module.compute_terms(batch)
        image, text, negatives = module.itc.calls[-1]
        assert image.shape[0] == text.shape[0] == 3 and negatives is None


def test_hard_negatives_are_accepted_by_the_methods_that_train_on_them_only(shapes_root, tmp_path):
    from datamodules.inputs import InputError
    from lightning_modules.fit import check_inputs

    accepting = [name for name, cls in sorted(METHODS.items()) if cls.uses_hard_negatives]
    assert accepting == sorted(METHODS)  # the aligners score them in their own loss
    for name in accepting:
        masks = ["data.masks=true"] if name in NEEDS_MASKS else []  # else refused for want of its masks
        check_inputs(tiny_config(shapes_root, tmp_path, f"method.name={name}", *HARD_NEGATIVES, *masks))
    # every problem at once
    with pytest.raises(InputError,
                       match=r"(?s)captions=-1: give 0.*images=true: method tflocal .*only clip_cae, clip_ft"):
        run(tiny_config(shapes_root, tmp_path, "method.name=tflocal", "method.hard_negatives.captions=-1",
                        "method.hard_negatives.images=true"))
    assert not (tmp_path / "demo_pretrain").exists()


def test_hard_negative_images_are_refused_for_a_method_that_ignores_them(shapes_root, tmp_path):
    from datamodules.inputs import InputError

    with pytest.raises(InputError, match=r"method\.hard_negatives\.images=true: method smartclip .*clip_ft"):
        run(tiny_config(shapes_root, tmp_path, "method.name=smartclip", "method.hard_negatives.images=true"))
    assert not (tmp_path / "demo_pretrain").exists()


# ----- leakage: fit refuses to train on evaluation images ------------------------------------------------
class Started(Exception):
    """Raised in place of building the model: the start got past every check."""


@pytest.fixture
def leaky(tmp_path, monkeypatch):
    """A COCO-format training set holding 3 images of the SugarCrepe stand-in scored during training; returns
    (config overrides, the 3 shared ids). Building the model raises `Started`."""
    from evaluation.benchmarks import build_benchmark
    from testkit.standin.sugarcrepe import write_sugarcrepe

    write_sugarcrepe(tmp_path / "bench" / "sugarcrepe", n_items=14)
    shared = sorted(build_benchmark("sugarcrepe", tmp_path / "bench" / "sugarcrepe").coco_image_ids())[:3]
    ids = shared + [7, 8]
    (tmp_path / "data" / "images").mkdir(parents=True)
    (tmp_path / "data" / "train.json").write_text(json.dumps({
        "images": [{"id": i, "file_name": f"{i:012d}.jpg"} for i in ids],
        "annotations": [{"id": n, "image_id": i, "caption": "a photo"} for n, i in enumerate(ids)]}))

    def started(cfg, resuming=False):
        raise Started()

    monkeypatch.setattr("lightning_modules.fit.build_module", started)
    overrides = [f"data.root={tmp_path / 'data'}", "data.train_annotations=train.json", "data.train_images=images",
                 "data.val_annotations=null", "evaluation.benchmarks=[sugarcrepe]", "evaluation.every_n_steps=2",
                 f"evaluation.data_root={tmp_path / 'bench'}", f"runs_root={tmp_path / 'runs'}"]
    return overrides, shared


def leaky_config(overrides, *extra):
    return load_run_config([REPO_ROOT / "configs" / "demo" / "pretrain.yaml"], [*overrides, "data.masks=false", *extra])


def test_overlap_with_evaluation_benchmarks_refuses_to_start_naming_count_and_option(leaky, tmp_path):
    from evaluation.leakage import TrainingOverlapError

    overrides, _ = leaky
    with pytest.raises(TrainingOverlapError, match=r"^3 training images \(data\.train_annotations=train\.json\) are "
                       r"images of the evaluation benchmarks \(sugarcrepe: 3 of its \d+ COCO images\).*"
                       r"evaluation\.allow_train_overlap=true"):
        run(leaky_config(overrides))
    assert not (tmp_path / "runs").exists()  # refused before the run directory or the model


def test_the_refusal_on_the_command_line(leaky, tmp_path):
    from lightning_modules.fit import main

    overrides, _ = leaky
    with pytest.raises(SystemExit, match=r"^refused: 3 training images .*allow_train_overlap"):
        main(["--config", str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), *overrides, "data.masks=false"])
    assert not (tmp_path / "runs").exists()


def test_allow_train_overlap_starts_and_logs_the_overlap(leaky, caplog):
    overrides, _ = leaky
    with pytest.raises(Started), caplog.at_level("WARNING", logger="evaluation.leakage"):
        run(leaky_config(overrides, "evaluation.allow_train_overlap=true"))
    assert any("3 training images" in record.getMessage() for record in caplog.records)


def test_a_training_set_without_evaluation_images_starts(leaky, tmp_path):
    overrides, shared = leaky
    exclusions = tmp_path / "eval_ids.json"
    exclusions.write_text(json.dumps(shared))
    with pytest.raises(Started):  # data.exclude_image_ids removes them: no overlap
        run(leaky_config(overrides, f"data.exclude_image_ids={exclusions}"))
    with pytest.raises(Started):  # the benchmark is not scored during training: nothing to check
        run(leaky_config(overrides, "evaluation.every_n_steps=0"))
