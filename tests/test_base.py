"""The shared module: parameter groups, warmup + cosine, logit-scale clamp, objective, precision."""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_modules import load_run_config
from lightning_modules.base import total_loss, warmup_cosine
from lightning_modules.fit import resolve_precision
from lightning_modules.methods.clip_ft import ClipFineTune


def tiny_cfg(*overrides: str):
    return load_run_config([], ["model.name=ViT-Tiny-16-64", "model.pretrained=null", *overrides])


class WithHead(ClipFineTune):
    """CLIP-FT plus a head and a mask token, the way later methods add trainable parameters."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.head = nn.Linear(4, 4)
        self.mask_token = nn.Parameter(torch.zeros(8))


def groups_by_name(module) -> dict:
    return {g["name"]: g for g in module.param_groups()}


def test_groups_exempt_ndim_below_two_and_cover_every_parameter_once():
    module = WithHead(tiny_cfg("optim.lr=1e-5", "optim.weight_decay=0.2", "optim.head_lr=1e-3",
                               "optim.head_weight_decay=0.01"))
    groups = groups_by_name(module)
    assert set(groups) == {"backbone", "backbone_no_decay", "head", "head_no_decay", "logit_scale"}
    assert all(p.ndim >= 2 for p in groups["backbone"]["params"] + groups["head"]["params"])
    assert all(p.ndim < 2 for p in groups["backbone_no_decay"]["params"] + groups["head_no_decay"]["params"])
    assert (groups["backbone"]["lr"], groups["backbone"]["weight_decay"]) == (1e-5, 0.2)
    assert (groups["head"]["lr"], groups["head"]["weight_decay"]) == (1e-3, 0.01)
    assert groups["backbone_no_decay"]["weight_decay"] == groups["head_no_decay"]["weight_decay"] == 0.0
    assert groups["logit_scale"]["params"] == [module.clip.logit_scale]
    assert (groups["logit_scale"]["lr"], groups["logit_scale"]["weight_decay"]) == (1e-5, 0.0)
    grouped = [id(p) for g in groups.values() for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in module.parameters() if p.requires_grad)
    head_ids = {id(p) for p in groups["head"]["params"] + groups["head_no_decay"]["params"]}
    assert head_ids == {id(module.head.weight), id(module.head.bias), id(module.mask_token)}


def test_logit_scale_can_join_the_head_group():
    groups = groups_by_name(WithHead(tiny_cfg("optim.logit_scale_group=head", "optim.head_lr=1e-3")))
    assert (groups["logit_scale"]["lr"], groups["logit_scale"]["weight_decay"]) == (1e-3, 0.0)


def test_decay_1d_puts_every_parameter_of_a_group_under_weight_decay():
    # SmartCLIP's original decays every CLIP parameter; MACCO's head group decays biases, LayerNorms, mask
    # tokens and (there) logit_scale.
    module = WithHead(tiny_cfg("optim.weight_decay=0.2", "optim.head_weight_decay=0.01", "optim.head_decay_1d=true",
                               "optim.logit_scale_group=head"))
    groups = groups_by_name(module)
    assert set(groups) == {"backbone", "backbone_no_decay", "head", "logit_scale"}
    head_ids = {id(p) for p in groups["head"]["params"]}
    assert head_ids == {id(module.head.weight), id(module.head.bias), id(module.mask_token)}
    assert groups["head"]["weight_decay"] == 0.01
    assert (groups["logit_scale"]["lr"], groups["logit_scale"]["weight_decay"]) == (1e-3, 0.01)
    groups = groups_by_name(WithHead(tiny_cfg("optim.weight_decay=0.01", "optim.backbone_decay_1d=true")))
    assert set(groups) == {"backbone", "head", "head_no_decay", "logit_scale"}
    assert any(p.ndim < 2 for p in groups["backbone"]["params"])
    assert groups["backbone"]["weight_decay"] == groups["logit_scale"]["weight_decay"] == 0.01


def test_warmup_then_cosine():
    values = [warmup_cosine(step, 4, 14, 0.1) for step in range(15)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == pytest.approx(1.0)
    assert values[9] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert values[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))


class Steps(L.LightningDataModule):
    def __init__(self, module, n=6):
        super().__init__()
        ids = module.tokenizer(["a red square"] * 2)
        self.batches = [{"image": torch.randn(2, 3, 64, 64), "text": ids} for _ in range(n)]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


def test_schedule_per_step_and_logit_scale_clamped_after_each_step():
    module = ClipFineTune(tiny_cfg("optim.lr=1e-2", "optim.warmup_steps=2", "optim.max_logit_scale=50"))
    with torch.no_grad():
        module.clip.logit_scale.fill_(math.log(1000.0))
    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.append((trainer.optimizers[0].param_groups[0]["lr"], float(pl_module.clip.logit_scale.exp())))

    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[Record()], enable_model_summary=False)
    trainer.fit(module, datamodule=Steps(module))
    lrs = [lr for lr, _ in seen]
    expected = [1e-2 * warmup_cosine(step, 2, 6, 0.0) for step in range(1, 7)]
    assert lrs == pytest.approx(expected)
    assert all(scale <= 50.0 + 1e-4 for _, scale in seen)


def test_objective_sums_only_loss_terms():
    terms = {"itc_loss": torch.tensor(1.0), "mlm_loss": torch.tensor(2.5), "attr_gap": torch.tensor(100.0)}
    assert total_loss(terms) == 3.5
    with pytest.raises(ValueError, match="_loss"):
        total_loss({"gap": torch.tensor(1.0)})


def test_precision_auto_follows_the_accelerator_and_explicit_values_pass_through():
    expected = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    assert resolve_precision("auto") == expected
    assert resolve_precision("auto", "cpu") == "32-true"  # also where a GPU exists
    assert resolve_precision("auto", "gpu") == resolve_precision("auto", "cuda") == "bf16-mixed"
    assert resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"
