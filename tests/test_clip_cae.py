"""CLIP-CAE: the attribution hinges (the paper's batch hinge, our per-caption one) against slow references for
every attribution method, the text-only regulariser by gradient inspection, the replacement vocabulary's way
from the DataModule into the module and the checkpoint, and a smoke fit with the paper's perturbation."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import REPO_ROOT
from lightning_modules import load_run_config
from datamodules.shapes import generate
from datamodules.word_vocabulary import ATTRIBUTE, OBJECT, RELATION, WordVocabulary
from modeling.attribution import (ATTRIBUTIONS, TextAttributionInputs, attribution_options,
                                                   text_attribution)
from lightning_modules.fit import run
from modeling.losses import cae_attribution_loss
from lightning_modules.methods.clip_cae import VOCABULARY_KEY, ClipCAE
from parsers.scene_graph import SceneGraphParser
from parsers.token_alignment import spans_to_token_mask

CAPTIONS = ["a red cube to the left of a blue ball", "a man riding a horse", "a dog", "a small green triangle"]
CAPTION_IDS = [11, 12, 13, 14]
VOCABULARY = {OBJECT: Counter({"cube": 2, "ball": 3, "man": 4, "horse": 1, "dog": 2, "triangle": 1, "teddy bear": 1}),
              ATTRIBUTE: Counter({"red": 3, "blue": 2, "small": 1, "green": 1, "wooden": 2}),
              RELATION: Counter({"left": 1, "of": 2, "riding": 1, "on": 4, "next to": 1})}


def reference_hinge(attr_obj, attr_comp, valid, margin):
    values = [max(0.0, o - c + margin) for o, c, v in zip(attr_obj, attr_comp, valid) if v]
    return sum(values) / len(values) if values else 0.0


@pytest.mark.parametrize("margin", [0.0, 0.1])
def test_hinge_equals_a_loop_over_valid_captions(margin):
    attr_obj = torch.tensor([0.5, 0.2, 0.9, 0.3], requires_grad=True)
    attr_comp = torch.tensor([0.3, 0.4, 0.1, 0.3])
    valid = torch.tensor([True, True, False, True])
    loss = cae_attribution_loss(attr_obj, attr_comp, valid, margin)
    assert loss.item() == pytest.approx(reference_hinge(attr_obj.tolist(), attr_comp.tolist(), valid, margin))
    loss.backward()
    assert attr_obj.grad[2] == 0  # an invalid caption gets no gradient


def test_no_valid_caption_gives_zero_not_nan():
    attr_obj = torch.tensor([0.5, 0.2], requires_grad=True)
    loss = cae_attribution_loss(attr_obj, torch.zeros(2), torch.tensor([False, False]))
    assert loss.item() == 0.0 and loss.requires_grad


def make_module(method: str, *overrides: str) -> ClipCAE:
    cfg = load_run_config([], ["model.name=ViT-Tiny-16-64", "method.name=clip_cae", f"method.attribution.name={method}",
                           "method.attribution.eclip_layers=2", "method.attr_weight=2.0", "method.attr_margin=0.5",
                           "method.attribution.num_replacements=2", *overrides])
    torch.manual_seed(0)
    module = ClipCAE(cfg)
    module.replacement_vocabulary = WordVocabulary.from_counts(VOCABULARY, module.tokenizer)
    return module


@pytest.fixture(scope="module")
def graphs():
    return SceneGraphParser().parse(CAPTIONS)


def make_batch(module: ClipCAE, graphs) -> dict:
    def masks(spans_of):
        return torch.from_numpy(np.stack([spans_to_token_mask(c, spans_of(g), module.tokenizer)
                                          for c, g in zip(CAPTIONS, graphs)]))

    generator = torch.Generator().manual_seed(1)
    return {"image": torch.randn(len(CAPTIONS), 3, 64, 64, generator=generator), "text": module.tokenizer(CAPTIONS),
            "obj_mask": masks(lambda g: g.object_spans()), "comp_mask": masks(lambda g: g.composition_spans()),
            "attr_mask": masks(lambda g: g.attribute_spans()), "rel_mask": masks(lambda g: g.relation_spans()),
            "caption_id": torch.tensor(CAPTION_IDS)}


def reference_attribution(module: ClipCAE, batch: dict, method: str) -> torch.Tensor:
    """The library's attribution (tested on its own in test_attribution.py) from a fresh forward."""
    image = torch.nn.functional.normalize(module.encoders.encode_image(batch["image"]).pooled, dim=-1)
    features = module.encoders.encode_text(batch["text"], attn=True)
    replacements = module._draw_replacements(batch, batch["text"]) if module.uses_word_replacements else None
    inputs = TextAttributionInputs(module.encoders, batch["text"], image, features, module.word_ends, replacements)
    return text_attribution(method, inputs, attribution_options(module.cfg.method.attribution)).detach()


