"""The attribution-gap monitor: does training move attribution from object words to composition words?

Every `monitor.every_n_steps` optimizer steps, on a probe set fixed for the run (the first `probe_size`
validation captions and their images), each configured attribution method of `library.py` gives a
per-token attribution a [N, L] of the positive pairs (image b, caption b). Per caption, A_obj / A_comp /
A_attr / A_rel are the mean attribution over its object / composition / attribute / relation tokens, found
by the scene-graph parser (docs/methods.md#clip-cae). Logged to TensorBoard at the global step:

- scalars `attr/<method>/{obj,comp,gap,attribute,relation}`; `gap` = mean A_comp - mean A_obj over the
  captions with both object and composition tokens (positive: composition words get more attribution);
  `attribute` / `relation` average over the captions that have such tokens;
- histograms `attr_hist/<method>/{obj,comp,gap}` of the per-caption values;
- a box plot `attr_boxplot/<method>` of per-caption object / attribute / relation attribution;
- Grad-ECLIP heat maps of the first `overlay_images` pairs over their images, `gradeclip/<k>`, with the
  caption as the text `gradeclip/<k>/caption`.

Perturbation with `replacement=kind` draws each probe caption's replacement words once per probe position
(seeded, so every measurement uses the same ones) from the training captions' vocabulary (the module's, else
the DataModule's; data.masks=true).

The monitor observes and never trains: every submodule runs in eval mode (each one's own mode restored
afterwards), gradients are taken with `torch.autograd.grad` only, so no parameter `.grad` changes, and it
consumes no global random state. Rank 0 computes while the other ranks wait at a barrier. It reads only what
every method has (`module.encoders`, `module.tokenizer`, the datamodule's splits), so it works for all.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib import colormaps
from matplotlib.figure import Figure
from omegaconf import DictConfig
from torch import Tensor

from core.encoders import CLIPEncoders, TextFeatures
from datamodules.annotations import read_annotation_file
from datamodules.coco import CocoCaptions
from modeling.attribution import (ATTRIBUTIONS, AttributionOptions, TextAttributionInputs,
                                                   WordReplacements, attribution_options, draw_word_replacements,
                                                   eos_positions, group_means, image_grad_eclip, text_attribution,
                                                   token_kinds, word_end_table)
from lightning_modules.callbacks import eval_mode
from parsers.scene_graph import SceneGraph, SceneGraphParser
from parsers.token_alignment import spans_to_token_mask

log = logging.getLogger(__name__)

# Augmentation seed of the probe samples: a training split (the fallback) may augment; a fixed seed makes the
# probe the same at every measurement, and the dataset seeds a forked RNG, leaving the global one untouched.
PROBE_SEED = 0
# Probe pairs per forward (bounds memory on large probes; the results do not depend on it).
PROBE_CHUNK = 32
# Weight of the heat map's colour in the overlay.
OVERLAY_ALPHA = 0.5
OVERLAY_COLORMAP = "jet"


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

    def describe(self) -> str:
        """One log line: how many captions enter the gap and have attributes / relations."""
        return (f"{int(self.valid.sum())} of {len(self)} {self.split} captions have object and composition "
                f"tokens and enter the gap ({int(self.attr_mask.any(1).sum())} with attributes, "
                f"{int(self.rel_mask.any(1).sum())} with relations)")


def probe_split(datamodule) -> Tuple[CocoCaptions, str, Sequence[str]]:
    """(dataset, split name, its Karpathy splits): the validation split, else the training split (logged)."""
    if getattr(datamodule, "val_dataset", None) is not None:
        return datamodule.val_dataset, "validation", datamodule.data.val_karpathy_splits
    if getattr(datamodule, "train_dataset", None) is None:
        raise RuntimeError("the attribution monitor needs a set-up CocoDataModule (trainer.fit(..., datamodule=))")
    log.warning("attribution monitor: no validation split (data.val_annotations is null); the probe uses the "
                "first training captions instead")
    return datamodule.train_dataset, "training", datamodule.data.train_karpathy_splits


def caption_texts(annotations: str, karpathy_splits: Sequence[str], caption_ids: Sequence[int]) -> List[str]:
    """The raw captions of `caption_ids`, re-read from the split's annotation file (the dataset keeps tokens)."""
    by_id = {record.caption_id: record.caption for record in read_annotation_file(annotations, tuple(karpathy_splits))}
    return [by_id[caption_id] for caption_id in caption_ids]


def word_masks(captions: Sequence[str], graphs: Sequence[SceneGraph], tokenizer,
               context_length: int) -> Dict[str, Tensor]:
    """obj_mask / attr_mask / rel_mask [N, context_length] of the parsed captions, for `tokenizer`."""
    kinds = {"obj_mask": SceneGraph.object_spans, "attr_mask": SceneGraph.attribute_spans,
             "rel_mask": SceneGraph.relation_spans}
    return {name: torch.from_numpy(np.stack([spans_to_token_mask(caption, spans_of(graph), tokenizer, context_length)
                                             for caption, graph in zip(captions, graphs)]))
            for name, spans_of in kinds.items()}


