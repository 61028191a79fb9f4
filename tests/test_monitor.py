"""The attribution-gap monitor: TensorBoard tags and steps, values against an independent recomputation,
training untouched (modes, gradients, weights), the probe and its fallback, the builder."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from core.config import REPO_ROOT
from lightning_modules import load_run_config
from datamodules.shapes import SHAPES, generate
from modeling.attribution import (TextAttributionInputs, attribution_options, group_means,
                                                   text_attribution)
from lightning_modules.monitor import AttributionMonitor, build_attribution_monitor, build_probe, eval_mode
from lightning_modules.fit import build_datamodule, build_module, run
from parsers.scene_graph import SceneGraphParser
from parsers.token_alignment import spans_to_token_mask

TINY = "ViT-Tiny-16-64"
MONITORED = ["attention", "gradient", "grad_eclip"]
PROBE_SIZE = 8
OVERLAYS = 2
STEPS = 4
EVERY = 2
GROUPS = ("obj", "comp", "gap", "attribute", "relation")


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    generate(root, n_train=16, n_val=8, image_size=64, seed=0)  # 2 captions per image
    return root


def tiny_config(shapes_root: Path, runs_root: Path, *overrides: str):
    return load_run_config([REPO_ROOT / "configs" / "demo" / "pretrain.yaml"], [
        f"model.name={TINY}", f"data.root={shapes_root}", f"runs_root={runs_root}", "data.batch_size=8",
        "data.num_workers=0", "trainer.enable_progress_bar=false", "optim.warmup_steps=2", "optim.lr=1e-3",
        "trainer.log_every_n_steps=1", "data.masks=false", f"trainer.max_steps={STEPS}",
        "trainer.limit_val_batches=0", "monitor.attribution.eclip_layers=2", *overrides])


def monitor_overrides() -> list:
    return [f"monitor.every_n_steps={EVERY}", f"monitor.attributions=[{','.join(MONITORED)}]",
            f"monitor.probe_size={PROBE_SIZE}", f"monitor.overlay_images={OVERLAYS}"]


class GradSnapshot(L.Callback):
    """Copies of every parameter's .grad after each training batch (placed before / after the monitor)."""

    def __init__(self):
        self.grads = []

    def on_train_batch_end(self, trainer, module, *args) -> None:
        self.grads.append({name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()})


class TrainingModeAtEveryStep(L.Callback):
    def __init__(self):
        self.modes = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.modes.append(all(m.training for m in module.modules()))


