"""CLIP-CAE: contrastive fine-tuning plus composition attribution enhancement (EMNLP 2024;
docs/methods.md#clip-cae).

`L = L_itc + lambda * L_attr`. For each positive pair (image b, caption b) a per-token attribution `a` of the
similarity S(I, T) to the caption's tokens is computed (attention, gradcam, perturbation, gradient or
grad_eclip; `method.attribution`) over the object tokens (`obj_mask`) and the relation and attribute tokens
(`comp_mask`) of the preprocessing cache. No code is released: the paper is the reference.

- [paper] `method.attr_hinge=batch`: A_obj and A_comp are the mean attribution over all object (composition)
  tokens of the batch, the global batch under DDP, and `L_attr = max(0, A_obj - A_comp + eps)`, one hinge.
  [ours] `caption`: the hinge per caption, averaged over captions with both kinds of tokens.
- [paper] The regulariser trains the text encoder only: the image embedding inside the attribution target is
  a constant (detached); the image tower learns from L_itc alone.
- The attribution of the training forward is the one penalised: attention is read from the same text forward
  as the contrastive loss, and the gradient-based methods differentiate it with `create_graph=True` (double
  backward). Perturbation with `replacement=kind` [paper] replaces each object / attribute / relation word by
  K words of its kind from the training captions (`replacement_vocabulary`, from the DataModule at setup and
  stored in the checkpoint); the draws are seeded by (seed, epoch, caption id), so they do not depend on the
  batch composition, the rank or a resume.
- [paper] CAE + NegCLIP (`method.hard_negatives.captions: K`) is the paper's own
  orthogonality result: the hard captions join L_itc exactly as in CLIP-FT (the base's shared
  `encode_hard_negatives`), training only; the attribution is of the samples' own captions.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from datamodules.word_vocabulary import WordVocabulary
from modeling.attribution import (TextAttributionInputs, WordReplacements, attribution_options,
                                                   draw_word_replacements, group_means, text_attribution, token_kinds,
                                                   word_end_table)
from lightning_modules.base import Terms
from modeling.losses import cae_attribution_loss, cae_batch_attribution_loss
from lightning_modules.methods.clip_ft import ClipFineTune

# Methods that differentiate the text forward: double backward needs the explicit attention (PyTorch's fused
# attention kernels have no second derivative), which also gives the probabilities and traces that the
# attention, gradcam and grad_eclip methods read.
GRADIENT_BASED = ("gradcam", "gradient", "grad_eclip")
EXPLICIT_ATTENTION = ("attention",) + GRADIENT_BASED
# Where the replacement vocabulary goes in a checkpoint.
VOCABULARY_KEY = "cae_replacement_vocabulary"
# The batch entry of the replacement words drawn on the host (`ClipCAE.host_work`).
REPLACEMENTS = "word_replacements"


class ClipCAE(ClipFineTune):
    """CLIP-FT (with optional NegCLIP negatives) plus CAE's attribution hinge; needs `data.masks=true`.

    Attributes:
        replacement_vocabulary: the training captions' words per kind (perturbation with `replacement=kind`),
            taken from the DataModule in `setup`, or set directly.
    """

    # the object and composition token masks of the hinge (perturbation's word kinds come with them)
    required_masks = ("obj_mask", "comp_mask")

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        self.attribution = cfg.method.attribution.name
        self.attribution_options = attribution_options(cfg.method.attribution)
        # A host copy too: the replacement words are drawn on the host batch, before it moves (`host_work`).
        self._host_word_ends = word_end_table(self.tokenizer, self.clip.vocab_size)
        self.register_buffer("word_ends", self._host_word_ends.clone(), persistent=False)
        self.replacement_vocabulary: Optional[WordVocabulary] = None

    @property
    def uses_word_replacements(self) -> bool:
        return self.attribution == "perturbation" and self.attribution_options.replacement == "kind"

    @property
    def needs_full_context(self) -> bool:
        """Grad-ECLIP's official lambda range spans every context position: the text is not trimmed."""
        return self.attribution == "grad_eclip" and self.attribution_options.text_lambda_range == "all_positions"

    # ----- the replacement vocabulary: from the DataModule, kept in the checkpoint --------------------------
    def setup(self, stage: str) -> None:
        if not self.uses_word_replacements or self.replacement_vocabulary is not None:
            return
        vocabulary = getattr(self.trainer.datamodule, "replacement_vocabulary", None)
        if vocabulary is None:
            raise ValueError("perturbation with method.attribution.replacement=kind draws replacement words from the "
                             "training captions' parsed words: set data.masks=true (a CocoDataModule with the "
                             "preprocessing cache), or use method.attribution.replacement=token")
        self.replacement_vocabulary = vocabulary

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.replacement_vocabulary is not None:
            checkpoint[VOCABULARY_KEY] = self.replacement_vocabulary.to_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Restored after setup: a resumed run draws from the table it started with.
        if VOCABULARY_KEY in checkpoint:
            self.replacement_vocabulary = WordVocabulary.from_dict(checkpoint[VOCABULARY_KEY])

    # ----- the objective ---------------------------------------------------------------------------------------
    def compute_terms(self, batch: dict) -> Tuple[Terms, Terms]:
        _check_batch(batch, self.uses_word_replacements)
        # Validation runs under no_grad; gradient-based attributions still need a graph to differentiate.
        with torch.enable_grad() if self.attribution in GRADIENT_BASED else nullcontext():
            image = F.normalize(self.encoders.encode_image(batch["image"]).pooled, dim=-1)
            # perturbation runs each perturbed caption from its replaced word on, from the blocks' inputs here
            trim = False if self.needs_full_context else self.trim_length(batch, "text")
            text_features = self.encoders.encode_text(batch["text"], attn=self.attribution in EXPLICIT_ATTENTION,
                                                      trim=trim,
                                                      keep_block_inputs=self.attribution == "perturbation",
                                                      embeddings_as_leaf=self.attribution in GRADIENT_BASED)
            # [paper] the attribution regularises the text encoder only: the image embedding is a constant here
            attribution = self._attribution(batch, image.detach(), text_features)
        text = F.normalize(text_features.pooled, dim=-1)
        # NegCLIP's hard negatives (captions, neighbour images) join L_itc only; attribution is of the samples.
        itc = self._contrastive_loss(batch, image, text)
        attr_loss, report = self._attribution_term(attribution, batch)
        return {"itc_loss": itc, "attr_loss": self.cfg.method.attr_weight * attr_loss}, report

    def host_work(self, batch: dict) -> dict:
        """With perturbation by kind, also the replacement words (`REPLACEMENTS`), drawn from the host batch: drawing
        reads every id and caption id, which on the device would be a sync per caption."""
        work = super().host_work(batch)
        if self.uses_word_replacements and self.replacement_vocabulary is not None and "obj_mask" in batch:
            work[REPLACEMENTS] = self._draw_replacements(batch, batch["text"])
        return work

    def _attribution(self, batch: dict, image: Tensor, text_features) -> Tensor:
        ids = batch["text"][:, : text_features.tokens.shape[1]]  # the (trimmed) length of the text forward
        replacements = batch.get(REPLACEMENTS)  # drawn on the host, unless the batch did not come through a Trainer
        if replacements is None and self.uses_word_replacements:
            replacements = self._draw_replacements(batch, ids)
        inputs = TextAttributionInputs(self.encoders, ids, image, text_features, self.word_ends,
                                       replacements=replacements)
        return text_attribution(self.attribution, inputs, self.attribution_options, create_graph=self.training)

    def _draw_replacements(self, batch: dict, ids: Tensor) -> WordReplacements:
        """The replacement words of every kind-tagged word of the captions `ids` (trimmed or not: the words after
        the last EOS have no kind), on the device of `ids`."""
        word_ends = self._host_word_ends if ids.device.type == "cpu" else self.word_ends
        if self.replacement_vocabulary is None:
            raise ValueError("perturbation with replacement=kind needs ClipCAE.replacement_vocabulary (set by "
                             "setup from the DataModule, or directly)")
        kinds = token_kinds(batch["obj_mask"], batch["attr_mask"], batch["rel_mask"])
        stage = 0 if self.training else 1
        seeds = [(self.cfg.seed, self.current_epoch, caption_id, stage) for caption_id in batch["caption_id"].tolist()]
        return draw_word_replacements(ids, word_ends, kinds, self.replacement_vocabulary,
                                      self.attribution_options.num_replacements, seeds)

    def _attribution_term(self, attribution: Tensor, batch: dict) -> Tuple[Tensor, Terms]:
        """L_attr (the paper's batch hinge, or ours per caption) and the scalars to log."""
        attr_obj, has_obj = group_means(attribution, batch["obj_mask"])
        attr_comp, has_comp = group_means(attribution, batch["comp_mask"])
        valid = has_obj & has_comp
        report = _attribution_report(attr_obj, attr_comp, valid)
        margin = self.cfg.method.attr_margin
        if self.cfg.method.attr_hinge == "caption":
            return cae_attribution_loss(attr_obj, attr_comp, valid, margin), report
        if self.cfg.method.attr_hinge != "batch":
            raise ValueError(f"method.attr_hinge must be 'batch' or 'caption', got {self.cfg.method.attr_hinge!r}")
        loss, batch_obj, batch_comp = cae_batch_attribution_loss(attribution, batch["obj_mask"], batch["comp_mask"],
                                                                 margin)
        report["attr/batch_gap"] = (batch_comp - batch_obj).detach()
        return loss, report


def _check_batch(batch: dict, word_kinds: bool) -> None:
    needed = ["obj_mask", "comp_mask"] + (["attr_mask", "rel_mask", "caption_id"] if word_kinds else [])
    missing = [key for key in needed if key not in batch]
    if missing:
        raise KeyError(f"CLIP-CAE needs {', '.join(needed)} in every batch (missing: {', '.join(missing)}): set "
                       f"data.masks=true and run python -m datamodules.preprocess --config ... first")


def _attribution_report(attr_obj: Tensor, attr_comp: Tensor, valid: Tensor) -> Terms:
    """Mean A_obj, A_comp and gap (A_comp - A_obj; positive = composition words win) over valid captions."""
    weights = valid.to(attr_obj.dtype)
    count = weights.sum().clamp(min=1)
    obj = (attr_obj.detach() * weights).sum() / count
    comp = (attr_comp.detach() * weights).sum() / count
    return {"attr/obj": obj, "attr/comp": comp, "attr/gap": comp - obj, "attr/valid_fraction": weights.mean()}
