"""Mechanism measurements of finished runs: attribution gap, MACCO's cross-modal reconstruction, SmartCLIP's masks.

Real tiny runs (a shapes world in a temporary folder, `lightning_modules.fit` for 2 steps of the tiny model) are
measured and checked against slow, obvious references: the demo's attribution gap, the module's own
`compute_terms` on one batch of the same samples, per-caption mask-network forwards, Jaccard on Python sets.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from core.config import REPO_ROOT, save_config
from lightning_modules import METHODS, load_run_config
from datamodules.shapes import caption_from_dict, generate, load_scene_graphs
from lightning_modules.fit import run
from study.mechanisms import (MECHANISMS, MechanismError, SplitFiles, jaccard, jaccard_matrix,
                                                load_run, macco_samples, measure, pair_means, relation_flip_captions,
                                                same_relation_flip, shuffled_partners, split_config, trained_module,
                                                with_partner_images)
from tolerance import assert_scaled_close

TINY = "ViT-Tiny-16-64"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    generate(root, n_train=16, n_val=12, image_size=64, seed=0)  # 2 captions per image
    return root


def tiny_config(shapes_root: Path, runs_root: Path, *overrides: str):
    return load_run_config([REPO_ROOT / "configs" / "demo" / "pretrain.yaml"], [
        f"model.name={TINY}", f"data.root={shapes_root}", f"runs_root={runs_root}", "data.batch_size=8",
        "data.num_workers=0", "trainer.enable_progress_bar=false", "optim.warmup_steps=1", "optim.lr=1e-3",
        "trainer.max_steps=2", "trainer.limit_val_batches=0", "data.masks=false", *overrides])


@pytest.fixture(scope="module")
def macco_run(shapes_root, tmp_path_factory) -> Path:
    from datamodules.preprocess import run as run_preprocess

    runs = tmp_path_factory.mktemp("runs_macco")
    masks = ["data.masks=true", f"preprocess.cache_root={runs / 'cache'}"]
    run_preprocess(tiny_config(shapes_root, runs, *masks))
    run(tiny_config(shapes_root, runs, "method.name=macco", "experiment=macco", *masks))
    return runs / "macco"


@pytest.fixture(scope="module")
def smartclip_run(shapes_root, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs_smartclip")
    # A small temperature and a large head lr: two steps move the mask network away from its initial masks.
    run(tiny_config(shapes_root, runs, "method.name=smartclip", "experiment=smartclip", "optim.head_lr=0.05",
                    "method.mask_positions=caption"))
    return runs / "smartclip"


# ----- registry and errors -------------------------------------------------------------------------------
def test_every_method_has_a_registry_entry_and_every_fine_tuning_method_the_gap():
    assert set(MECHANISMS) == set(METHODS)
    for method in ("clip_ft", "clip_cae", "macco", "smartclip"):
        assert "attribution_gaps" in [m.__name__ for m in MECHANISMS[method]], method
    assert MECHANISMS["tflocal"] == MECHANISMS["tfglobal"] == ()


def test_an_aligner_run_has_no_mechanism(shapes_root, tmp_path):
    run_dir = tmp_path / "tflocal"
    save_config(tiny_config(shapes_root, tmp_path, "method.name=tflocal"), run_dir / "config.yaml")
    assert measure(run_dir, tmp_path / "no_data", "val") == {}


def test_bad_runs_are_named_errors(shapes_root, smartclip_run, tmp_path):
    with pytest.raises(MechanismError, match="no config.yaml"):
        measure(tmp_path, shapes_root, "val")
    copy = tmp_path / "copy"
    shutil.copytree(smartclip_run, copy)
    with pytest.raises(MechanismError, match="split 'missing'"):
        measure(copy, shapes_root, "missing")
    with pytest.raises(ValueError, match="limit"):
        measure(copy, shapes_root, "val", limit=0)
    (copy / "checkpoints" / "last.ckpt").unlink()
    with pytest.raises(MechanismError, match=f"run {copy}: no checkpoints/last.ckpt"):
        measure(copy, shapes_root, "val", limit=4)


def test_a_checkpoint_of_other_weights_than_the_export_is_refused(shapes_root, smartclip_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(smartclip_run, copy)
    checkpoint = torch.load(copy / "checkpoints" / "last.ckpt", weights_only=False)
    checkpoint["global_step"] = 1
    torch.save(checkpoint, copy / "checkpoints" / "last.ckpt")
    with pytest.raises(MechanismError, match="from step 1 but the export from step 2"):
        trained_module(load_run(copy), CPU)


# ----- the attribution gap --------------------------------------------------------------------------------
def test_attribution_gaps_equal_the_demo_measurement(shapes_root, smartclip_run):
    from study.demo import attribution_gap
    from evaluation.scorers import ClipScorer

    result = measure(smartclip_run, shapes_root, "val", limit=10, device="cpu")
    scorer = ClipScorer.from_export(smartclip_run / "export")
    files = SplitFiles(shapes_root, "val")
    for method in ("attention", "gradient"):
        expected = attribution_gap(scorer, files.captions, files.images, method=method, probe_size=10)
        assert_scaled_close(result[f"attr_gap_{method}"], expected, 1e-5)
    assert 0 < result["attr_gap_captions"] <= 10


# ----- MACCO ----------------------------------------------------------------------------------------------
def test_shuffled_partners_are_a_fixed_derangement_across_images():
    image_ids = [1, 1, 2, 2, 3, 3, 4, 5, 5, 6]
    partner = shuffled_partners(image_ids)
    assert sorted(partner.tolist()) == list(range(len(image_ids)))  # a bijection
    assert all(image_ids[j] != image_ids[i] for i, j in enumerate(partner))  # never the caption's own image
    assert np.array_equal(partner, shuffled_partners(image_ids))  # fixed
    with pytest.raises(MechanismError, match="derangement"):
        shuffled_partners([7, 7, 7])


def test_partner_images_move_with_their_patch_masks_and_captions_stay():
    samples = [{"image": torch.full((1,), float(i)), "patch_mask": torch.tensor([i % 2 == 0]), "image_id": i,
                "text": torch.tensor([i]), "comp_mask": torch.tensor([True]), "caption_id": 10 + i}
               for i in range(3)]
    shuffled = with_partner_images(samples, np.array([2, 0, 1]))
    for sample, j in zip(shuffled, [2, 0, 1]):
        assert sample["image_id"] == j and float(sample["image"]) == j and bool(sample["patch_mask"]) == (j % 2 == 0)
    assert [int(sample["text"]) for sample in shuffled] == [0, 1, 2]
    assert [sample["caption_id"] for sample in shuffled] == [10, 11, 12]


def module_reference(module, samples) -> dict:
    """The module's own unweighted L_mlm / L_mim on ONE batch of all samples, and the masked-token accuracy
    computed sample by sample."""
    batch = default_collate(samples)
    with torch.no_grad():
        _, report = module.compute_terms(batch)
        out = module.macco_forward(batch)
    accuracies, start = [], 0
    predicted = out.vocabulary_logits.argmax(dim=-1)
    for row in range(len(samples)):
        count = int(out.text_mask[row].sum())
        targets = out.ids[row][out.text_mask[row]]
        if count:
            accuracies.append(float((predicted[start:start + count] == targets).float().mean()))
        start += count
    return {"mlm_loss": float(report["unweighted/mlm"]), "mim_loss": float(report["unweighted/mim"]),
            "mlm_acc": sum(accuracies) / len(accuracies), "mlm_samples": len(accuracies),
            "mim_samples": int(out.patch_mask.any(dim=1).sum())}


def test_macco_reconstruction_equals_the_modules_own_losses(shapes_root, macco_run):
    limit = 20  # 3 batches of the run's batch size 8: the per-batch means must combine exactly
    result = measure(macco_run, shapes_root, "val", limit=limit, device="cpu")
    module = trained_module(load_run(macco_run), CPU)
    cfg = split_config(load_run(macco_run).cfg, SplitFiles(shapes_root, "val"), limit)
    samples = macco_samples(module, cfg, "val")
    assert len(samples) == limit
    partner = shuffled_partners([sample["image_id"] for sample in samples])
    for condition, measured_on in (("true", samples), ("shuffled", with_partner_images(samples, partner))):
        expected = module_reference(module, measured_on)
        for name in ("mlm_loss", "mlm_acc", "mim_loss"):
            assert_scaled_close(result[f"{name}_{condition}"], expected[name], 1e-5)
        assert result["mlm_samples"] == expected["mlm_samples"] and result["mim_samples"] == expected["mim_samples"]
    assert result["mlm_loss_shuffled"] != result["mlm_loss_true"]  # the image keys did change
    assert result["mim_loss_shuffled"] != result["mim_loss_true"]
    # deterministic masks: a second measurement gives the same numbers
    again = measure(macco_run, shapes_root, "val", limit=limit, device="cpu")
    assert again == result


# ----- SmartCLIP ------------------------------------------------------------------------------------------
def test_jaccard_against_python_sets():
    generator = torch.Generator().manual_seed(0)
    masks = torch.rand(7, 12, generator=generator) < 0.3
    masks[3] = False
    masks[5] = False  # two empty masks: overlap 1
    sets = [set(torch.nonzero(row).flatten().tolist()) for row in masks]

    def reference(a: set, b: set) -> float:
        return 1.0 if not a | b else len(a & b) / len(a | b)

    expected = torch.tensor([[reference(a, b) for b in sets] for a in sets])
    torch.testing.assert_close(jaccard_matrix(masks), expected, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(jaccard(masks, masks.roll(1, 0)),
                               torch.tensor([reference(sets[i], sets[i - 1]) for i in range(7)]), rtol=1e-6, atol=0.0)
    image_ids = [1, 1, 2, 2, 2, 3, 4]
    means = pair_means(expected, image_ids)
    same = [expected[i, j] for i in range(7) for j in range(i + 1, 7) if image_ids[i] == image_ids[j]]
    other = [expected[i, j] for i in range(7) for j in range(i + 1, 7) if image_ids[i] != image_ids[j]]
    assert means["same_image"][1] == len(same) == 4 and means["other_image"][1] == len(other) == 17
    assert means["same_image"][0] == pytest.approx(float(sum(same) / len(same)), rel=1e-6)
    assert means["other_image"][0] == pytest.approx(float(sum(other) / len(other)), rel=1e-6)
    assert pair_means(expected[:1, :1], [1]) == {"same_image": (None, 0), "other_image": (None, 0)}


def test_relation_flips_are_the_negatives_with_the_direction_reversed(shapes_root):
    files = SplitFiles(shapes_root, "val")
    annotations = json.loads(files.captions.read_text())["annotations"]
    flips = relation_flip_captions(files, annotations)
    structures = {caption["caption_id"]: caption["structure"] for image in load_scene_graphs(shapes_root, "val")
                  for caption in image["captions"]}
    with_relation = [a for a in annotations if structures[a["id"]]["relation"] is not None]
    assert flips and set(flips) <= {a["id"] for a in with_relation}
    for annotation in annotations:
        if annotation["id"] not in flips:
            continue
        caption = caption_from_dict(structures[annotation["id"]])
        candidates = {replace(caption, subject=caption.obj, obj=caption.subject).text,
                      replace(caption, relation={"left of": "right of", "right of": "left of", "above": "below",
                                                 "below": "above"}[caption.relation]).text}
        assert flips[annotation["id"]] in candidates and flips[annotation["id"]] in annotation["neg_captions"]
    single = {"template": "single", "subject": {"color": "red", "shape": "square", "size": None},
              "relation": None, "object": None, "wording": 0}
    assert not same_relation_flip(single, single)


def test_smartclip_masks_against_one_caption_at_a_time(shapes_root, smartclip_run):
    limit = 12
    result = measure(smartclip_run, shapes_root, "val", limit=limit, device="cpu")
    module = trained_module(load_run(smartclip_run), CPU)
    files = SplitFiles(shapes_root, "val")
    annotations = json.loads(files.captions.read_text())["annotations"][:limit]

    def mask_of(caption: str) -> set:
        with torch.no_grad():
            _, hidden, valid = module.encode_text_with_hidden(module.tokenizer([caption]))
            return set(torch.nonzero(torch.sigmoid(module.mask_net(hidden, valid))[0] >= 0.5).flatten().tolist())

    def overlap(a: set, b: set) -> float:
        return 1.0 if not a | b else len(a & b) / len(a | b)

    masks = [mask_of(a["caption"]) for a in annotations]
    dims = module.clip.visual.output_dim
    assert result["active_dims"] == pytest.approx(np.mean([len(m) for m in masks]), rel=1e-6)
    assert result["active_fraction"] == pytest.approx(result["active_dims"] / dims, rel=1e-6)
    pairs = [(i, j) for i in range(limit) for j in range(i + 1, limit)]
    same = [overlap(masks[i], masks[j]) for i, j in pairs if annotations[i]["image_id"] == annotations[j]["image_id"]]
    other = [overlap(masks[i], masks[j]) for i, j in pairs if annotations[i]["image_id"] != annotations[j]["image_id"]]
    assert result["mask_jaccard_same_image"] == pytest.approx(np.mean(same), rel=1e-5)
    assert result["mask_jaccard_other_image"] == pytest.approx(np.mean(other), rel=1e-5)
    flips = relation_flip_captions(files, annotations)
    flip_overlaps = [overlap(masks[k], mask_of(flips[a["id"]])) for k, a in enumerate(annotations) if a["id"] in flips]
    assert result["mask_relation_flip_pairs"] == len(flip_overlaps) > 0
    assert result["mask_jaccard_relation_flip"] == pytest.approx(np.mean(flip_overlaps), rel=1e-5)
    assert 0 < result["active_dims"] < dims  # the trained masks are neither empty nor full (else nothing to see)
    one = measure(smartclip_run, shapes_root, "val", limit=1, device="cpu")  # no caption pair: keys left out
    assert "active_dims" in one and not {"mask_jaccard_same_image", "mask_jaccard_other_image"} & set(one)


def test_a_split_without_a_mask_cache_is_preprocessed_first(shapes_root, macco_run, tmp_path):
    """A split that training never preprocessed (a test split): its cache is built, and the first samples of an
    identical split measure exactly as on the validation split (same masks, same seeds)."""
    root = tmp_path / "world"
    shutil.copytree(shapes_root, root)
    coco = json.loads((root / "annotations" / "captions_val.json").read_text())
    coco["annotations"] = coco["annotations"][:10]  # another file: another cache key
    (root / "annotations" / "captions_test.json").write_text(json.dumps(coco))
    shutil.copy(root / "annotations" / "scene_graphs_val.json", root / "annotations" / "scene_graphs_test.json")
    shutil.copytree(root / "images" / "val", root / "images" / "test", dirs_exist_ok=True)  # val's images over test's
    cache_root = Path(load_run(macco_run).cfg.preprocess.cache_root)
    caches = set(cache_root.iterdir())
    on_test = measure(macco_run, root, "test", limit=6, device="cpu")
    assert len(set(cache_root.iterdir()) - caches) == 1  # the test split's cache
    assert on_test == measure(macco_run, root, "val", limit=6, device="cpu")
