"""The shared LightningModule: model construction, optimizer groups, schedule, logging, safety checks.

A method subclasses `CompositionalCLIPModule` and overrides `compute_terms(batch)`, returning
`(terms, report)`: `terms` are named scalar tensors, and those whose names end in `_loss` are summed into the
objective; `report` holds scalars to log only. Everything else (groups, warmup + cosine, logit-scale clamp,
non-finite guard, logging, the encoding of NegCLIP's hard-negative captions) lives here so methods stay small.

The training step reads no value back from the device: the finiteness guard is kept on the device and read on
logging steps, metrics are averaged over ranks on logging steps only (the steps Lightning writes), and how far
each caption batch runs through the text tower is measured on the host before the batch moves
(`on_before_batch_transfer`, `trim_length`).
"""
from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from modeling.encoders import BuiltModel, CLIPEncoders
from modeling.backbone import build_backbone
from modeling.long_context import restore_kept_positions, zero_kept_gradients
from modeling.lora import add_lora, adapter_parameter_count, merged

log = logging.getLogger(__name__)

Terms = Dict[str, Tensor]


# How to get each of NegCLIP's extra batch entries when a method's options ask for one that is missing.
HARD_NEGATIVE_HINTS = {
    "neg_text": "set method.hard_negatives.captions > 0 and use annotations with neg_captions",
    "neg_image": "the training split needs the NegCLIP TSV with method.hard_negatives.images=true",
    "neg_image_neg_text": "set method.hard_negatives.captions > 0 with method.hard_negatives.images=true"}


# Batch entries of token ids [..., L]; the text tower runs them up to their batch's last EOS.
TOKEN_ENTRIES = ("text", "neg_text", "neg_image_text", "neg_image_neg_text")
# The batch entry (a dict of ints, which stay on the host) of the lengths measured before the batch moved.
HOST_LENGTHS = "host_lengths"


def token_lengths(batch: dict) -> Dict[str, int]:
    """Positions up to the last EOS of each token-id entry of a host batch (open_clip's EOS has the largest id):
    the length `CLIPEncoders.encode_text(trim=True)` would measure on the device."""
    return {key: int(batch[key].argmax(dim=-1).max()) + 1 for key in TOKEN_ENTRIES
            if isinstance(batch.get(key), Tensor) and not batch[key].is_floating_point() and batch[key].numel()}