def per_caption_means(a, batch):
    obj, comp, valid = [], [], []
    for row, o_mask, c_mask in zip(a, batch["obj_mask"], batch["comp_mask"]):
        obj.append(float(row[o_mask].mean()) if o_mask.any() else 0.0)
        comp.append(float(row[c_mask].mean()) if c_mask.any() else 0.0)
        valid.append(bool(o_mask.any() and c_mask.any()))
    return obj, comp, valid


@pytest.mark.parametrize("method", list(ATTRIBUTIONS))
def test_paper_batch_hinge_equals_a_loop_over_all_tokens(method, graphs):
    module = make_module(method).train()
    batch = make_batch(module, graphs)
    terms, report = module.compute_terms(batch)
    a = reference_attribution(module, batch, method)
    obj_values = [float(v) for row, mask in zip(a, batch["obj_mask"]) for v, m in zip(row, mask) if m]
    comp_values = [float(v) for row, mask in zip(a, batch["comp_mask"]) for v, m in zip(row, mask) if m]
    # every object token of the batch counts, also those of "a dog" (a caption without composition words)
    assert len(obj_values) > sum(per_caption_means(a, batch)[2])
    a_obj, a_comp = sum(obj_values) / len(obj_values), sum(comp_values) / len(comp_values)
    expected = 2.0 * max(0.0, a_obj - a_comp + 0.5)
    # float32 attributions of another forward: ~1e-6 relative (the hinge is active, far from its kink at 0)
    assert expected > 0 and terms["attr_loss"].item() == pytest.approx(expected, rel=1e-5)
    assert float(report["attr/batch_gap"]) == pytest.approx(a_comp - a_obj, rel=1e-5, abs=1e-5 * max(a_obj, a_comp))


@pytest.mark.parametrize("method", list(ATTRIBUTIONS))
def test_our_caption_hinge_equals_the_reference(method, graphs):
    module = make_module(method, "method.attr_hinge=caption").train()
    batch = make_batch(module, graphs)
    terms, report = module.compute_terms(batch)
    obj, comp, valid = per_caption_means(reference_attribution(module, batch, method), batch)
    assert valid == [True, True, False, True]  # "a dog" has no composition word
    expected = 2.0 * reference_hinge(obj, comp, valid, 0.5)  # a wide margin: the hinge is active
    assert terms["attr_loss"].item() == pytest.approx(expected, rel=1e-5)
    kept = [i for i, v in enumerate(valid) if v]
    # a difference of means, possibly near 0: it rounds like the means, hence an atol of rtol times the largest
    assert float(report["attr/gap"]) == pytest.approx(np.mean([comp[i] - obj[i] for i in kept]), rel=1e-5,
                                                       abs=1e-5 * max(obj + comp))
    assert float(report["attr/valid_fraction"]) == 0.75


@pytest.mark.parametrize("method", list(ATTRIBUTIONS))
def test_attribution_term_trains_the_text_tower_only(method, graphs):
    """[paper] the image embedding of the attribution target is a constant: no vision parameter gets any
    gradient from L_attr (exactly zero), while the text tower does."""
    module = make_module(method).train()
    terms, _ = module.compute_terms(make_batch(module, graphs))
    vision = dict(module.clip.visual.named_parameters())
    text = {name: p for name, p in module.clip.named_parameters() if not name.startswith("visual.")}
    grads = torch.autograd.grad(terms["attr_loss"], list(vision.values()) + list(text.values()), allow_unused=True)
    vision_grads, text_grads = grads[:len(vision)], grads[len(vision):]
    for name, grad in zip(vision, vision_grads):
        assert grad is None or torch.count_nonzero(grad) == 0, f"{method}: L_attr reaches visual.{name}"
    touched = [name for name, grad in zip(text, text_grads) if grad is not None and grad.abs().sum() > 0]
    assert "transformer.resblocks.1.attn.in_proj_weight" in touched, f"{method}: L_attr misses the text tower"


