"""ClipLoss and CLIP-CAE's batch hinge against slow references, in fp32 under autocast, and exact under 2 real gloo
processes (MACCO's L_mca with NegCLIP's hard captions too)."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from modeling.losses import ClipLoss, cae_batch_attribution_loss, masked_contrastive_loss
from tolerance import scaled_close

BATCH, DIM, NEGATIVES, WORLD = 4, 6, 2, 2


def reference_clip_loss(images, texts, scale, negatives=None):
    """InfoNCE written out one anchor at a time."""
    n = images.shape[0]
    columns = [texts[j] for j in range(n)]
    if negatives is not None:
        columns += [negatives[i, k] for i in range(n) for k in range(negatives.shape[1])]
    i2t, t2i = 0.0, 0.0
    for i in range(n):
        scores = torch.stack([scale * images[i].dot(c) for c in columns])
        i2t = i2t - (scores[i] - torch.logsumexp(scores, 0))
        scores = torch.stack([scale * texts[i].dot(images[j]) for j in range(n)])
        t2i = t2i - (scores[i] - torch.logsumexp(scores, 0))
    return (i2t / n + t2i / n) / 2


def unit(*shape, seed=0):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=-1)


@pytest.mark.parametrize("with_negatives", [False, True])
def test_matches_slow_reference(with_negatives):
    images, texts = unit(BATCH, DIM, seed=1), unit(BATCH, DIM, seed=2)
    negatives = unit(BATCH, NEGATIVES, DIM, seed=3) if with_negatives else None
    scale = torch.tensor(7.0, dtype=torch.float64)
    loss = ClipLoss()(images, texts, scale, negatives)
    expected = reference_clip_loss(images, texts, scale, negatives)  # in float64
    # ClipLoss runs in float32: logsumexp over <= 12 logits of size <= 7, ~1e-7 relative rounding
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_hard_negatives_raise_the_loss_and_perfect_alignment_is_near_zero():
    texts = unit(BATCH, DIM, seed=2)
    scale = torch.tensor(100.0)
    aligned = ClipLoss()(texts.float(), texts.float(), scale)
    assert aligned < 1e-3
    negatives = texts.float().unsqueeze(1).repeat(1, 2, 1)  # negatives identical to the positives
    # image-to-text now ties 3 ways (log 3); text-to-image stays ~0: mean log(3) / 2
    loss = ClipLoss()(texts.float(), texts.float(), scale, negatives)
    # the other columns add e^(-100 (1 - cos)) ~ 1e-8 here; float32 rounding ~1e-7 relative
    assert loss.item() == pytest.approx(math.log(3) / 2, rel=1e-5)


def test_logits_in_fp32_under_bf16_autocast():
    images, texts = unit(BATCH, DIM, seed=4).bfloat16(), unit(BATCH, DIM, seed=5).bfloat16()
    scale = torch.tensor(100.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ClipLoss()(images, texts, scale)
    assert loss.dtype == torch.float32
    expected = reference_clip_loss(images.double(), texts.double(), scale.double())  # bf16 values are exact in float64
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)  # float32 logits of size <= 100, loss ~32


# ----- 2-process gloo parity ----------------------------------------------------------------------------
class TwoTowers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(8, DIM)
        self.text = torch.nn.Linear(5, DIM)
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(10.0)))

    def forward(self, x_image, x_text, x_neg, loss_fn):
        image = F.normalize(self.image(x_image), dim=-1)
        text = F.normalize(self.text(x_text), dim=-1)
        negatives = F.normalize(self.text(x_neg), dim=-1) if x_neg is not None else None
        return loss_fn(image, text, self.logit_scale.exp(), negatives)


def global_batch(with_negatives):
    g = torch.Generator().manual_seed(123)
    n = BATCH * WORLD
    neg = torch.randn(n, NEGATIVES, 5, generator=g) if with_negatives else None
    return torch.randn(n, 8, generator=g), torch.randn(n, 5, generator=g), neg


def loss_and_grads(rank_slice, with_negatives, local_loss, gather_with_grad):
    """Loss and gradients on the slice (whole batch when rank_slice is None)."""
    model = TwoTowers()
    loss_fn = ClipLoss(local_loss=local_loss, gather_with_grad=gather_with_grad)  # before any process group
    x_image, x_text, x_neg = global_batch(with_negatives)
    if rank_slice is not None:
        x_image, x_text = x_image[rank_slice], x_text[rank_slice]
        x_neg = x_neg[rank_slice] if x_neg is not None else None
    loss = model(x_image, x_text, x_neg, loss_fn)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank, init_file, options, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        loss, grads = loss_and_grads(slice(rank * BATCH, (rank + 1) * BATCH), *options)
        dist.all_reduce(loss)  # what sync_dist logging reports: the mean over ranks
        for grad in grads.values():  # what DDP does to gradients: the mean over ranks
            dist.all_reduce(grad)
            grad /= WORLD
        torch.save({"loss": loss / WORLD, "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("with_negatives,local_loss", [(False, True), (True, True), (True, False)])
def test_two_gloo_processes_match_the_big_batch(tmp_path, with_negatives, local_loss):
    options = (with_negatives, local_loss, True)
    mp.start_processes(_worker, args=(str(tmp_path / "init"), options, str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")
    expected_loss, expected_grads = loss_and_grads(None, *options)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        # per-rank slices and all_reduce sums against one big batch: another summation order, ~1e-7 relative
        # (1.6e-7 of the largest gradient seen); entries near 0 round like the largest one
        assert scaled_close(result["loss"], expected_loss, 1e-5)
        for name, grad in expected_grads.items():
            assert scaled_close(result["grads"][name], grad, 1e-5), name


def test_gather_without_grad_loses_other_ranks_gradient(tmp_path):
    """The exact setting matters: gathering as constants under-counts gradients (the test can tell)."""
    options = (False, True, False)
    mp.start_processes(_worker, args=(str(tmp_path / "init"), options, str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")
    _, expected_grads = loss_and_grads(None, *options)
    result = torch.load(tmp_path / "rank0.pt")
    assert not scaled_close(result["grads"]["image.weight"], expected_grads["image.weight"], 1e-3)


# ----- CLIP-CAE's batch hinge: exact over the global batch ---------------------------------------------------
LENGTH, FEATURES = 7, 5


class TokenScorer(torch.nn.Module):
    """Stands in for a text tower and its attribution: a sigmoid score per token."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.score = torch.nn.Linear(FEATURES, 1)

    def forward(self, tokens):
        return self.score(tokens).squeeze(-1).sigmoid()