def required_entry(batch: dict, key: str) -> Tensor:
    """`batch[key]`, or a KeyError saying which setting provides it (keys of `HARD_NEGATIVE_HINTS`)."""
    value: Optional[Tensor] = batch.get(key)
    if value is None:
        raise KeyError(f"the batch has no {key}: {HARD_NEGATIVE_HINTS[key]}")
    return value


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf objective (or weights); raised on every rank together.

    `step` is the first global step whose loss was not finite: the weights of that step produced it.
    """

    def __init__(self, message: str, step: Optional[int] = None):
        super().__init__(message)
        self.step = step


def total_loss(terms: Terms) -> Tensor:
    """The objective: the sum of the terms whose names end in `_loss`."""
    losses = [value for name, value in terms.items() if name.endswith("_loss")]
    if not losses:
        raise ValueError(f"no term ends in '_loss' among {sorted(terms)}")
    return torch.stack([loss.float() for loss in losses]).sum()


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine to `min_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def split_by_decay(named: List[Tuple[str, nn.Parameter]]) -> Tuple[list, list]:
    """Weight decay only for matrices; gains, biases, logit_scale and other ndim < 2 params are exempt."""
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    return decay, no_decay


class CompositionalCLIPModule(L.LightningModule, ABC):
    """Base of every method. Args: cfg, the resolved experiment config (see config.py).

    Class attributes read by `fit.check_inputs` before anything is built: `uses_hard_negatives` (the method
    trains on NegCLIP's hard-negative captions, `method.hard_negatives.captions` > 0),
    `uses_hard_negative_images` (it trains on NegCLIP's neighbour images, `method.hard_negatives.images`),
    `required_masks` (the preprocessing cache's masks it reads from every batch: data.masks=true) and
    `trains_backbone` (false for a method on a frozen backbone: LoRA adapters, `model.lora`, are refused).
    """

    uses_hard_negatives = False
    uses_hard_negative_images = False
    trains_backbone = True

    def __init__(self, cfg: DictConfig):
        super().__init__()
        self.save_hyperparameters({"config": OmegaConf.to_container(cfg, resolve=True)})
        self.cfg = cfg
        built, kept_positions = self._build_model(cfg.model)
        self.model_name = built.name
        self.model_config = built.config  # exported beside the weights
        self.tokenizer = built.tokenizer
        self.preprocess_train, self.preprocess_val = built.preprocess_train, built.preprocess_val
        self.encoders = CLIPEncoders(built.model)
        # Long-CLIP's frozen leading text positions (None unless the context was stretched), see long_context.py.
        self.register_buffer("kept_text_positions", kept_positions)
        self._lr_logged_step = -1  # the optimizer step whose learning rates were logged last
        # The first step whose loss was not finite (-1: none yet) and its terms, kept on the device.
        self._first_bad_step = torch.tensor(-1)
        self._bad_terms: Terms = {}

    @staticmethod
    def _build_model(model: DictConfig) -> Tuple[BuiltModel, Optional[Tensor]]:
        """The open_clip model (its text context stretched when `model.context_length` is longer), with LoRA
        adapters when `model.lora.rank` > 0 (every backbone weight then frozen).

        Returns the built model and the values of its frozen leading positions (None without a stretch).
        """
        built, kept_positions = build_backbone(model)
        if model.lora.rank:
            add_lora(built.model, model.lora)
            log.info("LoRA rank %d: %d adapter parameters on %s", model.lora.rank,
                     adapter_parameter_count(built.model), ", ".join(model.lora.towers))
        return built, kept_positions

    @property
    def clip(self) -> nn.Module:
        """The open_clip model being trained (with its LoRA adapters, if any)."""
        return self.encoders.model

    def plain_clip(self) -> nn.Module:
        """The open_clip model as plain open_clip runs it (what is exported and what benchmarks score): `clip`,
        or with LoRA a copy with the adapters merged into the weights (open_clip's own forward would skip an
        adapter on an attention's output projection, modeling/lora.py)."""
        return merged(self.clip)

    # ----- NegCLIP's hard-negative captions, shared by every method that takes them ---------------------------
    @property
    def trains_on_hard_negatives(self) -> bool:
        """True in training with `method.hard_negatives.captions` > 0: hard captions shape the training objective
        only (validation scores the method's plain loss of the samples themselves)."""
        return self.training and self.cfg.method.hard_negatives.captions > 0

    @staticmethod
    def hard_negative_ids(batch: dict, neighbours: bool = False) -> Tensor:
        """Token ids [B, K, L] of the samples' hard captions (`neg_text`), or [2B, K, L] with the NegCLIP
        neighbours' own hard captions (`neg_image_neg_text`) after them when `neighbours`."""
        ids = required_entry(batch, "neg_text")
        if neighbours:
            ids = torch.cat([ids, required_entry(batch, "neg_image_neg_text")])
        return ids

    def encode_hard_negatives(self, batch: dict, neighbours: bool = False) -> Tensor:
        """L2-normalised global features [B, K, D] (or [2B, K, D], see `hard_negative_ids`) of the hard
        captions: NegCLIP's extra image-to-text columns. The text forward is trimmed after the last EOS, which
        leaves the pooled EOS feature unchanged (the tower is causal)."""
        ids = self.hard_negative_ids(batch, neighbours)
        keys = ("neg_text", "neg_image_neg_text") if neighbours else ("neg_text",)
        pooled = self.encoders.encode_text(ids.flatten(0, 1), trim=self.trim_length(batch, *keys)).pooled
        return F.normalize(pooled, dim=-1).view(*ids.shape[:2], -1)

    # ----- host-side work on a batch, before it moves to the device ---------------------------------------
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Measure on the host what would cost a device sync later (`host_work`), into the batch."""
        if isinstance(batch, dict):
            batch.update(self.host_work(batch))
        return batch

    def host_work(self, batch: dict) -> Dict[str, Any]:
        """Entries to add to a host batch; methods extend it. Here: `HOST_LENGTHS`, the caption lengths."""
        return {HOST_LENGTHS: token_lengths(batch)}

    @staticmethod
    def trim_length(batch: dict, *keys: str) -> Union[bool, int]:
        """`encode_text`'s `trim` for the token ids of `keys` (concatenated): the longest of their lengths measured
        on the host, or True (measure on the device) for a batch that did not come through a Trainer."""
        lengths = batch.get(HOST_LENGTHS, {})
        return max(lengths[key] for key in keys) if all(key in lengths for key in keys) else True

    # ----- the one hook a method overrides -------------------------------------------------------------
    @abstractmethod
    def compute_terms(self, batch: dict) -> Tuple[Terms, Terms]:
        """Return (terms, report) for a batch. Terms ending in `_loss` form the objective."""

    # ----- steps -----------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        terms, report = self.compute_terms(batch)
        loss = total_loss(terms)
        self._watch_finite(loss, terms)
        self._log_scalars("train", {"loss": loss, **terms, **report}, batch)
        # Counts add up over ranks (the scalars above are means over ranks).
        counts = self.over_ranks(self._data_counts(batch), "sum")
        self.log_dict(counts, on_step=True, on_epoch=False, reduce_fx="sum", batch_size=len(batch["text"]))
        self.log("train/logit_scale", self.clip.logit_scale.exp().detach(), batch_size=len(batch["text"]))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        terms, report = self.compute_terms(batch)
        self._log_scalars("val", {"loss": total_loss(terms), **terms, **report}, batch)

    def _log_scalars(self, stage: str, scalars: Terms, batch: dict) -> None:
        on_step = stage == "train"
        values = {f"{stage}/{name}": value.detach().float() for name, value in scalars.items()}
        # Training values are per step, averaged over ranks here; validation's over the epoch, by Lightning at its end.
        values = self.over_ranks(values, "mean") if on_step else values
        options = dict(on_step=on_step, on_epoch=not on_step, sync_dist=not on_step, batch_size=len(batch["text"]))
        # The objective is what a researcher watches: it also goes to the progress bar (train/loss per step,
        # val/loss after each validation); the other terms go to TensorBoard only.
        self.log(f"{stage}/loss", values.pop(f"{stage}/loss"), prog_bar=True, **options)
        self.log_dict(values, **options)

    def over_ranks(self, values: Terms, reduce_op: str) -> Terms:
        """Per-step scalars reduced over ranks ("mean" or "sum"), in one all-reduce, on the steps Lightning writes
        (`logs_this_step`); on the others they stay this rank's own: nothing but the progress bar reads them.
        (`self.log(sync_dist=True)` would all-reduce each scalar at every step, about 15 collectives per step.)"""
        trainer = self._trainer
        if not values or trainer is None or trainer.world_size == 1 or not self.logs_this_step():
            return values
        reduced = trainer.strategy.reduce(torch.stack(list(values.values())), reduce_op=reduce_op)
        return dict(zip(values, reduced.unbind()))

    def logs_this_step(self) -> bool:
        """Whether Lightning writes this training step's values: its `log_every_n_steps` rule (step + 1 divisible
        by it), every step in a fast_dev_run. A function of the step alone, so every rank makes the same
        collectives."""
        trainer = self.trainer
        every = trainer.log_every_n_steps
        return bool(trainer.fast_dev_run) or (every > 0 and (self.global_step + 1) % every == 0)

    @staticmethod
    def _data_counts(batch: dict) -> Terms:
        """Per-batch counts of substituted bad images and truncated captions."""
        return {f"train/data/{key}": batch[key].float().sum() for key in ("bad_image", "truncated") if key in batch}

    def _watch_finite(self, loss: Tensor, terms: Terms) -> None:
        """Remember, on the device, the first step whose objective is not finite and that batch's terms.

        No host sync here: `check_finite` reads the record on logging steps and before every checkpoint or
        export, so a diverged step is found within `log_every_n_steps` steps and never saved.
        """
        new = ~torch.isfinite(loss.detach()) & (self._first_bad_step < 0)
        # A fill, not torch.tensor(step, device=...): a blocking host-to-device copy waits for the device.
        step = torch.full((), self.global_step, dtype=torch.long, device=new.device)
        self._first_bad_step = torch.where(new, step, self._first_bad_step.to(new.device))
        for name, value in terms.items():
            kept = self._bad_terms.get(name, torch.full((), float("nan"), device=new.device))
            self._bad_terms[name] = torch.where(new, value.detach().float(), kept)

    def check_finite(self, weights: bool = False) -> None:
        """Raise `NonFiniteLossError` on every rank when any rank has seen a non-finite objective (or, with
        `weights`, holds a non-finite parameter). One host sync; called on logging steps and before saving."""
        strategy = self.trainer.strategy
        local_step = int(self._first_bad_step)
        weights_bad = weights and not self.has_finite_weights()
        if not strategy.reduce_boolean_decision(local_step >= 0 or weights_bad, all=False):
            return
        first = torch.tensor(local_step if local_step >= 0 else 2 ** 62, device=self.device)
        step = int(strategy.reduce(first, reduce_op="min"))
        if step < 2 ** 62:
            values = ", ".join(f"{name}={float(value):.4g}" for name, value in self._bad_terms.items())
            values = values if local_step == step else "the non-finite batch was on another rank"
            raise NonFiniteLossError(f"non-finite loss at global step {step} (batch of this rank: {values}); "
                                     f"nothing from that step on was saved", step=step)
        raise NonFiniteLossError(f"non-finite weights at global step {self.global_step} although every loss was "
                                 f"finite (an overflowing update); they were not saved", step=self.global_step)

    def has_finite_weights(self) -> bool:
        return bool(torch.stack([torch.isfinite(p).all() for p in self.parameters()]).all())

    def refuse_non_finite_export(self) -> None:
        """This rank's check before an export (no collective: the end of fit may have torn the group down)."""
        bad_step = int(self._first_bad_step)
        if bad_step >= 0 or not self.has_finite_weights():
            raise NonFiniteLossError(f"not exported: a loss or weight was not finite by global step "
                                     f"{self.global_step}", step=bad_step if bad_step >= 0 else None)

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        every = self.trainer.log_every_n_steps or 1
        if self.global_step % every == 0:
            self.check_finite()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """No checkpoint ever holds weights that diverged (or came after a non-finite loss)."""
        if self._trainer is not None:
            self.check_finite(weights=True)

    # ----- optimisation ----------------------------------------------------------------------------------
    def head_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """Trainable parameters outside the CLIP model (method heads, mask tokens): the head group."""
        clip_ids = {id(p) for p in self.clip.parameters()}
        return ((n, p) for n, p in self.named_parameters() if p.requires_grad and id(p) not in clip_ids)

    def _backbone_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.clip.named_parameters() if p.requires_grad and n != "logit_scale"]

    def param_groups(self) -> List[dict]:
        """AdamW groups: backbone and heads, each split into decay / no decay (ndim < 2) unless its
        `optim.*_decay_1d` puts every parameter under decay; logit_scale in its own group."""
        o = self.cfg.optim
        head_warmup = o.warmup_steps if o.head_warmup_steps is None else o.head_warmup_steps
        backbone = dict(lr=o.lr, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps)
        head = dict(lr=o.head_lr, weight_decay=o.head_weight_decay, warmup_steps=head_warmup)
        decay_1d = {"backbone": o.backbone_decay_1d, "head": o.head_decay_1d}
        groups = []
        for prefix, named, settings in (("backbone", self._backbone_parameters(), backbone),
                                        ("head", list(self.head_parameters()), head)):
            if decay_1d[prefix]:
                groups.append({**settings, "name": prefix, "params": [p for _, p in named]})
                continue
            decay, no_decay = split_by_decay(named)
            groups.append({**settings, "name": prefix, "params": decay})
            groups.append({**settings, "name": f"{prefix}_no_decay", "params": no_decay, "weight_decay": 0.0})
        logit_settings = backbone if o.logit_scale_group == "backbone" else head
        if self.clip.logit_scale.requires_grad:
            decay = logit_settings["weight_decay"] if decay_1d[o.logit_scale_group] else 0.0
            groups.append({**logit_settings, "name": "logit_scale", "params": [self.clip.logit_scale],
                           "weight_decay": decay})
        return [g for g in groups if g["params"]]

    def configure_optimizers(self):
        o = self.cfg.optim
        groups = self.param_groups()
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        total = int(self.trainer.estimated_stepping_batches)
        schedules = [self._schedule(g["warmup_steps"], total) for g in groups]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _schedule(self, warmup_steps: int, total_steps: int):
        min_ratio = self.cfg.optim.min_lr_ratio
        return lambda step: warmup_cosine(step, warmup_steps, total_steps, min_ratio)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Frozen leading text positions of a stretched context get no update (before clipping, too)."""
        if self.kept_text_positions is not None:
            zero_kept_gradients(self.clip.positional_embedding, self.kept_text_positions.shape[0])

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self._clamp_logit_scale()
        if self.kept_text_positions is not None:
            restore_kept_positions(self.clip.positional_embedding, self.kept_text_positions)

    def _clamp_logit_scale(self) -> None:
        """CLIP's temperature cap: exp(logit_scale) <= max_logit_scale after every step."""
        with torch.no_grad():
            self.clip.logit_scale.clamp_(0, math.log(self.cfg.optim.max_logit_scale))

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self._log_learning_rates()

    def _log_learning_rates(self) -> None:
        """`lr/<group>` every `log_every_n_steps` optimizer steps (0, n, 2n, ...), at the step they apply to.

        Written straight to the loggers: `self.log` values are flushed on Lightning's own schedule (batch index
        + 1 divisible by n), which would file them n - 1 steps late, drop them at epoch boundaries and never
        write step 0. The scheduler steps after each optimizer step, so before a step's first micro-batch the
        groups hold the lr of optimizer step `global_step`; the later micro-batches of gradient accumulation
        share that step and are skipped.
        """
        step, every = self.global_step, self.trainer.log_every_n_steps
        if not every or step % every or step == self._lr_logged_step or not self.trainer.is_global_zero:
            return
        self._lr_logged_step = step
        rates = {f"lr/{group['name']}": group["lr"] for group in self.trainer.optimizers[0].param_groups}
        for logger in self.loggers:
            logger.log_metrics(rates, step=step)
