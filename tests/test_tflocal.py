"""TFLocal / TFGlobal: frozen backbone, losses against slow references, feature cache, fit, export as a Scorer."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fitting import NEGATIVES, TINY, aligner_config, tiny_config
from tolerance import assert_scaled_close

import lightning_modules
import lightning_modules.fit as fit
from modeling.encoders import build_model
from datamodules import features
from datamodules.annotations import read_annotation_file
from datamodules.cache import CacheError
from datamodules.coco import CocoCaptions
from evaluation.aligner import IMAGE, RERANK_SHIFT, TEXT, AlignerScorer, TokenAligner, squash
from evaluation.benchmarks import build_benchmark
from evaluation.benchmarks.base import ImageRef
from evaluation.benchmarks.images import load_image
from evaluation.benchmarks.retrieval import retrieval_ranks
from testkit.standin.retrieval import write_coco_retrieval
from testkit.standin.sugarcrepe import write_sugarcrepe
from evaluation.harness import run_benchmark
from lightning_modules.base import total_loss
from lightning_modules.methods.tflocal import (TFGlobal, TFLocal, aligner_infonce, aligner_inputs, aligner_itm,
                                               is_feature_batch)

KINDS = {"tflocal": TFLocal, "tfglobal": TFGlobal}


def build(kind: str, cfg):
    L.seed_everything(cfg.seed)  # as fit does: the random-init backbone then equals the cached one
    return KINDS[kind](cfg)


def feature_batch(module, cfg) -> dict:
    datamodule = features.FeatureDataModule.for_module(cfg, module)
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


# ----- frozen backbone ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_backbone_is_frozen_in_eval_mode_and_absent_from_the_optimizer(shapes_root, feature_cache, tmp_path, kind):  # noqa: F811
    cfg = aligner_config(shapes_root, tmp_path, feature_cache, f"method.name={kind}")
    module = build(kind, cfg).train()
    assert module.aligner.training
    assert not any(m.training for m in module.clip.modules()), "train() must not flip the frozen backbone"
    assert not any(p.requires_grad for p in module.clip.parameters())
    groups = module.param_groups()
    assert {g["name"] for g in groups} == {"head", "head_no_decay"}  # empty backbone groups are dropped
    in_optimizer = {id(p) for g in groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in module.aligner.parameters()}
    total_loss(module.compute_terms(feature_batch(module, cfg))[0]).backward()
    assert all(p.grad is None for p in module.clip.parameters())
    for name, param in module.aligner.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_parameter_count_at_the_default_width():
    aligner = TokenAligner(embed_dim=512, width=512, layers=4, heads=8, text_positions=77, image_positions=50)
    count = sum(p.numel() for p in aligner.parameters())
    # "~13M parameters, the reported size" (docs/methods.md#tflocal-and-tfglobal)
    assert 12.5e6 < count < 14e6, count


def test_module_builds_the_configured_aligner(shapes_root, tmp_path):  # noqa: F811
    cfg = tiny_config(shapes_root, tmp_path, "method.name=tflocal", "method.aligner_width=64",
                      "method.aligner_layers=2", "method.aligner_heads=4")
    module = TFLocal(cfg)
    assert module.aligner.config == dict(embed_dim=64, width=64, layers=2, heads=4, text_positions=77,
                                         image_positions=17, score_bias=False)  # ViT-Tiny: D 64, 4 x 4 patches + CLS
    assert len(module.aligner.encoder.layers) == 2


# ----- losses against slow references -------------------------------------------------------------------------
def reference_infonce(grid: np.ndarray, hard: np.ndarray | None) -> float:
    size = grid.shape[0]
    i2t = []
    for i in range(size):
        row = list(grid[i]) + (list(hard[i]) if hard is not None else [])
        i2t.append(-grid[i, i] + np.log(sum(np.exp(v) for v in row if np.isfinite(v))))
    t2i = [-grid[j, j] + np.log(sum(np.exp(grid[i, j]) for i in range(size) if np.isfinite(grid[i, j])))
           for j in range(size)]
    return 0.5 * (np.mean(i2t) + np.mean(t2i))


def reference_itm(grid: np.ndarray, hard: np.ndarray | None) -> float:
    def bce(logit, label):
        probability = 1 / (1 + np.exp(-logit))
        return -np.log(probability) if label else -np.log(1 - probability)

    size = grid.shape[0]
    positives = [bce(grid[i, i], 1) for i in range(size)]
    negatives = [bce(grid[i, j], 0) for i in range(size) for j in range(size) if i != j and np.isfinite(grid[i, j])]
    negatives += [bce(v, 0) for v in (hard.flatten() if hard is not None else [])]
    return 0.5 * (np.mean(positives) + np.mean(negatives))


@pytest.mark.parametrize("with_hard", [False, True])
def test_losses_equal_loops_on_hand_made_scores(with_hard):
    generator = torch.Generator().manual_seed(0)
    grid = torch.randn(5, 5, generator=generator, dtype=torch.float64) * 3
    grid[1, 3] = grid[4, 0] = float("-inf")  # pairs left unscored (in-batch negative subset)
    hard = torch.randn(5, 2, generator=generator, dtype=torch.float64) if with_hard else None
    as_numpy = (grid.numpy(), hard.numpy() if with_hard else None)
    # the losses cast to float32 (exp / log of scores <= ~9, losses ~2-5): ~1e-7 relative, 7.6e-8 seen
    assert aligner_infonce(grid, hard).item() == pytest.approx(reference_infonce(*as_numpy), rel=1e-5)
    assert aligner_itm(grid, hard).item() == pytest.approx(reference_itm(*as_numpy), rel=1e-5)


def pairwise_reference(module, inputs) -> tuple:
    """Every score from its own unpadded sequence, one forward per pair (no padding, no batching)."""
    aligner = module.aligner
    lengths = inputs.text_mask.sum(-1)

    def score(text_tokens, image_tokens):
        text = aligner.embed(text_tokens[None], TEXT)
        image = aligner.embed(image_tokens[None], IMAGE)
        mask = torch.ones(1, text.shape[1], dtype=torch.bool)
        zero = torch.zeros(1, dtype=torch.long)
        return float(aligner.score_pairs(text, mask, image, zero, zero))

    size = len(lengths)
    grid = np.array([[score(inputs.text[j, :lengths[j]], inputs.image[i]) for j in range(size)]
                     for i in range(size)])
    neg_lengths = inputs.neg_text_mask.sum(-1)
    hard = np.array([[score(inputs.neg_text[i, k, :neg_lengths[i, k]], inputs.image[i])
                      for k in range(inputs.neg_text.shape[1])] for i in range(size)])
    return grid, hard


@pytest.mark.parametrize("kind,loss", [("tflocal", "infonce"), ("tflocal", "itm"), ("tfglobal", "infonce")])
def test_module_loss_equals_a_pair_by_pair_reference(shapes_root, feature_cache, tmp_path, kind, loss):  # noqa: F811
    cfg = aligner_config(shapes_root, tmp_path, feature_cache, f"method.name={kind}", f"method.aligner_loss={loss}")
    module = build(kind, cfg).train()
    batch = feature_batch(module, cfg)
    terms, report = module.compute_terms(batch)
    with torch.no_grad():
        grid, hard = pairwise_reference(module, aligner_inputs(batch, module.kind))
    assert hard.shape == (8, NEGATIVES)
    name, reference = {"infonce": ("itc_loss", reference_infonce), "itm": ("itm_loss", reference_itm)}[loss]
    assert terms[name].item() == pytest.approx(reference(grid, hard), rel=1e-4)
    accuracy = np.mean(np.argmax(np.concatenate([grid, hard], 1), 1) == np.arange(8))
    assert report["align/i2t_accuracy"].item() == pytest.approx(accuracy)


def test_in_batch_negative_subset_scores_the_hardest_pairs_only(shapes_root, feature_cache, tmp_path):  # noqa: F811
    cfg = aligner_config(shapes_root, tmp_path, feature_cache)
    module = build("tflocal", cfg).train()
    module.in_batch_negatives = 1  # method.aligner_negatives (proposed config field)
    batch = feature_batch(module, cfg)
    inputs = aligner_inputs(batch, "local")
    grid, hard = module.score_batch(inputs)
    cosine = F.normalize(batch["image_global"], dim=-1) @ F.normalize(batch["text_global"], dim=-1).T
    off = cosine - 10 * torch.eye(8)
    expected = torch.eye(8, dtype=torch.bool)
    for i in range(8):
        expected[i, off[i].argmax()] = expected[off[:, i].argmax(), i] = True
    assert torch.equal(torch.isfinite(grid), expected)
    with torch.no_grad():
        full, full_hard = pairwise_reference(module, inputs)
    reference = reference_infonce(np.where(expected.numpy(), full, -np.inf), full_hard)
    assert module.objective(grid, hard).item() == pytest.approx(reference, rel=1e-4)


# ----- the feature cache ------------------------------------------------------------------------------------------
def test_cached_features_equal_the_frozen_encoders_on_images(shapes_root, feature_cache, tmp_path):  # noqa: F811
    cfg = aligner_config(shapes_root, tmp_path, feature_cache)
    module = build("tflocal", cfg)
    datamodule = features.FeatureDataModule.for_module(cfg, module)
    datamodule.setup("fit")
    cached = {int(s["caption_id"]): s for s in (datamodule.train_dataset[i] for i in range(5))}
    images = CocoCaptions(shapes_root / "annotations" / "captions_train.json", shapes_root / "images" / "train",
                          module.tokenizer, module.preprocess_val, num_hard_negatives=NEGATIVES)
    samples = [images[i] for i in range(len(images)) if images[i]["caption_id"] in cached]
    # The cache encodes a fixed choice of negatives (each caption's first K, cycled); the dataset draws at random.
    records = read_annotation_file(str(shapes_root / "annotations" / "captions_train.json"))
    fixed = module.tokenizer(features.negative_captions(records, NEGATIVES, Path("captions_train.json")))
    fixed = dict(zip((r.caption_id for r in records), fixed.view(len(records), NEGATIVES, -1)))
    for sample in samples:
        sample["neg_text"] = fixed[sample["caption_id"]]
    direct = module.encode_batch(torch.utils.data.default_collate(samples))
    for row, sample in enumerate(samples):
        stored = cached[sample["caption_id"]]
        length = int(sample["text"].argmax()) + 1  # SOT .. EOS
        assert stored["text_mask"].sum() == length and stored["text"].dtype == torch.float16
        # stored in float16: half an ulp is 2^-11 = 4.9e-4 of each value (4.8e-4 seen)
        assert_scaled_close(stored["text"][:length].float(), direct["text"][row, :length], 1e-3)
        assert_scaled_close(stored["image"].float(), direct["image"][row], 1e-3)
        torch.testing.assert_close(stored["text_global"], direct["text_global"][row], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stored["image_global"], direct["image_global"][row], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stored["neg_text_global"], direct["neg_text_global"][row], atol=1e-5, rtol=1e-5)
        assert not stored["text"][length:].any()  # zero padding beyond EOS


def test_a_different_backbone_does_not_read_the_cache(shapes_root, feature_cache, tmp_path):  # noqa: F811
    cfg = aligner_config(shapes_root, tmp_path, feature_cache, "seed=1")  # another random init
    module = build("tflocal", cfg)
    with pytest.raises(CacheError, match="python -m datamodules.features"):
        features.FeatureDataModule.for_module(cfg, module).prepare_data()


def test_an_interrupted_cache_job_resumes_and_redoes_only_unfinished_shards(shapes_root, tmp_path, monkeypatch):  # noqa: F811
    cache = tmp_path / "cache"
    cfg = tiny_config(shapes_root, tmp_path, "method.name=tflocal", f"data.features_cache={cache}",
                      "preprocess.shard_size=8", "data.val_annotations=null")  # 32 captions: 4 shards
    encode, calls = features.encode_shard, []

    def dies_after_two(*args):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the job is killed while encoding its third shard
        calls.append(args[1][0].caption_id)
        return encode(*args)

    monkeypatch.setattr(features, "encode_shard", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        features.run(cfg)
    (directory,) = [p for p in cache.iterdir() if p.is_dir()]
    with pytest.raises(CacheError, match="incomplete|no feature cache"):
        features.open_feature_cache(directory)
    finished = {p.name: p.stat().st_mtime_ns for p in directory.glob("shard-*.pt")}
    assert len(finished) == 2 and not list(directory.glob(".*.tmp"))  # atomic: no half-written file

    def counting(*args):
        calls.append(args[1][0].caption_id)
        return encode(*args)

    monkeypatch.setattr(features, "encode_shard", counting)
    manifest = features.run(cfg)["train"]
    assert len(calls) == 4 and manifest["complete"] and manifest["counts"]["captions"] == 32
    assert all(directory.joinpath(name).stat().st_mtime_ns == mtime for name, mtime in finished.items())
    victim = directory / "shard-00001-of-00004.pt"
    victim.write_bytes(victim.read_bytes()[:1000])  # a truncated shard is named on read and redone on rerun
    with pytest.raises(CacheError, match="shard-00001-of-00004.pt"):
        features.FeatureCaptions(features.open_feature_cache(directory))
    features.run(cfg)
    assert len(calls) == 5
    dataset = features.FeatureCaptions(features.open_feature_cache(directory))
    assert sorted(int(dataset[i]["caption_id"]) for i in range(len(dataset))) == sorted(
        json.loads((shapes_root / "annotations" / "captions_train.json").read_text())["annotations"][i]["id"]
        for i in range(32))


# ----- fit on cached features, export, scorer ---------------------------------------------------------------------
class RecordModes(L.Callback):
    """Modes of the backbone and the aligner, and the batch kind, at every train and validation batch."""

    def __init__(self):
        self.train, self.validation = [], []

    @staticmethod
    def _modes(module, batch) -> tuple:
        return (any(m.training for m in module.clip.modules()), module.aligner.training, is_feature_batch(batch))

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.train.append(self._modes(module, batch))

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0) -> None:
        self.validation.append(self._modes(module, batch))


@pytest.fixture(scope="module")
def trained_run(shapes_root, feature_cache, tmp_path_factory):  # noqa: F811
    """fit (the real entry point) on cached features, validating after steps 2 and 4 of 6."""
    runs = tmp_path_factory.mktemp("runs")
    cfg = aligner_config(shapes_root, runs, feature_cache, "trainer.max_steps=6", "trainer.val_check_interval=2",
                         "trainer.limit_val_batches=1")
    modes = RecordModes()
    with pytest.MonkeyPatch.context() as patch:  # until the lead registers the method and the DataModule
        patch.setitem(lightning_modules.METHODS, "tflocal", TFLocal)
        patch.setattr(fit, "build_datamodule", features.FeatureDataModule.for_module)
        trainer = fit.run(cfg, extra_callbacks=[modes])
    return trainer, modes, runs / cfg.experiment


def test_fit_reads_cached_features_and_keeps_the_backbone_in_eval_mode(trained_run):
    trainer, modes, run_dir = trained_run
    assert trainer.global_step == 6
    assert modes.train == [(False, True, True)] * 6  # steps after each validation included
    assert modes.validation and all(mode == (False, False, True) for mode in modes.validation)
    assert not any(m.training for m in trainer.lightning_module.clip.modules())
    metadata = json.loads((run_dir / "export" / "aligner.json").read_text())
    assert metadata["kind"] == "local" and metadata["backbone"]["model"] == TINY and metadata["global_step"] == 6


def test_the_export_scores_a_benchmark_end_to_end_as_the_module_does(trained_run, tmp_path):
    trainer, _, run_dir = trained_run
    module = trainer.lightning_module.eval()
    write_sugarcrepe(tmp_path / "sugarcrepe", n_items=14)
    benchmark = build_benchmark("sugarcrepe", tmp_path / "sugarcrepe")
    assert AlignerScorer.from_export(run_dir / "export").rerank_k == 16  # the run's method.rerank_k
    scorer = AlignerScorer.from_export(run_dir / "export", rerank_k=None)
    result = run_benchmark(benchmark, scorer)
    assert len(result.outcomes) == 14 and 0 <= result.aggregates["overall_micro"] <= 100
    item = benchmark.items()[0]
    pixels = torch.stack([module.preprocess_val(load_image(ref)) for ref in item.images])
    batch = module.encode_batch({"image": pixels, "text": module.tokenizer(item.texts)})
    inputs = aligner_inputs(batch, "local")
    with torch.no_grad():
        text, image = module.aligner.embed(inputs.text, TEXT), module.aligner.embed(inputs.image, IMAGE)
        rows, columns = torch.meshgrid(torch.arange(len(item.images)), torch.arange(len(item.texts)), indexing="ij")
        expected = module.aligner.score_pairs(text, inputs.text_mask, image, columns.flatten(), rows.flatten())
    # the scorer batches the pairs differently: float32 rounding of the aligner's forward, ~1e-6 relative
    assert_scaled_close(scorer.score(item.images, item.texts), expected.view(rows.shape).numpy(), 1e-5)
    assert scorer.describe()["kind"] == "local"


def test_the_export_reranks_retrieval_consistently_across_chunks(trained_run, tmp_path):
    _, _, run_dir = trained_run
    written = write_coco_retrieval(tmp_path / "coco", n_items=6)
    results = []
    for chunk_size in (2, 6):
        benchmark = build_benchmark("coco_retrieval", tmp_path / "coco", chunk_size=chunk_size, **written)
        results.append(run_benchmark(benchmark, AlignerScorer.from_export(run_dir / "export", rerank_k=3)))
    assert results[0].outcomes == results[1].outcomes and results[0].aggregates["captions"] == 31


def test_an_export_refuses_a_different_backbone(trained_run, tmp_path):
    _, _, run_dir = trained_run
    export = tmp_path / "export"
    shutil.copytree(run_dir / "export", export)
    other = build_model(TINY, None, str(Path(lightning_modules.__file__).parents[1] / "configs" / "models")).model
    torch.save(other.state_dict(), export / "open_clip.pt")
    with pytest.raises(ValueError, match="not the frozen CLIP the aligner was trained on"):
        AlignerScorer.from_export(export)


# ----- re-ranking on a hand-made case -----------------------------------------------------------------------------
# Frozen similarities (image rows, text columns; texts are one-hot, so cosine = row / |row|) and aligner scores.
SIMILARITY = np.array([[0.9, 0.8, 0.1, 0.0, 0.0, 0.3],
                       [0.1, 0.9, 0.8, 0.0, 0.2, 0.0],
                       [0.0, 0.1, 0.2, 0.9, 0.8, 0.0],
                       [0.2, 0.0, 0.0, 0.1, 0.9, 0.05]])
ALIGNER = np.array([[1.0, 2.0, 50.0, -1.0, 0.0, 0.5],
                    [0.0, -3.0, 4.0, 0.0, 0.0, 0.0],
                    [0.0, 0.0, 0.0, -2.0, 3.0, 0.0],
                    [0.0, 0.0, 0.0, 0.0, 7.0, 0.0]])
TEXTS = [f"t{j}" for j in range(6)]
GALLERY = [ImageRef(name) for name in "ABCD"]


class TableScorer(AlignerScorer):
    """The real re-ranking logic with hand-made embeddings and aligner scores (counting aligner calls)."""

    def __init__(self, rerank_k):
        built = build_model(TINY, None, str(Path(lightning_modules.__file__).parents[1] / "configs" / "models"))
        super().__init__(built.model, TokenAligner(64, 32, 1, 2), "local", built.tokenizer, None, rerank_k=rerank_k)
        self.image_global.add(GALLERY, torch.tensor(SIMILARITY, dtype=torch.float32))
        self.text_global.add(TEXTS, torch.eye(6))
        self.scored = []

    def _aligner_scores(self, pairs):
        self.scored += pairs
        return np.array([ALIGNER["ABCD".index(ref.path), int(text[1])] for ref, text in pairs])


def test_reranking_matches_a_hand_made_case_and_is_chunk_independent():
    scorer = TableScorer(rerank_k=2)
    scorer.prepare(GALLERY, TEXTS)
    full = scorer.score(GALLERY, TEXTS)
    cosine = SIMILARITY / np.linalg.norm(SIMILARITY, axis=1, keepdims=True)
    # By hand: A's 2 best texts are t0, t1; t5's 2 best images are A, D (t5 is not among A's best, but A is
    # among t5's); (A, t2) is in neither top-2, so even the highest aligner score (50) leaves it below.
    chosen = np.array([[1, 1, 0, 0, 0, 1], [0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1]], dtype=bool)
    expected = np.where(chosen, squash(ALIGNER), cosine - RERANK_SHIFT)
    assert_scaled_close(full, expected, 1e-6)  # float32 cosines and squashes of hand-made values
    assert full[0, 1] > full[0, 0] > full[0, 5] > full[0, 2]  # the aligner reorders A's top-2; t2 stays out
    assert full[:, 4].argmax() == 3 and full[0, 2] == pytest.approx(cosine[0, 2] - RERANK_SHIFT)
    assert len(scorer.scored) == chosen.sum()  # only re-ranked pairs reach the aligner, each once
    rows = np.concatenate([scorer.score(GALLERY[i:i + 1], TEXTS) for i in range(4)])
    np.testing.assert_array_equal(rows, full)  # one image per call: the same scores (the gallery is prepared)
    assert len(scorer.scored) == chosen.sum()
    caption_image = np.array([0, 1, 1, 2, 3, 0])
    ranks = [retrieval_ranks(lambda a, b: scorer.score(GALLERY[a:b], TEXTS), caption_image, 4, size)
             for size in (1, 4)]
    assert all(np.array_equal(x, y) for x, y in zip(ranks[0], ranks[1]))


def test_few_candidates_are_scored_directly_in_both_modes():
    direct, reranking = TableScorer(rerank_k=None), TableScorer(rerank_k=16)
    for scorer in (direct, reranking):
        scorer.prepare(GALLERY, TEXTS)
    np.testing.assert_allclose(direct.score(GALLERY[:1], TEXTS), ALIGNER[:1])
    np.testing.assert_allclose(reranking.score(GALLERY[:1], TEXTS), squash(ALIGNER[:1]))


@pytest.mark.parametrize("rerank_k", [None, 2])
def test_identical_candidates_get_bit_identical_aligner_scores(rerank_k):
    scorer = TableScorer(rerank_k=rerank_k)
    scorer.prepare(GALLERY, TEXTS)
    texts = ["t1", "t0", "t1", "t4", "t0"]
    result = scorer.score([GALLERY[0], GALLERY[3], GALLERY[0]], texts)
    assert (result[:, 0] == result[:, 2]).all() and (result[:, 1] == result[:, 4]).all()
    assert (result[0] == result[2]).all()
    assert len(scorer.scored) == len(set(scorer.scored))  # each distinct pair reaches the aligner once


def test_token_identical_candidates_are_one_candidate_of_the_aligner():
    """"t1" and "T1" are different strings with the same CLIP token ids (the tokenizer lowercases): scored once,
    bit-identical, as one candidate."""
    scorer = TableScorer(rerank_k=None)
    scorer.prepare(GALLERY, TEXTS)
    assert scorer.text_keys(["t1"]) == scorer.text_keys(["T1"]) != scorer.text_keys(["t2"])
    result = scorer.score(GALLERY[:2], ["t1", "t2", "T1"])
    assert (result[:, 0] == result[:, 2]).all()
    assert sorted(text for _, text in scorer.scored) == ["t1", "t1", "t2", "t2"]  # "T1" never reaches the aligner
