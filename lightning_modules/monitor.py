"""The attribution-gap monitor: does training move attribution from object words to composition words, and when?

On by default for every method (docs/monitoring.md). On a probe set fixed for the run (`monitor.probe_size`
captions drawn evenly over the validation annotation file, else the training file, with their images), each
configured attribution kind of modeling/attribution.py gives a per-token attribution a [N, L] of the positive pairs
(image b, caption b). Per caption, A_obj / A_comp / A_attr / A_rel are the mean attribution over its object /
composition / attribute / relation tokens, found by the scene-graph parser (read from the preprocessing cache when
the run reads it, data.masks=true; parsed once otherwise; docs/methods.md#clip-cae). It measures at step 0, every
`monitor.every_n_steps` optimizer steps and at the last step, and logs to TensorBoard at the global step:

- scalars `attr/<kind>/{obj,comp,gap,attribute,relation}`, the same tags for every method, so runs overlay;
  `gap` = mean A_comp - mean A_obj over the captions with both object and composition tokens (positive:
  composition words get more attribution); `attribute` / `relation` average over the captions that have them;
- histograms `attr_hist/<kind>/{obj,comp,gap}` of the per-caption values;
- a custom-scalars layout (TensorBoard's CUSTOM SCALARS tab): one chart per quantity and kind, every run of the
  log directory on it;
- at step 0, every `monitor.figures_every_n_steps` steps and the last step: explanation figures of the first
  `overlay_images` probe pairs, `attr_overlay/<k>` (evaluation/figures.py: the image, its Grad-ECLIP map with a
  colour bar, the caption and its token bars coloured by word kind; below it, in a panel of its own, the pair's
  hard negative when the run trains with hard negatives; at most `CARD_WIDTH_PX` wide, so that TensorBoard's image
  card shows it at its own size), and a box plot `attr_boxplot/<kind>` of the per-caption group values;
- at the end of fit, an hparams summary: the run's main settings beside its final values of the tags it logged
  (HPARAMS tab): `attr/<kind>/gap` of each monitored kind, `val/loss` when it validated, and the headline scores
  `eval/<benchmark>/<metric>` of its benchmarks (scored at the last step, callbacks.BenchmarkEvaluation).

A frozen backbone (TFLocal, TFGlobal: no CLIP parameter is trained) cannot move its gap: it is measured once and
the same values are logged at every step of the schedule, so the frozen methods appear in the comparison too.

Perturbation with `replacement=kind` draws each probe caption's replacement words once per probe position
(seeded, so every measurement uses the same ones) from the training captions' vocabulary (the module's, else
the DataModule's; data.masks=true). The figures' bars are computed as the explain command computes them (its
perturbation replaces each word by one token).

The monitor observes and never trains: every submodule runs in eval mode (each one's own mode restored
afterwards), gradients are taken with `torch.autograd.grad` only, so no parameter `.grad` changes, and it
consumes no global random state. Rank 0 computes while the other ranks wait at a barrier. It reads only what
every method has (`module.encoders`, `module.tokenizer`, `module.preprocess_val`), so it works for all.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from modeling.encoders import CLIPEncoders, TextFeatures
from datamodules.annotations import CaptionRecord, existing_path, image_path_candidates, read_annotation_file
from evaluation.explain import token_pieces
from evaluation.figures import TextPanel, explanation_figure, figure_pixels
from lightning_modules.callbacks import BenchmarkEvaluation, eval_mode
from modeling.attribution import (ATTRIBUTIONS, AttributionOptions, TextAttributionInputs, WordReplacements,
                                  attribution_options, draw_word_replacements, eos_positions, group_means,
                                  image_grad_eclip, text_attribution, token_kinds, word_end_table)
from parsers.images import read_rgb_file
from parsers.scene_graph import SceneGraph, SceneGraphParser
from parsers.token_alignment import spans_to_token_mask

log = logging.getLogger(__name__)

# Seed of the perturbation's replacement draws: the same words at every measurement.
PROBE_SEED = 0
# Probe pairs per forward (bounds memory on large probes; the results do not depend on it).
PROBE_CHUNK = 32
# Resolution of the figures logged to TensorBoard.
FIGURE_DPI = 80
# The widest figure TensorBoard's image card shows at its own size (its default card is about this wide): a wider
# one is scaled down until its text is unreadable. The explanation figures stack their panels to stay within it.
CARD_WIDTH_PX = 480
# The quantities of the custom-scalars charts: logged name -> chart title.
QUANTITIES = {"gap": "gap = A_comp - A_obj", "obj": "object words (A_obj)", "comp": "composition words (A_comp)",
              "attribute": "attribute words", "relation": "relation words"}
# Settings shown in the hparams view beside the final gap and scores: the same keys for every run, so that the
# runs of a directory form one table (TensorBoard takes the columns from one run's summary: runs compared there
# should monitor the same attribution kinds, as every shipped config does with `attention`).
HPARAM_KEYS = ("experiment", "method.name", "model.name", "model.pretrained", "seed", "optim.lr", "optim.head_lr",
               "data.batch_size", "trainer.max_steps", "method.hard_negatives.captions")


# ----- the probe set --------------------------------------------------------------------------------------
@dataclass
class Probe:
    """Fixed (image, caption) pairs and the token masks of their object / attribute / relation words.

    Token tensors end at the probe's last EOS: the text tower is causal and pools EOS, so later (padding)
    positions change no attribution, only the cost.
    """

    captions: List[str]
    images: Tensor  # [N, 3, H, W], normalised as the model expects
    ids: Tensor  # [N, L] token ids
    obj_mask: Tensor  # [N, L] bool, object (noun) tokens
    attr_mask: Tensor  # [N, L] bool, attribute tokens
    rel_mask: Tensor  # [N, L] bool, relation tokens
    split: str  # "validation", or "training" when there is no validation split
    negatives: List[Optional[str]] = field(default_factory=list)  # a hard negative per caption, when shown

    def __len__(self) -> int:
        return len(self.captions)

    @property
    def comp_mask(self) -> Tensor:
        """Composition tokens: attributes and relations (the parser's composition spans)."""
        return self.attr_mask | self.rel_mask

    @property
    def valid(self) -> Tensor:
        """[N] captions with both object and composition tokens: the only ones that enter the gap."""
        return self.obj_mask.any(dim=1) & self.comp_mask.any(dim=1)

    def token_kind_names(self, index: int) -> List[str]:
        """The word kind of each content token (positions 1..EOS-1) of caption `index`."""
        eos = int(eos_positions(self.ids[index: index + 1]))
        names = []
        for position in range(1, eos):
            kinds = [name for name, mask in (("object", self.obj_mask), ("attribute", self.attr_mask),
                                             ("relation", self.rel_mask)) if mask[index, position]]
            names.append(kinds[0] if kinds else "other")
        return names

    def describe(self) -> str:
        """One log line: how many captions enter the gap and have attributes / relations."""
        return (f"{int(self.valid.sum())} of {len(self)} {self.split} captions have object and composition "
                f"tokens and enter the gap ({int(self.attr_mask.any(1).sum())} with attributes, "
                f"{int(self.rel_mask.any(1).sum())} with relations)")


@dataclass(frozen=True)
class ProbeSource:
    """The annotation file and image folder the probe is drawn from; `split` is the preprocessing cache's name."""

    split: str  # "val" or "train"
    annotations: Path
    images: Path
    karpathy_splits: Tuple[str, ...]
    caption_field: str = "caption"

    @property
    def name(self) -> str:
        return "validation" if self.split == "val" else "training"


def probe_source(data: DictConfig) -> ProbeSource:
    """The validation split of `data`, else its training split (logged)."""
    split = "val" if data.val_annotations else "train"
    if split == "train":
        log.warning("attribution monitor: no validation split (data.val_annotations is null); the probe uses "
                    "training captions instead")
    root = Path(data.root)
    return ProbeSource(split, root / data[f"{split}_annotations"], root / data[f"{split}_images"],
                       tuple(data[f"{split}_karpathy_splits"]), data.caption_field)


def probe_rows(count: int, size: int) -> List[int]:
    """`size` record indices spread evenly over `count` records: 0, count/size, 2 count/size, ... (all when fewer).

    Evenly spaced rather than the first records, so that a file ordered by image (five COCO captions in a row)
    gives `size` different images; a fixed rule, so that every run of a comparison sees the same probe."""
    size = min(size, count)
    return [index * count // size for index in range(size)]


def probe_records(source: ProbeSource, size: int) -> List[CaptionRecord]:
    records = read_annotation_file(str(source.annotations), source.karpathy_splits, source.caption_field)
    if not records:
        raise RuntimeError(f"attribution monitor: {source.annotations} holds no {source.name} captions")
    return [records[index] for index in probe_rows(len(records), size)]


def probe_images(records: Sequence[CaptionRecord], source: ProbeSource, preprocess) -> Tensor:
    """The records' images through the validation transform, [N, 3, H, W]; a missing file is an error naming it."""
    images = []
    for record in records:
        candidates = image_path_candidates(str(source.images), record.file_name)
        path = existing_path(candidates)
        if path is None:
            raise FileNotFoundError(f"attribution monitor: the probe image {candidates[0]} of the {source.name} "
                                    f"split does not exist (set monitor.every_n_steps=0 to train without the monitor)")
        images.append(preprocess(read_rgb_file(path)))
    return torch.stack(images)


def cached_graphs(data: DictConfig, preprocess: DictConfig, source: ProbeSource,
                  records: Sequence[CaptionRecord]) -> List[SceneGraph]:
    """The records' scene graphs from the preprocessing cache the run reads (no parsing, no spaCy model)."""
    from datamodules.preprocess import mask_records  # the offline job's module: imported only when it is needed

    cached = mask_records(data, preprocess, source.split)
    return [SceneGraph.from_dict(cached[record.caption_id]["graph"]) for record in records]


def probe_graphs(data: DictConfig, preprocess: DictConfig, source: ProbeSource, records: Sequence[CaptionRecord],
                 parser: SceneGraphParser) -> List[SceneGraph]:
    """Scene graphs of the probe captions: cached when the run reads the cache (data.masks=true), else parsed."""
    if data.masks:
        return cached_graphs(data, preprocess, source, records)
    return parser.parse([record.caption for record in records])


def word_masks(captions: Sequence[str], graphs: Sequence[SceneGraph], tokenizer,
               context_length: int) -> Dict[str, Tensor]:
    """obj_mask / attr_mask / rel_mask [N, context_length] of the parsed captions, for `tokenizer`."""
    kinds = {"obj_mask": SceneGraph.object_spans, "attr_mask": SceneGraph.attribute_spans,
             "rel_mask": SceneGraph.relation_spans}
    return {name: torch.from_numpy(np.stack([spans_to_token_mask(caption, spans_of(graph), tokenizer, context_length)
                                             for caption, graph in zip(captions, graphs)]))
            for name, spans_of in kinds.items()}


def make_probe(captions: List[str], images: Tensor, ids: Tensor, tokenizer, graphs: Sequence[SceneGraph],
               split: str, negatives: Sequence[Optional[str]] = ()) -> Probe:
    """A probe from captions, their preprocessed images, token ids and scene graphs."""
    masks = word_masks(captions, graphs, tokenizer, ids.shape[1])
    length = int(eos_positions(ids).max()) + 1
    return Probe(captions, images, ids[:, :length], **{name: mask[:, :length] for name, mask in masks.items()},
                 split=split, negatives=list(negatives))


@dataclass
class ProbeSettings:
    """What the probe is built from: the run's `data` and `preprocess` sections, its size, and whether the figures
    show each pair's hard negative (the run trains with hard-negative captions)."""

    data: DictConfig
    preprocess: DictConfig
    size: int
    show_negatives: bool = False


def build_probe(settings: ProbeSettings, module: L.LightningModule, parser: SceneGraphParser) -> Probe:
    """The probe of `settings` for `module`'s tokenizer and validation transform (rank 0, once per fit)."""
    source = probe_source(settings.data)
    records = probe_records(source, settings.size)
    captions = [record.caption for record in records]
    graphs = probe_graphs(settings.data, settings.preprocess, source, records, parser)
    negatives = [record.neg_captions[0] if settings.show_negatives and record.neg_captions else None
                 for record in records]
    probe = make_probe(captions, probe_images(records, source, module.preprocess_val), module.tokenizer(captions),
                       module.tokenizer, graphs, source.name, negatives)
    log.info("attribution monitor: %s", probe.describe())
    return probe


# ----- measuring -------------------------------------------------------------------------------------------
def _chunks(count: int) -> Iterator[slice]:
    return (slice(start, start + PROBE_CHUNK) for start in range(0, count, PROBE_CHUNK))


def model_device_dtype(encoders: CLIPEncoders) -> Tuple[torch.device, torch.dtype]:
    return encoders.model.logit_scale.device, encoders.model.visual.conv1.weight.dtype


def image_embeddings(encoders: CLIPEncoders, images: Tensor) -> Tensor:
    """L2-normalised image embeddings [N, D] (constants of the text attributions), computed in chunks."""
    device, dtype = model_device_dtype(encoders)
    with torch.no_grad():
        return torch.cat([F.normalize(encoders.encode_image(images[chunk].to(device, dtype)).pooled, dim=-1)
                          for chunk in _chunks(len(images))])


def text_forward(encoders: CLIPEncoders, ids: Tensor) -> TextFeatures:
    """`encode_text(ids, attn=True)` from token embeddings that require grad.

    Gradient-based attributions differentiate through the text tower; with a frozen backbone nothing in it
    would require grad. Detaching the embeddings changes no value, only which leaves the graph has.
    """
    m = encoders.model
    embeddings = m.token_embedding(ids).to(m.transformer.get_cast_dtype()).detach().requires_grad_(True)
    return encoders.encode_text_embeddings(embeddings, ids, attn=True)


def uses_word_replacements(method: str, options: AttributionOptions) -> bool:
    return method == "perturbation" and options.replacement == "kind"


def probe_replacements(probe: Probe, chunk: slice, ids: Tensor, word_ends: Optional[Tensor],
                       options: AttributionOptions, vocabulary) -> WordReplacements:
    """The replacement words of the probe captions in `chunk`: seeded by probe position, the same at every
    measurement, so that the perturbation attribution changes with the weights only."""
    if vocabulary is None:
        raise ValueError("the monitor's perturbation with replacement=kind needs the training captions' "
                         "replacement vocabulary (data.masks=true), or monitor.attribution.replacement=token")
    kinds = token_kinds(probe.obj_mask[chunk], probe.attr_mask[chunk], probe.rel_mask[chunk]).to(ids.device)
    seeds = [(PROBE_SEED, index) for index in range(len(probe))[chunk]]
    return draw_word_replacements(ids, word_ends, kinds, vocabulary, options.num_replacements, seeds)


def probe_attribution(encoders: CLIPEncoders, probe: Probe, images: Tensor, method: str,
                      options: AttributionOptions, word_ends: Optional[Tensor] = None, vocabulary=None) -> Tensor:
    """Attribution [N, L] of `method` on the probe pairs (image b, caption b), float32 on the CPU.

    `vocabulary` (a `WordVocabulary`) is needed by perturbation with `replacement=kind` only.
    """
    parts = []
    for chunk in _chunks(len(probe)):
        ids = probe.ids[chunk].to(images.device)
        replacements = (probe_replacements(probe, chunk, ids, word_ends, options, vocabulary)
                        if uses_word_replacements(method, options) else None)
        with torch.enable_grad():
            inputs = TextAttributionInputs(encoders, ids, images[chunk], text_forward(encoders, ids), word_ends,
                                           replacements)
            parts.append(text_attribution(method, inputs, options, create_graph=False).detach().float().cpu())
    return torch.cat(parts)


def replacement_vocabulary_of(module: L.LightningModule):
    """The module's replacement vocabulary (CLIP-CAE, restored with its checkpoint), else the DataModule's."""
    vocabulary = getattr(module, "replacement_vocabulary", None)
    if vocabulary is None and getattr(module, "_trainer", None) is not None:
        vocabulary = getattr(module.trainer.datamodule, "replacement_vocabulary", None)
    return vocabulary


@dataclass
class GapSummary:
    """Per-caption group attributions [N] of one method on the probe, and which captions have each group."""

    obj: Tensor  # A_obj
    comp: Tensor  # A_comp
    attribute: Tensor  # A_attr
    relation: Tensor  # A_rel
    has_obj: Tensor
    has_attribute: Tensor
    has_relation: Tensor
    valid: Tensor  # object and composition tokens: the captions of the gap

    @property
    def gap(self) -> Tensor:
        """A_comp - A_obj per valid caption."""
        return (self.comp - self.obj)[self.valid]

    def histograms(self) -> Dict[str, Tensor]:
        return {"obj": self.obj[self.valid], "comp": self.comp[self.valid], "gap": self.gap}

    def scalars(self) -> Dict[str, float]:
        """Means over the captions that have the group; a group no caption has is left out."""
        groups = {**self.histograms(), "attribute": self.attribute[self.has_attribute],
                  "relation": self.relation[self.has_relation]}
        return {name: float(values.mean()) for name, values in groups.items() if len(values)}

    def box_groups(self) -> Dict[str, Tensor]:
        return {"object": self.obj[self.has_obj], "attribute": self.attribute[self.has_attribute],
                "relation": self.relation[self.has_relation]}


def summarise(attribution: Tensor, probe: Probe) -> GapSummary:
    """Group means of an attribution [N, L] over the probe's object / composition / attribute / relation tokens."""
    obj, has_obj = group_means(attribution, probe.obj_mask)
    comp, _ = group_means(attribution, probe.comp_mask)
    attribute, has_attribute = group_means(attribution, probe.attr_mask)
    relation, has_relation = group_means(attribution, probe.rel_mask)
    return GapSummary(obj, comp, attribute, relation, has_obj, has_attribute, has_relation, probe.valid)


# ----- figures ---------------------------------------------------------------------------------------------
def denormalise(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Model-normalised images back to RGB in [0, 1]."""
    shape = (1, -1, 1, 1)
    return (images.float() * torch.tensor(std).view(shape) + torch.tensor(mean).view(shape)).clamp(0, 1)


@dataclass
class PairExplanation:
    """What a figure panel needs of one (image, text) pair, as the explain command computes it."""

    similarity: float
    attributions: List[float]  # content tokens 1..EOS-1
    token_ids: List[int]
    heat_map: np.ndarray  # [H, W] in 0..1


def explain_pairs(encoders: CLIPEncoders, images: Tensor, ids: Tensor, method: str, options: AttributionOptions,
                  word_ends: Optional[Tensor]) -> List[PairExplanation]:
    """Similarity, text attribution and Grad-ECLIP image map of the pairs (image b, text b)."""
    device, dtype = model_device_dtype(encoders)
    images, ids = images.to(device, dtype), ids.to(device)
    with torch.enable_grad():
        # An input that requires grad keeps the graph even when the backbone is frozen.
        text = text_forward(encoders, ids)
        with torch.no_grad():
            image = F.normalize(encoders.encode_image(images).pooled, dim=-1)
        inputs = TextAttributionInputs(encoders, ids, image, text, word_ends)
        attribution = text_attribution(method, inputs, options).detach().float().cpu()
        heat = image_grad_eclip(encoders, images.detach().requires_grad_(True), text.pooled.detach(),
                                heads=options.heads).detach().float().cpu()
    similarity, eos = inputs.target.detach().float().cpu(), eos_positions(ids).cpu()
    return [PairExplanation(float(similarity[b]), attribution[b, 1: int(eos[b])].tolist(),
                            ids[b, 1: int(eos[b])].tolist(), heat[b].numpy()) for b in range(len(ids))]


def overlay_method(attributions: Sequence[str]) -> str:
    """The text attribution the figures show: the first monitored kind that needs no training vocabulary."""
    return next((name for name in attributions if name != "perturbation"), attributions[0])


def overlay_figures(module: L.LightningModule, probe: Probe, count: int, method: str, options: AttributionOptions,
                    word_ends: Optional[Tensor]) -> List[np.ndarray]:
    """Explanation figures [H, W, 3] of the first `count` probe pairs: the caption, and below it its hard negative
    when the probe has one, each text in a panel of its own, at most `CARD_WIDTH_PX` wide."""
    count = min(count, len(probe))
    texts = probe.captions[:count] + [negative for negative in probe.negatives[:count] if negative]
    owners = list(range(count)) + [k for k, negative in enumerate(probe.negatives[:count]) if negative]
    options = dataclasses.replace(options, replacement="token")  # as the explain command
    pairs = explain_pairs(module.encoders, probe.images[owners], module.tokenizer(texts), method, options, word_ends)
    preprocess = module.clip.visual.preprocess_cfg
    shown = denormalise(probe.images[:count], preprocess["mean"], preprocess["std"]).permute(0, 2, 3, 1).numpy()
    rows: List[List[TextPanel]] = [[] for _ in range(count)]
    for position, (owner, text, pair) in enumerate(zip(owners, texts, pairs)):
        is_caption = position < count
        rows[owner].append(TextPanel(text, pair.similarity, token_pieces(module.tokenizer, pair.token_ids),
                                     pair.attributions, pair.heat_map,
                                     kinds=probe.token_kind_names(owner) if is_caption else None,
                                     label="caption" if is_caption else "hard negative"))
    return [figure_pixels(explanation_figure(shown[k], [[panel] for panel in rows[k]], method, options.heads,
                                             dpi=FIGURE_DPI, max_width=CARD_WIDTH_PX / FIGURE_DPI))
            for k in range(count)]


def box_plot(method: str, summary: GapSummary) -> Figure:
    """Per-caption object / attribute / relation attribution as a box plot (Agg figure, no pyplot state)."""
    groups = {name: values.numpy() for name, values in summary.box_groups().items() if len(values)}
    figure = Figure(figsize=(4, 3), dpi=FIGURE_DPI)
    axes = figure.add_subplot()
    if groups:
        axes.boxplot(list(groups.values()))
        axes.set_xticks(range(1, len(groups) + 1), list(groups))
    axes.set_title(f"{method}: per-caption attribution")
    axes.set_ylabel("mean over the group's tokens")
    figure.tight_layout()
    return figure


# ----- TensorBoard ----------------------------------------------------------------------------------------
def gap_layout(attributions: Sequence[str]) -> Dict[str, Dict[str, list]]:
    """The custom-scalars layout (`SummaryWriter.add_custom_scalars`): a category per attribution kind, a multi-line
    chart per quantity, on which every run of the log directory is a line. The same charts for the same kinds, so
    the layouts of many runs merge into one."""
    return {f"attribution gap: {method}": {f"{method}: {title}": ["Multiline", [rf"^attr/{method}/{name}$"]]
                                           for name, title in QUANTITIES.items()}
            for method in attributions}


def tensorboard_writer(trainer: L.Trainer):
    """The SummaryWriter of the run's TensorBoard logger, or None (no logger, or another kind)."""
    writer = getattr(trainer.logger, "experiment", None) if trainer.logger is not None else None
    return writer if hasattr(writer, "add_custom_scalars") else None


def hparam_values(config: dict) -> Dict[str, object]:
    """`HPARAM_KEYS` of the run's config, as the hparams plugin takes them (None and lists as text)."""
    config, values = OmegaConf.create(config), {}
    for key in HPARAM_KEYS:
        value = OmegaConf.select(config, key, default=None)
        values[key.replace(".", "/")] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return values


def score_tags(trainer: L.Trainer) -> List[str]:
    """The run's scores that this fit logged: `val/loss` when a validation ran (a run without validation,
    `trainer.limit_val_batches: 0`, has none) and the headline scores of the benchmarks' last evaluation (at the
    last step when the schedule finished)."""
    tags = ["val/loss"] if "val/loss" in trainer.callback_metrics else []
    for callback in trainer.callbacks:
        if isinstance(callback, BenchmarkEvaluation) and callback.last_results:
            tags += callback.headline_tags()
    return tags


def write_hparams(writer, config: dict, metric_tags: Sequence[str]) -> None:
    """The hparams summary: settings, and metric columns that TensorBoard fills with each tag's last value."""
    from torch.utils.tensorboard.summary import hparams

    experiment, start, end = hparams(hparam_values(config), {tag: 0.0 for tag in metric_tags})
    file_writer = writer._get_file_writer()  # as Lightning's log_hyperparams: the run's own event file
    for summary in (experiment, start, end):
        file_writer.add_summary(summary)
    writer.flush()


@dataclass
class Measurement:
    """One measurement's results: the group summaries per kind, and the figures when they were drawn."""

    summaries: Dict[str, GapSummary]
    figures: Optional[List[np.ndarray]] = None


# ----- the callback ---------------------------------------------------------------------------------------
class AttributionMonitor(L.Callback):
    """Logs the attribution gap of `attributions` on a fixed probe over training (see the module doc).

    Args:
        every_n_steps: measure at step 0, after every N-th optimizer step and at the last step (> 0).
        attributions: keys of `attribution.ATTRIBUTIONS`.
        options: attribution options (`monitor.attribution`).
        probe: where the probe comes from and its size.
        overlay_images: explanation figures of the first K probe pairs (0 = none).
        figures_every_n_steps: draw the figures and box plots every N steps, besides steps 0 and last (0: only
            those two).
        parser: the scene-graph parser for probe captions not in the preprocessing cache.

    Attributes:
        probe: the probe (rank 0, from `on_fit_start`).
        last_results: kind -> `GapSummary` of the latest measurement.
        measured_steps: the steps measured in this fit, in order.
        computations: how many measurements computed attributions (a frozen backbone computes once).
        seconds: the monitor's own wall time on rank 0 (probe, measurements, figures, logging), for perf.monitor.
    """

    def __init__(self, every_n_steps: int, attributions: Sequence[str], options: AttributionOptions,
                 probe: ProbeSettings, overlay_images: int = 0, figures_every_n_steps: int = 0,
                 parser: Optional[SceneGraphParser] = None):
        if every_n_steps <= 0 or probe.size <= 0 or figures_every_n_steps < 0 or overlay_images < 0:
            raise ValueError(f"monitor.every_n_steps ({every_n_steps}) and monitor.probe_size ({probe.size}) must be "
                             f"positive, monitor.figures_every_n_steps ({figures_every_n_steps}) and "
                             f"monitor.overlay_images ({overlay_images}) not negative")
        unknown = [name for name in attributions if name not in ATTRIBUTIONS]
        if unknown or not attributions:
            raise KeyError(f"monitor.attributions: unknown {unknown or 'none given'}; registered: "
                           f"{', '.join(ATTRIBUTIONS)}")
        self.every_n_steps = every_n_steps
        self.attributions = list(attributions)
        self.options = options
        self.probe_settings = probe
        self.overlay_images = overlay_images
        self.figures_every_n_steps = figures_every_n_steps
        self.parser = parser or SceneGraphParser()
        self.probe: Optional[Probe] = None
        self.last_results: Dict[str, GapSummary] = {}
        self.measured_steps: List[int] = []
        self.computations = 0
        self.seconds = 0.0
        self._frozen: Optional[Measurement] = None
        self._word_ends: Optional[Tensor] = None
        self._figured_step = -1

    # ----- the schedule ----------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        needs_vocabulary = any(uses_word_replacements(method, self.options) for method in self.attributions)
        if needs_vocabulary and replacement_vocabulary_of(module) is None:
            raise ValueError("monitor.attributions has perturbation with monitor.attribution.replacement=kind, which "
                             "draws words from the training captions' vocabulary: set data.masks=true, or "
                             "monitor.attribution.replacement=token")
        if trainer.is_global_zero and self.probe is None and not trainer.fast_dev_run:
            start = time.perf_counter()
            self.probe = build_probe(self.probe_settings, module, self.parser)
            self._word_ends = word_end_table(module.tokenizer, module.clip.token_embedding.num_embeddings)
            self.seconds += time.perf_counter() - start

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        writer = tensorboard_writer(trainer)
        if trainer.is_global_zero and writer is not None:
            writer.add_custom_scalars(gap_layout(self.attributions))
        if trainer.global_step == 0:  # the curves start from the weights training starts from
            self._log_step(trainer, module, figures=True)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        # With gradient accumulation this hook runs on every micro-batch of a step: measure each step once.
        if trainer.sanity_checking or step == 0 or step % self.every_n_steps or self._measured(step):
            return
        self._log_step(trainer, module, figures=bool(self.figures_every_n_steps)
                       and step % self.figures_every_n_steps == 0)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """The last step always has its point and its figures, whatever the schedule."""
        step = trainer.global_step
        if not self._measured(step) or self._figured_step != step:
            self._log_step(trainer, module, figures=True)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.measured_steps:
            log.info("attribution monitor: %d measurements (steps %s), %.1f s in all", len(self.measured_steps),
                     ", ".join(map(str, self.measured_steps)), self.seconds)
        writer = tensorboard_writer(trainer)
        if trainer.is_global_zero and writer is not None and self.last_results:
            write_hparams(writer, module.hparams.get("config", {}), self.gap_tags() + score_tags(trainer))

    def gap_tags(self) -> List[str]:
        """`attr/<kind>/gap` of the monitored kinds whose last measurement has a gap: the hparams columns name only
        tags that the run logs (a column of a kind it does not measure would stay empty)."""
        return [f"attr/{method}/gap" for method, summary in self.last_results.items() if "gap" in summary.scalars()]

    def _measured(self, step: int) -> bool:
        return bool(self.measured_steps) and self.measured_steps[-1] == step

    def _log_step(self, trainer: L.Trainer, module: L.LightningModule, figures: bool) -> None:
        if trainer.fast_dev_run:
            return
        step = trainer.global_step
        if trainer.is_global_zero:
            start = time.perf_counter()
            measurement = self._measurement(module, figures and self.overlay_images > 0)
            self.last_results = measurement.summaries
            log_measurement(trainer, measurement, step, scalars=not self._measured(step), figures=figures)
            self.seconds += time.perf_counter() - start
        if not self._measured(step):
            self.measured_steps.append(step)
        self._figured_step = step if figures else self._figured_step
        trainer.strategy.barrier("attribution_monitor")

    # ----- measuring -------------------------------------------------------------------------------------
    def _measurement(self, module: L.LightningModule, with_figures: bool) -> Measurement:
        """This step's measurement; a frozen backbone's first one again (computing the figures once if missing)."""
        frozen = backbone_is_frozen(module)
        if frozen and self._frozen is not None and (self._frozen.figures is not None or not with_figures):
            return self._frozen
        summaries = self._frozen.summaries if frozen and self._frozen is not None else self.measure(module)
        measurement = Measurement(summaries, self.overlays(module) if with_figures else None)
        self._frozen = measurement if frozen else None
        return measurement

    def measure(self, module: L.LightningModule) -> Dict[str, GapSummary]:
        """Group attributions of every configured kind on the probe, with the module's current weights."""
        self.computations += 1
        with eval_mode(module):
            images = image_embeddings(module.encoders, self.probe.images)
            vocabulary = replacement_vocabulary_of(module)
            return {method: summarise(probe_attribution(module.encoders, self.probe, images, method, self.options,
                                                        self._word_ends, vocabulary), self.probe)
                    for method in self.attributions}

    def overlays(self, module: L.LightningModule) -> List[np.ndarray]:
        """Explanation figures [H, W, 3] of the first `overlay_images` probe pairs."""
        with eval_mode(module):
            return overlay_figures(module, self.probe, self.overlay_images, overlay_method(self.attributions),
                                   self.options, self._word_ends)


def backbone_is_frozen(module: L.LightningModule) -> bool:
    """No CLIP parameter is trained (TFLocal, TFGlobal): the backbone's attribution cannot change."""
    return not any(parameter.requires_grad for parameter in module.clip.parameters())


def log_measurement(trainer: L.Trainer, measurement: Measurement, step: int, scalars: bool, figures: bool) -> None:
    """Scalars (and histograms) of a measurement; its figures and box plots when `figures`."""
    if trainer.logger is None:
        return
    if scalars:
        trainer.logger.log_metrics({f"attr/{method}/{name}": value
                                    for method, summary in measurement.summaries.items()
                                    for name, value in summary.scalars().items()}, step=step)
    writer = tensorboard_writer(trainer)
    if writer is None:  # not TensorBoard: the scalars above are all it can take
        return
    if scalars:
        log_histograms(writer, measurement.summaries, step)
    if figures:
        for method, summary in measurement.summaries.items():
            writer.add_image(f"attr_boxplot/{method}", figure_pixels(box_plot(method, summary)), step,
                             dataformats="HWC")
        for k, pixels in enumerate(measurement.figures or []):
            writer.add_image(f"attr_overlay/{k}", pixels, step, dataformats="HWC")


def log_histograms(writer, summaries: Dict[str, GapSummary], step: int) -> None:
    for method, summary in summaries.items():
        for name, values in summary.histograms().items():
            if len(values):
                writer.add_histogram(f"attr_hist/{method}/{name}", values, step)


def build_attribution_monitor(cfg: DictConfig) -> Optional[AttributionMonitor]:
    """The monitor of `cfg.monitor`, or None when it is off (`every_n_steps: 0`)."""
    monitor = cfg.monitor
    if not monitor.every_n_steps:
        return None
    parser = SceneGraphParser(cfg.preprocess.parser_model, cfg.preprocess.parser_batch_size)
    probe = ProbeSettings(cfg.data, cfg.preprocess, monitor.probe_size, cfg.method.hard_negatives.captions > 0)
    return AttributionMonitor(monitor.every_n_steps, list(monitor.attributions),
                              attribution_options(monitor.attribution), probe, monitor.overlay_images,
                              monitor.figures_every_n_steps, parser)