def build_probe(datamodule, tokenizer, probe_size: int, parser: SceneGraphParser) -> Probe:
    """The first `probe_size` pairs of the validation split (or training split), parsed once."""
    dataset, split, karpathy_splits = probe_split(datamodule)
    samples = [dataset[(index, PROBE_SEED)] for index in range(min(probe_size, len(dataset)))]
    if not samples:
        raise RuntimeError(f"attribution monitor: the {split} split is empty")
    captions = caption_texts(dataset.annotations, karpathy_splits, [s["caption_id"] for s in samples])
    probe = make_probe(captions, torch.stack([s["image"] for s in samples]), torch.stack([s["text"] for s in samples]),
                       tokenizer, parser, split)
    log.info("attribution monitor: %s", probe.describe())
    return probe


def make_probe(captions: List[str], images: Tensor, ids: Tensor, tokenizer, parser: SceneGraphParser,
               split: str) -> Probe:
    """A probe from captions, their preprocessed images and token ids; the captions are parsed here."""
    masks = word_masks(captions, parser.parse(captions), tokenizer, ids.shape[1])
    length = int(eos_positions(ids).max()) + 1
    return Probe(captions, images, ids[:, :length], **{name: mask[:, :length] for name, mask in masks.items()},
                 split=split)


# ----- measuring -------------------------------------------------------------------------------------------
def _chunks(count: int) -> Iterator[slice]:
    return (slice(start, start + PROBE_CHUNK) for start in range(0, count, PROBE_CHUNK))


def image_embeddings(encoders: CLIPEncoders, images: Tensor) -> Tensor:
    """L2-normalised image embeddings [N, D] (constants of the text attributions), computed in chunks."""
    device, dtype = encoders.model.logit_scale.device, encoders.model.visual.conv1.weight.dtype
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


def gradeclip_overlays(encoders: CLIPEncoders, probe: Probe, count: int, heads: str, mean: Sequence[float],
                       std: Sequence[float]) -> Tensor:
    """Grad-ECLIP heat maps of the first `count` pairs blended over their de-normalised images, [K, 3, H, W]."""
    device, dtype = encoders.model.logit_scale.device, encoders.model.visual.conv1.weight.dtype
    images = probe.images[:count].to(device, dtype)
    with torch.no_grad():
        texts = encoders.encode_text(probe.ids[:count].to(device)).pooled
    with torch.enable_grad():
        # An input that requires grad keeps the graph even when the vision tower is frozen.
        heat = image_grad_eclip(encoders, images.detach().requires_grad_(True), texts, heads=heads).detach()
    colour = torch.from_numpy(colormaps[OVERLAY_COLORMAP](heat.float().cpu().numpy())[..., :3]).permute(0, 3, 1, 2)
    return (1 - OVERLAY_ALPHA) * denormalise(probe.images[:count], mean, std) + OVERLAY_ALPHA * colour.float()