@pytest.fixture(scope="module")
def monitored_run(shapes_root, tmp_path_factory):
    """One 4-step fit with the monitor every 2 steps, gradient snapshots around it and a mode recorder."""
    runs = tmp_path_factory.mktemp("monitored")
    cfg = tiny_config(shapes_root, runs, *monitor_overrides())
    monitor = build_attribution_monitor(cfg)
    before, after, modes = GradSnapshot(), GradSnapshot(), TrainingModeAtEveryStep()
    # fit would add its own monitor from the config; this one sits between the gradient snapshots instead
    unmonitored = tiny_config(shapes_root, runs, *monitor_overrides(), "monitor.every_n_steps=0")
    trainer = run(unmonitored, extra_callbacks=[before, monitor, after, modes])
    events = EventAccumulator(str(runs / "demo_pretrain" / "tb" / "version_0"),
                              size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    events.Reload()
    return dict(cfg=cfg, trainer=trainer, monitor=monitor, before=before, after=after, modes=modes.modes,
                events=events, run_dir=runs / "demo_pretrain")


def steps_of(events, kind: str, tag: str) -> list:
    return [event.step for event in getattr(events, kind)(tag)]


def test_every_summary_is_logged_at_the_monitored_steps(monitored_run):
    events = monitored_run["events"]
    for method in MONITORED:
        for name in GROUPS:
            assert steps_of(events, "Scalars", f"attr/{method}/{name}") == [2, 4], (method, name)
        for name in ("obj", "comp", "gap"):
            assert steps_of(events, "Histograms", f"attr_hist/{method}/{name}") == [2, 4], (method, name)
        assert steps_of(events, "Images", f"attr_boxplot/{method}") == [2, 4], method
    for k in range(OVERLAYS):
        assert steps_of(events, "Images", f"gradeclip/{k}") == [2, 4]
        image = events.Images(f"gradeclip/{k}")[-1]
        assert (image.width, image.height) == (64, 64)
    assert f"gradeclip/{OVERLAYS}" not in events.Tags()["images"]
    histogram = events.Histograms(f"attr_hist/{MONITORED[0]}/gap")[-1].histogram_value
    assert histogram.num == int(monitored_run["monitor"].probe.valid.sum()) > 0  # one value per valid caption


def independent_probe(cfg, module):
    """The first PROBE_SIZE validation pairs read straight from the files, parsed, with full-length masks."""
    root = Path(cfg.data.root)
    document = json.loads((root / cfg.data.val_annotations).read_text())
    file_names = {image["id"]: image["file_name"] for image in document["images"]}
    annotations = document["annotations"][:PROBE_SIZE]
    captions = [a["caption"] for a in annotations]
    images = torch.stack([module.preprocess_val(Image.open(root / cfg.data.val_images / file_names[a["image_id"]])
                                                .convert("RGB")) for a in annotations])
    graphs = SceneGraphParser().parse(captions)

    def masks(spans_of):
        return torch.stack([torch.from_numpy(spans_to_token_mask(c, spans_of(g), module.tokenizer))
                            for c, g in zip(captions, graphs)])

    obj, attr, rel = masks(lambda g: g.object_spans()), masks(lambda g: g.attribute_spans()), \
        masks(lambda g: g.relation_spans())
    return captions, images, module.tokenizer(captions), obj, attr, rel


def reference_scalars(module, cfg, method: str) -> dict:
    captions, images, ids, obj, attr, rel = independent_probe(cfg, module)
    comp = attr | rel
    encoders = module.encoders
    with torch.no_grad():
        image = F.normalize(encoders.encode_image(images).pooled, dim=-1)
    inputs = TextAttributionInputs(encoders, ids, image, encoders.encode_text(ids, attn=True))
    a = text_attribution(method, inputs, attribution_options(cfg.monitor.attribution)).detach()
    values = {name: group_means(a, mask)[0] for name, mask in (("obj", obj), ("comp", comp), ("attr", attr),
                                                               ("rel", rel))}
    valid = obj.any(1) & comp.any(1)
    assert valid.any()
    return {"obj": values["obj"][valid].mean(), "comp": values["comp"][valid].mean(),
            "gap": (values["comp"] - values["obj"])[valid].mean(), "attribute": values["attr"][attr.any(1)].mean(),
            "relation": values["rel"][rel.any(1)].mean()}


@pytest.mark.parametrize("method", MONITORED)
def test_logged_values_equal_an_independent_recomputation_with_the_final_weights(monitored_run, method):
    module = monitored_run["trainer"].lightning_module.eval()
    expected = reference_scalars(module, monitored_run["cfg"], method)
    # float32 attributions of another batch (~1e-6 relative, 7e-7 seen); the gap comp - obj may be near 0 and
    # rounds like its terms, hence an atol of rtol times the largest mean
    scale = max(abs(float(value)) for value in expected.values())
    for name, value in expected.items():
        logged = monitored_run["events"].Scalars(f"attr/{method}/{name}")[-1]
        assert logged.step == STEPS
        assert logged.value == pytest.approx(float(value), rel=1e-5, abs=1e-5 * scale), name
    gap = expected["comp"] - expected["obj"]
    # the sign convention: comp - obj (a mean of differences against a difference of means)
    assert float(expected["gap"]) == pytest.approx(float(gap), rel=1e-5, abs=1e-5 * scale)


def test_training_mode_at_every_batch_start_and_no_gradient_touched(monitored_run):
    assert monitored_run["modes"] == [True] * STEPS
    before, after = monitored_run["before"].grads, monitored_run["after"].grads
    assert len(before) == len(after) == STEPS
    for step_before, step_after in zip(before, after):
        assert any(grad is not None for grad in step_before.values())  # there are gradients to disturb
        for name, grad in step_before.items():
            if grad is None:
                assert step_after[name] is None, name
            else:
                assert torch.equal(grad, step_after[name]), name


def test_weights_after_training_are_identical_with_and_without_the_monitor(monitored_run, shapes_root, tmp_path):
    run(tiny_config(shapes_root, tmp_path))
    plain = torch.load(tmp_path / "demo_pretrain" / "export" / "open_clip.pt")
    monitored = torch.load(monitored_run["run_dir"] / "export" / "open_clip.pt")
    for key in plain:
        assert torch.equal(plain[key], monitored[key]), key


def test_probe_masks_mark_shape_nouns_and_colour_attributes(monitored_run):
    probe, tokenizer = monitored_run["monitor"].probe, monitored_run["trainer"].lightning_module.tokenizer
    assert probe.split == "validation" and len(probe) == PROBE_SIZE
    words = lambda mask: {tokenizer.decoder[int(i)].removesuffix("</w>") for i in probe.ids[mask]}  # noqa: E731
    assert set(SHAPES) & words(probe.obj_mask) and words(probe.obj_mask) <= set(SHAPES) | {"image", "picture"}
    assert {"red", "blue", "large"} <= words(probe.attr_mask)
    assert not probe.obj_mask[:, 0].any() and probe.ids.shape[1] < 77  # no SOT; cut after the last EOS


def test_probe_falls_back_to_training_captions_and_says_so(shapes_root, tmp_path, caplog):
    cfg = tiny_config(shapes_root, tmp_path, "data.val_annotations=null")
    module = build_module(cfg)
    datamodule = build_datamodule(cfg, module)
    datamodule.setup("fit")
    with caplog.at_level(logging.INFO, logger="lightning_modules.monitor"):
        probe = build_probe(datamodule, module.tokenizer, 5, SceneGraphParser())
    assert probe.split == "training" and len(probe) == 5
    train = json.loads((shapes_root / cfg.data.train_annotations).read_text())["annotations"]
    assert probe.captions == [a["caption"] for a in train[:5]]
    assert "no validation split" in caplog.text and "of 5 training captions" in caplog.text


def test_builder_is_off_at_zero_and_reads_the_attribution_options(shapes_root, tmp_path):
    assert build_attribution_monitor(tiny_config(shapes_root, tmp_path, "monitor.every_n_steps=0")) is None
    monitor = build_attribution_monitor(tiny_config(shapes_root, tmp_path, *monitor_overrides()))
    assert isinstance(monitor, AttributionMonitor)
    assert monitor.attributions == MONITORED and monitor.options.eclip_layers == 2 and monitor.every_n_steps == EVERY
    with pytest.raises(KeyError, match="grad_eclip"):
        build_attribution_monitor(tiny_config(shapes_root, tmp_path, "monitor.every_n_steps=1",
                                              "monitor.attributions=[atention]"))


def test_eval_mode_restores_each_submodule_own_mode():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)).train()
    model[0].eval()  # e.g. a frozen backbone its method keeps in eval mode
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert model.training and model[1].training and not model[0].training


def test_kind_perturbation_without_the_training_vocabulary_is_refused(shapes_root, tmp_path):
    """The paper's perturbation draws replacement words from the training captions (data.masks=true): without
    them the monitor refuses at the start instead of measuring something else."""
    cfg = tiny_config(shapes_root, tmp_path, "monitor.every_n_steps=1", "monitor.attributions=[perturbation]")
    with pytest.raises(ValueError, match="data.masks=true"):
        run(cfg)