@pytest.mark.parametrize("method", ["gradient", "gradcam"])
def test_validation_under_no_grad_still_computes_gradient_attributions(method, graphs):
    module = make_module(method).eval()
    with torch.no_grad():
        terms, report = module.compute_terms(make_batch(module, graphs))
    assert torch.isfinite(terms["attr_loss"]) and torch.isfinite(report["attr/gap"])
    assert all(p.grad is None for p in module.parameters())


def test_perturbation_draws_are_seeded_by_caption_and_epoch(graphs):
    module = make_module("perturbation")
    batch = make_batch(module, graphs)
    first = module._draw_replacements(batch, batch["text"])
    assert torch.equal(first.ids, module._draw_replacements(batch, batch["text"]).ids)
    reordered = {key: value.flip(0) for key, value in batch.items()}
    flipped = module._draw_replacements(reordered, reordered["text"])
    for b in range(len(CAPTIONS)):  # the same caption draws the same words wherever it sits in the batch
        assert torch.equal(first.ids[first.sample == b], flipped.ids[flipped.sample == len(CAPTIONS) - 1 - b])


@pytest.mark.parametrize("missing", ["obj_mask", "rel_mask", "caption_id"])
def test_missing_batch_keys_name_the_setting(missing, graphs):
    module = make_module("perturbation")
    batch = make_batch(module, graphs)
    del batch[missing]
    with pytest.raises(KeyError, match="data.masks=true"):
        module.compute_terms(batch)


def test_configs_follow_the_paper():
    """Each cae_*.yaml trains with the paper's definitions; ours stay options."""
    for path in sorted((REPO_ROOT / "configs").glob("cae_*.yaml")):
        method = load_run_config([path]).method
        assert method.attr_hinge == "batch", path.name
        attribution = method.attribution
        assert (attribution.start_layer, attribution.replacement) == (0, "kind"), path.name
        assert (attribution.heads, attribution.text_lambda_range) == ("single", "all_positions"), path.name


# ----- the replacement vocabulary through a real fit -------------------------------------------------------
@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    generate(root, n_train=16, n_val=8, image_size=64, seed=0)  # 2 captions per image
    return root


def test_fit_with_the_papers_perturbation_stores_the_vocabulary(shapes_root, tmp_path):
    """Two steps of the paper's perturbation CAE on the shapes world: the module takes the DataModule's
    vocabulary (the training captions' words per kind), the checkpoint carries it, and a resume restores it."""
    from datamodules.preprocess import run as run_preprocess

    cfg = load_run_config([REPO_ROOT / "configs" / "demo" / "pretrain.yaml"], [
        "model.name=ViT-Tiny-16-64", f"data.root={shapes_root}", f"runs_root={tmp_path}", "data.batch_size=8",
        "data.num_workers=0", "trainer.enable_progress_bar=false", "trainer.max_steps=2", "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0", f"preprocess.cache_root={tmp_path / 'cache'}", "method.name=clip_cae",
        "method.attribution.name=perturbation", "method.attribution.num_replacements=2"])
    run_preprocess(cfg)
    trainer = run(cfg)
    module, datamodule = trainer.lightning_module, trainer.datamodule
    vocabulary = module.replacement_vocabulary
    assert vocabulary is datamodule.replacement_vocabulary
    words = {kind: set(table.texts) for kind, table in vocabulary.tables.items()}
    assert {"red", "blue"} <= words[ATTRIBUTE] and {"square", "circle"} <= words[OBJECT] and words[RELATION]
    checkpoint = torch.load(tmp_path / "demo_pretrain" / "checkpoints" / "last.ckpt", weights_only=False)
    assert WordVocabulary.from_dict(checkpoint[VOCABULARY_KEY]) == vocabulary
    fresh = ClipCAE(cfg)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.replacement_vocabulary == vocabulary