def denormalise(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Model-normalised images back to RGB in [0, 1]."""
    shape = (1, -1, 1, 1)
    return (images.float() * torch.tensor(std).view(shape) + torch.tensor(mean).view(shape)).clamp(0, 1)


def box_plot(method: str, summary: GapSummary) -> Figure:
    """Per-caption object / attribute / relation attribution as a box plot (Agg figure, no pyplot state)."""
    groups = {name: values.numpy() for name, values in summary.box_groups().items() if len(values)}
    figure = Figure(figsize=(4, 3), dpi=100)
    axes = figure.add_subplot()
    if groups:
        axes.boxplot(list(groups.values()))
        axes.set_xticks(range(1, len(groups) + 1), list(groups))
    axes.set_title(f"{method}: per-caption attribution")
    axes.set_ylabel("mean over the group's tokens")
    figure.tight_layout()
    return figure


# ----- the callback ---------------------------------------------------------------------------------------
class AttributionMonitor(L.Callback):
    """Logs the attribution gap of `attributions` on a fixed probe every N optimizer steps (see module doc).

    Args:
        every_n_steps: measure after every N-th optimizer step (> 0).
        attributions: keys of `attribution.ATTRIBUTIONS`.
        options: attribution options (`monitor.attribution`).
        probe_size: the first N pairs of the validation split form the probe.
        overlay_images: Grad-ECLIP overlays of the first K probe pairs (0 = none).
        parser: the scene-graph parser that finds object / attribute / relation words.

    Attributes:
        probe: the probe (rank 0, from `on_fit_start`).
        last_results: method -> `GapSummary` of the latest measurement.
    """

    def __init__(self, every_n_steps: int, attributions: Sequence[str], options: AttributionOptions,
                 probe_size: int, overlay_images: int = 0, parser: Optional[SceneGraphParser] = None):
        if every_n_steps <= 0 or probe_size <= 0:
            raise ValueError(f"monitor.every_n_steps ({every_n_steps}) and monitor.probe_size ({probe_size}) "
                             f"must be positive")
        unknown = [name for name in attributions if name not in ATTRIBUTIONS]
        if unknown:
            raise KeyError(f"monitor.attributions: unknown {unknown}; registered: {', '.join(ATTRIBUTIONS)}")
        self.every_n_steps = every_n_steps
        self.attributions = list(attributions)
        self.options = options
        self.probe_size = probe_size
        self.overlay_images = overlay_images
        self.parser = parser or SceneGraphParser()
        self.probe: Optional[Probe] = None
        self.last_results: Dict[str, GapSummary] = {}
        self._word_ends: Optional[Tensor] = None
        self._measured_step = -1

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        needs_vocabulary = any(uses_word_replacements(method, self.options) for method in self.attributions)
        if needs_vocabulary and replacement_vocabulary_of(module) is None:
            raise ValueError("monitor.attributions has perturbation with monitor.attribution.replacement=kind, which "
                             "draws words from the training captions' vocabulary: set data.masks=true, or "
                             "monitor.attribution.replacement=token")
        if trainer.is_global_zero and self.probe is None:
            self.probe = build_probe(trainer.datamodule, module.tokenizer, self.probe_size, self.parser)
            self._word_ends = word_end_table(module.tokenizer, module.clip.token_embedding.num_embeddings)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        # With gradient accumulation this hook runs on every micro-batch of a step: measure each step once.
        if trainer.sanity_checking or step == 0 or step % self.every_n_steps or step == self._measured_step:
            return
        self._measured_step = step
        if trainer.is_global_zero:
            self._measure_and_log(trainer, module, step)
        trainer.strategy.barrier("attribution_monitor")

    def measure(self, module: L.LightningModule) -> Dict[str, GapSummary]:
        """Group attributions of every configured method on the probe, with the module's current weights."""
        with eval_mode(module):
            images = image_embeddings(module.encoders, self.probe.images)
            vocabulary = replacement_vocabulary_of(module)
            return {method: summarise(probe_attribution(module.encoders, self.probe, images, method, self.options,
                                                        self._word_ends, vocabulary), self.probe)
                    for method in self.attributions}

    def overlays(self, module: L.LightningModule) -> Tensor:
        """Grad-ECLIP overlays [K, 3, H, W] of the first `overlay_images` probe pairs."""
        preprocess = module.clip.visual.preprocess_cfg
        with eval_mode(module):
            return gradeclip_overlays(module.encoders, self.probe, self.overlay_images, self.options.heads,
                                      preprocess["mean"], preprocess["std"])

    def _measure_and_log(self, trainer: L.Trainer, module: L.LightningModule, step: int) -> None:
        self.last_results = self.measure(module)
        if trainer.logger is None:
            return
        trainer.logger.log_metrics({f"attr/{method}/{name}": value for method, summary in self.last_results.items()
                                    for name, value in summary.scalars().items()}, step=step)
        writer = trainer.logger.experiment
        if not hasattr(writer, "add_histogram"):  # not TensorBoard: the scalars above are all it can take
            return
        for method, summary in self.last_results.items():
            log_distributions(writer, method, summary, step)
        if self.overlay_images > 0:
            log_overlays(writer, self.overlays(module), self.probe.captions, step)


def log_distributions(writer, method: str, summary: GapSummary, step: int) -> None:
    """Histograms of the per-caption values and the box plot figure of one method."""
    for name, values in summary.histograms().items():
        if len(values):
            writer.add_histogram(f"attr_hist/{method}/{name}", values, step)
    writer.add_figure(f"attr_boxplot/{method}", box_plot(method, summary), step)


def log_overlays(writer, overlays: Tensor, captions: Sequence[str], step: int) -> None:
    for k, (overlay, caption) in enumerate(zip(overlays, captions)):
        writer.add_image(f"gradeclip/{k}", overlay, step)
        writer.add_text(f"gradeclip/{k}/caption", caption, step)


def build_attribution_monitor(cfg: DictConfig) -> Optional[AttributionMonitor]:
    """The monitor of `cfg.monitor`, or None when it is off (`every_n_steps: 0`)."""
    monitor = cfg.monitor
    if not monitor.every_n_steps:
        return None
    parser = SceneGraphParser(cfg.preprocess.parser_model, cfg.preprocess.parser_batch_size)
    return AttributionMonitor(monitor.every_n_steps, list(monitor.attributions),
                              attribution_options(cfg.monitor.attribution), monitor.probe_size,
                              monitor.overlay_images, parser)