def cae_global_batch():
    """Tokens and masks of W * BATCH captions; the ranks' slices hold different numbers of object and
    composition tokens (a mean of per-rank means would weight them wrongly), one caption has neither."""
    g = torch.Generator().manual_seed(5)
    n = BATCH * WORLD
    tokens = torch.randn(n, LENGTH, FEATURES, generator=g)
    obj = torch.rand(n, LENGTH, generator=g) < torch.linspace(0.7, 0.2, n).unsqueeze(1)
    comp = (torch.rand(n, LENGTH, generator=g) < 0.3) & ~obj
    obj[2], comp[2] = False, False
    return tokens, obj, comp


def reference_batch_hinge(attribution, obj, comp, margin):
    """max(0, mean over all object tokens - mean over all composition tokens + margin), one token at a time."""
    obj_values = [attribution[b, t] for b in range(len(obj)) for t in range(LENGTH) if obj[b, t]]
    comp_values = [attribution[b, t] for b in range(len(comp)) for t in range(LENGTH) if comp[b, t]]
    return torch.clamp(sum(obj_values) / len(obj_values) - sum(comp_values) / len(comp_values) + margin, min=0)


def test_cae_batch_hinge_equals_a_loop_over_all_tokens():
    tokens, obj, comp = cae_global_batch()
    attribution = TokenScorer()(tokens).double()
    loss, attr_obj, attr_comp = cae_batch_attribution_loss(attribution, obj, comp, margin=0.3)
    assert loss.item() == pytest.approx(reference_batch_hinge(attribution, obj, comp, 0.3).item(), rel=1e-6)
    assert attr_obj.item() == pytest.approx(attribution[obj].mean().item(), rel=1e-6)
    assert attr_comp.item() == pytest.approx(attribution[comp].mean().item(), rel=1e-6)


def test_cae_batch_hinge_without_composition_tokens_is_zero_and_connected():
    tokens, obj, comp = cae_global_batch()
    attribution = TokenScorer()(tokens)
    loss, _, _ = cae_batch_attribution_loss(attribution, obj, torch.zeros_like(comp), margin=0.3)
    assert loss.item() == 0.0 and loss.requires_grad


