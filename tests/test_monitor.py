"""The attribution-gap monitor, read back from the event files: tags and steps for every registered method, values
against an independent recomputation, the layout and hparams summary, figures with hard negatives, a frozen
backbone measured once, training untouched (modes, gradients, weights), the probe and its fallback, the builder."""
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
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from torch import nn

from core.config import REPO_ROOT
from datamodules.inputs import InputError
from datamodules.shapes import SHAPES
from evaluation.figures import LAYOUT
from fitting import method_overrides, tiny_config
from lightning_modules import load_run_config
from lightning_modules.fit import build_module, run
from lightning_modules.methods import REGISTRY
from lightning_modules.monitor import (CARD_WIDTH_PX, FIGURE_DPI, AttributionMonitor, ProbeSettings,
                                       build_attribution_monitor, build_probe, eval_mode)
from modeling.attribution import TextAttributionInputs, attribution_options, group_means, text_attribution
from parsers.scene_graph import SceneGraphParser
from parsers.token_alignment import spans_to_token_mask

MONITORED = ["attention", "gradient", "grad_eclip"]
PROBE_SIZE = 8
OVERLAYS = 2
STEPS = 4
EVERY = 2
GROUPS = ("obj", "comp", "gap", "attribute", "relation")
SMALL_ALIGNER = ["method.aligner_width=32", "method.aligner_layers=1", "method.aligner_heads=2"]
# One figure panel at the monitor's resolution; a caption and its hard negative make two, one above the other.
PANEL_PIXELS = (round(LAYOUT.min_width * FIGURE_DPI), round(LAYOUT.height * FIGURE_DPI))


def short_config(shapes_root: Path, runs_root: Path, *overrides: str):
    return tiny_config(shapes_root, runs_root, f"trainer.max_steps={STEPS}", "trainer.limit_val_batches=0",
                       "monitor.attribution.eclip_layers=2", *overrides)


def monitor_overrides() -> list:
    return [f"monitor.every_n_steps={EVERY}", f"monitor.attributions=[{','.join(MONITORED)}]",
            f"monitor.probe_size={PROBE_SIZE}", f"monitor.overlay_images={OVERLAYS}", "monitor.figures_every_n_steps=0"]


def read_events(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tb" / "version_0"),
                              size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


def hparams_columns(events) -> list:
    """The metric columns of the run's hparams summary (what TensorBoard's HPARAMS tab shows), in order."""
    content = events.PluginTagToContent("hparams")["_hparams_/experiment"]
    return [metric.name.tag for metric in hparams_metadata.parse_experiment_plugin_data(content).metric_infos]


def steps_of(events, kind: str, tag: str) -> list:
    return [event.step for event in getattr(events, kind)(tag)]


def image_size(events, tag: str) -> tuple:
    image = events.Images(tag)[-1]
    return image.width, image.height


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


NEGATIVES = ["method.hard_negatives.captions=1"]


@pytest.fixture(scope="module")
def monitored_run(shapes_root, tmp_path_factory):
    """One 4-step NegCLIP fit with the monitor every 2 steps, gradient snapshots around it and a mode recorder."""
    runs = tmp_path_factory.mktemp("monitored")
    cfg = short_config(shapes_root, runs, *NEGATIVES, *monitor_overrides())
    monitor = build_attribution_monitor(cfg)
    before, after, modes = GradSnapshot(), GradSnapshot(), TrainingModeAtEveryStep()
    # fit would add its own monitor from the config; this one sits between the gradient snapshots instead
    unmonitored = short_config(shapes_root, runs, *NEGATIVES, *monitor_overrides(), "monitor.every_n_steps=0")
    trainer = run(unmonitored, extra_callbacks=[before, monitor, after, modes])
    return dict(cfg=cfg, trainer=trainer, monitor=monitor, before=before, after=after, modes=modes.modes,
                events=read_events(runs / "demo_pretrain"), run_dir=runs / "demo_pretrain")


def test_scalars_at_step_zero_every_n_steps_and_figures_at_the_first_and_last(monitored_run):
    events = monitored_run["events"]
    for method in MONITORED:
        for name in GROUPS:
            assert steps_of(events, "Scalars", f"attr/{method}/{name}") == [0, 2, 4], (method, name)
        for name in ("obj", "comp", "gap"):
            assert steps_of(events, "Histograms", f"attr_hist/{method}/{name}") == [0, 2, 4], (method, name)
        assert steps_of(events, "Images", f"attr_boxplot/{method}") == [0, 4], method
    for k in range(OVERLAYS):
        assert steps_of(events, "Images", f"attr_overlay/{k}") == [0, 4]
    assert f"attr_overlay/{OVERLAYS}" not in events.Tags()["images"]
    histogram = events.Histograms(f"attr_hist/{MONITORED[0]}/gap")[-1].histogram_value
    assert histogram.num == int(monitored_run["monitor"].probe.valid.sum()) > 0  # one value per valid caption
    assert monitored_run["monitor"].measured_steps == [0, 2, 4]


def test_a_caption_and_its_hard_negative_are_stacked_within_the_width_of_a_tensorboard_card(monitored_run):
    """Side by side, the two panels made an image twice the card's width that TensorBoard shrank until no caption
    could be read: each text has a panel of its own, the negative below the caption, at the card's width."""
    for k in range(OVERLAYS):
        width, height = image_size(monitored_run["events"], f"attr_overlay/{k}")
        assert width <= CARD_WIDTH_PX
        assert (width, height) == (PANEL_PIXELS[0], 2 * PANEL_PIXELS[1])


def independent_probe(cfg, module):
    """Every (16 / PROBE_SIZE)-th validation pair read straight from the files, parsed, with full-length masks."""
    root = Path(cfg.data.root)
    document = json.loads((root / cfg.data.val_annotations).read_text())
    file_names = {image["id"]: image["file_name"] for image in document["images"]}
    every = len(document["annotations"]) // PROBE_SIZE
    annotations = document["annotations"][::every]
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
    run(short_config(shapes_root, tmp_path, *NEGATIVES, "monitor.every_n_steps=0"))
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
    validation = json.loads((Path(monitored_run["cfg"].data.root) / "annotations" / "captions_val.json").read_text())
    first_negatives = {a["caption"]: a["neg_captions"][0] for a in validation["annotations"]}
    assert probe.negatives == [first_negatives[caption] for caption in probe.captions]


def test_probe_falls_back_to_training_captions_spread_over_the_file_and_says_so(shapes_root, tmp_path, caplog):
    cfg = short_config(shapes_root, tmp_path, "data.val_annotations=null")
    module = build_module(cfg)
    with caplog.at_level(logging.INFO, logger="lightning_modules.monitor"):
        probe = build_probe(ProbeSettings(cfg.data, cfg.preprocess, 5), module, SceneGraphParser())
    assert probe.split == "training" and len(probe) == 5 and probe.negatives == [None] * 5
    train = json.loads((shapes_root / cfg.data.train_annotations).read_text())["annotations"]
    assert probe.captions == [train[k * 32 // 5]["caption"] for k in range(5)]  # 0, 6, 12, 19, 25 of 32
    assert "no validation split" in caplog.text and "of 5 training captions" in caplog.text


def test_builder_is_off_at_zero_and_reads_the_attribution_options(shapes_root, tmp_path):
    assert build_attribution_monitor(short_config(shapes_root, tmp_path, "monitor.every_n_steps=0")) is None
    monitor = build_attribution_monitor(short_config(shapes_root, tmp_path, *monitor_overrides()))
    assert isinstance(monitor, AttributionMonitor)
    assert monitor.attributions == MONITORED and monitor.options.eclip_layers == 2 and monitor.every_n_steps == EVERY
    with pytest.raises(KeyError, match="grad_eclip"):
        build_attribution_monitor(short_config(shapes_root, tmp_path, "monitor.every_n_steps=1",
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
    cfg = short_config(shapes_root, tmp_path, "monitor.every_n_steps=1", "monitor.attributions=[perturbation]")
    with pytest.raises(ValueError, match="data.masks=true"):
        run(cfg)


def test_a_method_on_cached_features_is_refused_when_the_probe_images_are_missing(shapes_root, tmp_path):
    cfg = short_config(shapes_root, tmp_path, "method.name=tflocal", f"data.features_cache={tmp_path / 'features'}",
                       "data.val_images=absent")
    with pytest.raises(InputError, match="data.val_images=absent.*attribution monitor"):
        run(cfg)


# ----- every registered method, with the monitor as configured --------------------------------------------
def shipped_configs() -> dict:
    """Every paper recipe (configs/*.yaml), study overlay of the registry and demo config: label -> config files."""
    configs = {f"{path.parent.name}/{path.stem}": [path] for folder in ("configs", "configs/demo")
               for path in sorted((REPO_ROOT / folder).glob("*.yaml"))}
    for name, entry in REGISTRY.items():
        configs[entry.recipe] = [REPO_ROOT / entry.recipe]
        configs[entry.study_overlay] = [REPO_ROOT / "configs/study/finetune.yaml", REPO_ROOT / entry.study_overlay]
    return configs


def test_every_paper_recipe_demo_and_study_config_keeps_the_monitor_on():
    for label, files in shipped_configs().items():
        monitor = load_run_config(files, []).monitor
        assert monitor.every_n_steps > 0 and monitor.attributions and monitor.probe_size > 0, label
        assert "attention" in monitor.attributions, label  # the one kind every comparison shares



DEFAULT_KINDS = ["attention"]  # monitor.attributions of the demo's configs, which the tiny runs load


def method_run_overrides(method: str, mask_cache: Path) -> list:
    return [*method_overrides(method, mask_cache), *(SMALL_ALIGNER if method in ("tflocal", "tfglobal") else [])]


@pytest.fixture(scope="module", params=sorted(REGISTRY))
def method_run(request, shapes_root, mask_cache, tmp_path_factory):
    """A short fit of each registered method, its monitor as the shipped config sets it (nothing overridden)."""
    runs = tmp_path_factory.mktemp(request.param)
    trainer = run(tiny_config(shapes_root, runs, *method_run_overrides(request.param, mask_cache),
                              "trainer.max_steps=3", "trainer.limit_val_batches=0"))
    monitor = next(c for c in trainer.callbacks if isinstance(c, AttributionMonitor))
    return dict(method=request.param, trainer=trainer, monitor=monitor, events=read_events(runs / "demo_pretrain"))


def test_every_registered_method_logs_the_gap_from_step_zero_to_the_last(method_run):
    """A method that stops logging the gap (the monitor switched off, a tag renamed, a step lost) fails here."""
    events, monitor = method_run["events"], method_run["monitor"]
    assert monitor.attributions == DEFAULT_KINDS and monitor.overlay_images == 1
    for kind in DEFAULT_KINDS:
        for name in GROUPS:
            assert steps_of(events, "Scalars", f"attr/{kind}/{name}") == [0, 3], (kind, name)
    for k in range(monitor.overlay_images):
        assert steps_of(events, "Images", f"attr_overlay/{k}") == [0, 3]
        assert image_size(events, f"attr_overlay/{k}") == PANEL_PIXELS  # no hard negatives: one panel


def test_every_run_writes_the_custom_scalars_layout_and_the_final_gap_into_hparams(method_run):
    events = method_run["events"]
    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}
    for kind in DEFAULT_KINDS:
        assert charts[f"{kind}: gap = A_comp - A_obj"] == [rf"^attr/{kind}/gap$"]
    hparams = events.PluginTagToContent("hparams")
    # no validation (limit_val_batches=0), no benchmarks: the final gap of the kind it monitors is the one column
    assert hparams_columns(events) == [f"attr/{kind}/gap" for kind in DEFAULT_KINDS]
    start = hparams_metadata.parse_session_start_info_plugin_data(hparams["_hparams_/session_start_info"])
    assert start.hparams["method/name"].string_value == method_run["method"]


def test_every_hparams_column_is_a_tag_the_run_logged(shapes_root, tmp_path):
    """HPARAMS fills a column with the last value of its tag: a column whose tag the run never logs stays empty (a
    kind it does not monitor, val/loss of a run without validation, benchmark scores never computed). Every column
    has values in the event files: the monitored gap, val/loss and the benchmark's headline scores, scored at the
    last step too (4 is the evaluation's cadence, 6 the end)."""
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=6", "evaluation.benchmarks=[shapes_swap]",
                    "evaluation.every_n_steps=4", f"evaluation.roots.shapes_swap={shapes_root}"))
    events = read_events(tmp_path / "demo_pretrain")
    columns, logged = hparams_columns(events), set(events.Tags()["scalars"])
    assert [tag for tag in columns if tag not in logged or not events.Scalars(tag)] == []
    assert sorted(columns) == ["attr/attention/gap", "eval/shapes_swap/group", "eval/shapes_swap/image",
                               "eval/shapes_swap/text", "val/loss"]
    assert steps_of(events, "Scalars", "eval/shapes_swap/group") == [4, 6]


def test_a_frozen_backbone_is_measured_once_and_logged_at_every_step(method_run):
    events, monitor = method_run["events"], method_run["monitor"]
    first, last = (events.Scalars("attr/attention/gap")[index].value for index in (0, -1))
    if method_run["method"] in ("tflocal", "tfglobal"):
        assert monitor.computations == 1 and first == last
    else:
        assert monitor.computations == 2 and first != last  # three steps of training moved it