def cae_loss_and_grads(rank_slice):
    model = TokenScorer()
    tokens, obj, comp = cae_global_batch()
    if rank_slice is not None:
        tokens, obj, comp = tokens[rank_slice], obj[rank_slice], comp[rank_slice]
    loss, _, _ = cae_batch_attribution_loss(model(tokens), obj, comp, margin=0.3)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cae_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        loss, grads = cae_loss_and_grads(slice(rank * BATCH, (rank + 1) * BATCH))
        for grad in grads.values():  # what DDP does to gradients: the mean over ranks
            dist.all_reduce(grad)
            grad /= WORLD
        torch.save({"loss": loss, "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_cae_batch_hinge_on_two_gloo_processes_equals_the_global_batch(tmp_path):
    mp.start_processes(_cae_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    expected_loss, expected_grads = cae_loss_and_grads(None)
    assert expected_loss > 0  # the hinge is active
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        # every rank computes the global loss; per-rank sums against one big sum: ~1e-7 relative rounding
        assert scaled_close(result["loss"], expected_loss, 1e-5)
        for name, grad in expected_grads.items():
            assert scaled_close(result["grads"][name], grad, 1e-5), name
    # the test can tell: each rank's own hinge (no gather), DDP-averaged, is another gradient
    local = [cae_loss_and_grads(slice(rank * BATCH, (rank + 1) * BATCH))[1] for rank in range(WORLD)]
    averaged = {name: sum(grads[name] for grads in local) / WORLD for name in expected_grads}
    assert not scaled_close(averaged["score.weight"], expected_grads["score.weight"], 1e-2)


# ----- NegCLIP with hard-negative images (2B images, 4B texts) -------------------------------------------
def reference_negclip_loss(images, neg_images, texts, neg_image_texts, hard, neg_image_hard, scale):
    """NegCLIP's training loss written out as its code computes it: images [I; I_n] (2B) against texts
    [T; T_n; H; H_n] (4B); image-to-text over all 4B columns, text-to-image only for the first 2B texts
    (`logits_per_text[:len(logits_per_image)]`) over the 2B images; labels arange(2B)."""
    all_images = torch.cat([images, neg_images])
    all_texts = torch.cat([texts, neg_image_texts, hard, neg_image_hard])
    rows = all_images.shape[0]
    i2t, t2i = 0.0, 0.0
    for i in range(rows):
        scores = torch.stack([scale * all_images[i].dot(t) for t in all_texts])
        i2t = i2t - (scores[i] - torch.logsumexp(scores, 0))
        scores = torch.stack([scale * all_texts[i].dot(image) for image in all_images])
        t2i = t2i - (scores[i] - torch.logsumexp(scores, 0))
    return (i2t / rows + t2i / rows) / 2


def negclip_features(batch: int, seed: int):
    """Hand-made unit features: I, I_n, T, T_n, H, H_n, each [batch, DIM], float64."""
    return [unit(batch, DIM, seed=seed + k) for k in range(6)]


def test_negclip_batch_matches_the_official_loss():
    images, neg_images, texts, neg_image_texts, hard, neg_image_hard = negclip_features(BATCH, seed=10)
    scale = torch.tensor(9.0, dtype=torch.float64)
    loss = ClipLoss()(torch.cat([images, neg_images]), torch.cat([texts, neg_image_texts]), scale,
                      torch.cat([hard, neg_image_hard]).unsqueeze(1))
    expected = reference_negclip_loss(images, neg_images, texts, neg_image_texts, hard, neg_image_hard, scale)
    # float32 inside ClipLoss: logsumexp over 16 logits of size <= 9, ~1e-7 relative rounding
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    # The hard captions are columns only: as rows they would change the text-to-image term.
    as_rows = ClipLoss()(torch.cat([images, neg_images, images, neg_images]),
                         torch.cat([texts, neg_image_texts, hard, neg_image_hard]), scale)
    assert abs(as_rows.item() - expected.item()) > 1e-2


class NegClipTowers(TwoTowers):
    def forward(self, x, loss_fn):
        """x: image inputs of the samples and of their neighbours, then texts, neighbour texts, hard captions,
        neighbour hard captions, each [B, ...]; the loss of the 2B images against 4B texts."""
        image = lambda a: F.normalize(self.image(a), dim=-1)  # noqa: E731
        text = lambda a: F.normalize(self.text(a), dim=-1)  # noqa: E731
        x_image, x_neg_image, x_text, x_neg_text, x_hard, x_neg_hard = x
        negatives = text(torch.cat([x_hard, x_neg_hard])).unsqueeze(1)
        return loss_fn(image(torch.cat([x_image, x_neg_image])), text(torch.cat([x_text, x_neg_text])),
                       self.logit_scale.exp(), negatives)


def negclip_loss_and_grads(rank_slice):
    model = NegClipTowers()
    g = torch.Generator().manual_seed(321)
    n = BATCH * WORLD
    x = [torch.randn(n, 8, generator=g) for _ in range(2)] + [torch.randn(n, 5, generator=g) for _ in range(4)]
    if rank_slice is not None:
        x = [part[rank_slice] for part in x]
    loss = model(x, ClipLoss(local_loss=True, gather_with_grad=True))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model, x


def _negclip_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        loss, grads, _, _ = negclip_loss_and_grads(slice(rank * BATCH, (rank + 1) * BATCH))
        dist.all_reduce(loss)
        for grad in grads.values():
            dist.all_reduce(grad)
            grad /= WORLD
        torch.save({"loss": loss / WORLD, "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_negclip_on_two_gloo_processes_is_the_official_loss_of_the_global_batch(tmp_path):
    """Each rank holds B samples and their B neighbours; the mean over ranks (and DDP's mean gradient) equals
    NegCLIP's loss over the global 2BW images and 4BW texts in one process."""
    mp.start_processes(_negclip_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")
    expected_loss, expected_grads, model, x = negclip_loss_and_grads(None)
    with torch.no_grad():  # the one-process loss is NegCLIP's, by the slow reference
        image = lambda a: F.normalize(model.image(a), dim=-1).double()  # noqa: E731
        text = lambda a: F.normalize(model.text(a), dim=-1).double()  # noqa: E731
        reference = reference_negclip_loss(image(x[0]), image(x[1]), *(text(part) for part in x[2:]),
                                           model.logit_scale.exp().double())
    assert expected_loss.item() == pytest.approx(reference.item(), rel=1e-5)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert scaled_close(result["loss"], expected_loss, 1e-5)
        for name, grad in expected_grads.items():
            assert scaled_close(result["grads"][name], grad, 1e-5), name


class MaccoTowers(TwoTowers):
    def forward(self, x):
        """x: full and masked image inputs [B, 8], full and masked caption inputs [B, 5], hard captions [B, K, 5]:
        MACCO's L_mca with the hard captions as extra image-to-text columns (MACCO + NegCLIP)."""
        image = lambda a: F.normalize(self.image(a), dim=-1)  # noqa: E731
        text = lambda a: F.normalize(self.text(a), dim=-1)  # noqa: E731
        x_image, x_masked_image, x_text, x_masked_text, x_hard = x
        return masked_contrastive_loss(image(x_image), image(x_masked_image), text(x_text), text(x_masked_text),
                                       self.logit_scale.exp(), text(x_hard))


def macco_negclip_loss_and_grads(rank_slice):
    model = MaccoTowers()
    g = torch.Generator().manual_seed(99)
    n = BATCH * WORLD
    x = [torch.randn(n, 8, generator=g) for _ in range(2)] + [torch.randn(n, 5, generator=g) for _ in range(2)]
    x.append(torch.randn(n, NEGATIVES, 5, generator=g))
    if rank_slice is not None:
        x = [part[rank_slice] for part in x]
    loss = model(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _macco_negclip_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        loss, grads = macco_negclip_loss_and_grads(slice(rank * BATCH, (rank + 1) * BATCH))
        dist.all_reduce(loss)
        for grad in grads.values():
            dist.all_reduce(grad)
            grad /= WORLD
        torch.save({"loss": loss / WORLD, "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_macco_mca_with_hard_negatives_on_two_gloo_processes_is_the_global_batch_loss(tmp_path):
    """Each rank's hard captions are gathered with gradient and scored by every rank's image rows: the mean over
    ranks (and DDP's mean gradient) equals L_mca of the global batch with all its hard captions in one process
    (that loss against its slow reference: tests/test_macco.py)."""
    mp.start_processes(_macco_negclip_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")
    expected_loss, expected_grads = macco_negclip_loss_and_grads(None)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        # per-rank slices and all_reduce sums against one big batch: another summation order, ~1e-7 relative
        assert scaled_close(result["loss"], expected_loss, 1e-5)
        for name, grad in expected_grads.items():
            assert grad.abs().sum() > 0, name
            assert scaled_close(result["grads"][name], grad, 1e-5), name
