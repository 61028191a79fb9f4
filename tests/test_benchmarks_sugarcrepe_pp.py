"""SugarCrepe++: the official files, the ITT / TOT rule with exact ties, and parity with the authors' scoring loop."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.benchmarks.base import MissingBenchmarkData
from evaluation.benchmarks.sugarcrepe_pp import METRICS, SUBSETS, SugarCrepePP, triplet_scores
from evaluation.scorers import ClipScorer, FunctionScorer
from testkit.standin.images import write_image
from testkit.standin.sugarcrepe_pp import write_sugarcrepe_pp

FIXTURE = Path(__file__).resolve().parent / "data" / "benchmarks" / "sugarcrepe_pp"
FIXTURE_COUNTS = {"swap_obj": 40, "swap_att": 40, "replace_obj": 40, "replace_att": 40, "replace_rel": 41}


def _hashed(*parts: str) -> float:
    """A value in {0.0, 0.1, ..., 1.0} from the parts: deterministic, and full of exact ties."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return round(digest[0] / 255, 1)


def image_text(image_path: str, text: str) -> float:
    return _hashed(Path(image_path).name, text)


def text_text(first: str, second: str) -> float:
    """Symmetric, and 1 for a text with itself, as a cosine is."""
    return 1.0 if first == second else _hashed(*sorted((first, second)))


class HashScorer(FunctionScorer):
    """`image_text` for images and texts, `text_text` for the text-only comparisons."""

    def __init__(self):
        super().__init__(lambda ref, text: image_text(ref.path, text))

    def text_similarity(self, first, second):
        return np.array([text_text(a, b) for a, b in zip(first, second)])


def official_scores(data_path: str, img_path: str, cos_image_text, cos_text_text):
    """The authors' loop (`VLMs/test_Variants_CLIP.py`, Sri-Harsha/scpp c083bbf), step by step: every file of the
    data folder, every record in order, four counters over strict `>`, correct / total per file.

    Returns:
        ({subset: {"itt", "image_p1_neg", "image_p2_neg", "tot"} as fractions}, {"<subset>/<id>": per-item bools}).
    """
    results, per_item = {}, {}
    for fname in os.listdir(data_path):
        total = correct_full = correct_img_p1 = correct_img_p2 = correct_text = 0
        with open(os.path.join(data_path, fname)) as f:
            data = json.load(f)
        for line in data:
            p1, neg, p2 = line["caption"], line["negative_caption"], line["caption2"]
            ipath = os.path.join(img_path, line["filename"])
            cos_p1, cos_p2, cos_neg = (cos_image_text(ipath, text) for text in (p1, p2, neg))
            cos_p1p2, cos_p1_neg, cos_p2_neg = cos_text_text(p1, p2), cos_text_text(p1, neg), cos_text_text(p2, neg)
            total += 1
            full = cos_p1 > cos_neg and cos_p2 > cos_neg
            text = cos_p1p2 > cos_p1_neg and cos_p1p2 > cos_p2_neg
            correct_full += full
            correct_img_p1 += cos_p1 > cos_neg
            correct_img_p2 += cos_p2 > cos_neg
            correct_text += text
            per_item[f"{fname[:-len('.json')]}/{line['id']}"] = {
                "itt": full, "image_p1_neg": cos_p1 > cos_neg, "image_p2_neg": cos_p2 > cos_neg, "tot": text}
        results[fname[:-len(".json")]] = {"itt": correct_full / total, "image_p1_neg": correct_img_p1 / total,
                                          "image_p2_neg": correct_img_p2 / total, "tot": correct_text / total}
    return results, per_item


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)


def _fixture_copy(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURE / "data", tmp_path / "data")
    return tmp_path


# ---------------------------------------------------------------- loading


def test_standin_reads_back_ids_texts_images_and_meta(tmp_path):
    benchmark = SugarCrepePP(tmp_path, **write_sugarcrepe_pp(tmp_path, n_items=20, seed=0))
    items = benchmark.items()
    assert [item.id for item in items] == [f"{subset}/{k}" for subset in SUBSETS for k in range(4)]
    records = json.loads((tmp_path / "data" / "replace_obj.json").read_text())
    item = items[SUBSETS.index("replace_obj") * 4 + 2]
    assert item.texts == [records[2]["caption"], records[2]["caption2"], records[2]["negative_caption"]]
    assert item.images[0].path == str(tmp_path / "images" / records[2]["filename"])
    assert item.meta == {"subset": "replace_obj", "image": records[2]["filename"]}
    assert all(Path(ref.path).is_file() for ref in benchmark.image_refs())
    swap_obj_1, replace_att_1 = items[1], items[SUBSETS.index("replace_att") * 4 + 1]
    assert swap_obj_1.texts[0] == swap_obj_1.texts[2] and replace_att_1.texts[0] == replace_att_1.texts[1]
    assert (tmp_path / "data" / "swap_att.json").read_text().startswith('[\n {\n  "id":0,\n  "filename":"')


def test_standin_writes_thousands_of_items(tmp_path):
    benchmark = SugarCrepePP(tmp_path, **write_sugarcrepe_pp(tmp_path, n_items=3000, seed=3))
    assert len(benchmark.items()) == 3000 and len({item.id for item in benchmark.items()}) == 3000


def test_fixture_reads_every_record_in_paper_order_with_the_images_option(tmp_path):
    benchmark = SugarCrepePP(FIXTURE, images=tmp_path / "coco")
    items = benchmark.items()
    assert [s for s in dict.fromkeys(item.meta["subset"] for item in items)] == list(SUBSETS)
    assert {s: sum(item.meta["subset"] == s for item in items) for s in SUBSETS} == FIXTURE_COUNTS
    first = items[0]
    assert first.id == "swap_obj/0" and first.images[0].path == str(tmp_path / "coco" / "000000222235.jpg")
    assert first.texts == ["A cat sits on its hind legs, and swats at the plant.",
                           "The cat swats at the plant while sitting on its hind legs.",
                           "A cat sits on the plant, and swats at its hind legs."]
    by_id = {item.id: item for item in items}
    assert by_id["swap_obj/2"].texts[0] == by_id["swap_obj/2"].texts[2]  # the release's P1 == N records
    assert by_id["swap_obj/8"].texts[0] == by_id["swap_obj/8"].texts[2]
    assert by_id["replace_att/14"].texts[0] == by_id["replace_att/14"].texts[1]
    assert by_id["replace_rel/369"].texts[0] == "A  group of kids in suits holding a chalkboard."
    assert SugarCrepePP(FIXTURE).items()[0].images[0].path == str(FIXTURE / "images" / "000000222235.jpg")
    assert 222235 in benchmark.coco_image_ids()


def test_missing_files_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match=re.escape("data/swap_obj.json")):
        SugarCrepePP(tmp_path)
    _fixture_copy(tmp_path)
    (tmp_path / "data" / "replace_rel.json").unlink()
    with pytest.raises(MissingBenchmarkData, match=r"lacks data/replace_rel\.json"):
        SugarCrepePP(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda records: records[3].pop("caption2"), r"swap_obj\.json: record 3 \(id 3\) lacks a string 'caption2'"),
    (lambda records: records[5].update(id="5"), r"swap_obj\.json: record 5 lacks an integer 'id'"),
    (lambda records: records[6].update(id=True), r"swap_obj\.json: record 6 lacks an integer 'id'"),
    (lambda records: records[7].update(id=0), r"swap_obj\.json: record 7: id 0 repeats"),
    (lambda records: records.__setitem__(1, ["not", "a", "record"]), r"swap_obj\.json: record 1 is not a JSON object"),
])
def test_malformed_records_name_the_file_and_record(tmp_path, edit, message):
    path = _fixture_copy(tmp_path) / "data" / "swap_obj.json"
    records = json.loads(path.read_text())
    edit(records)
    path.write_text(json.dumps(records))
    with pytest.raises(ValueError, match=message):
        SugarCrepePP(tmp_path).items()


def test_truncated_non_utf8_and_non_list_files_name_the_file(tmp_path):
    path = _fixture_copy(tmp_path) / "data" / "replace_att.json"
    original = path.read_bytes()
    path.write_bytes(original[: len(original) // 2])
    with pytest.raises(ValueError, match=r"replace_att\.json: not a (UTF-8 text|whole JSON) file"):
        SugarCrepePP(tmp_path).items()
    path.write_bytes(original.replace(b"toilet", "toilet\u00e9".encode("latin-1"), 1))
    with pytest.raises(ValueError, match=r"replace_att\.json: not a (UTF-8 text|whole JSON) file"):
        SugarCrepePP(tmp_path).items()
    path.write_text('{"0": {}}')
    with pytest.raises(ValueError, match=r"replace_att\.json: expected a JSON list of records, found dict"):
        SugarCrepePP(tmp_path).items()


def test_downloads_are_the_five_files_pinned_at_the_commit():
    downloads = SugarCrepePP.data_source.downloads
    assert [d.target for d in downloads] == SugarCrepePP(FIXTURE).required_files()
    for download in downloads:
        assert download.url == ("https://raw.githubusercontent.com/Sri-Harsha/scpp/"
                                f"c083bbf039a5ca215acaf25e7ee736d2ea6f3864/{download.target}")
    assert sum(d.size for d in downloads) == 1348431
    assert "val2017.zip" in SugarCrepePP.data_source.by_hand


# ---------------------------------------------------------------- the rule


def test_rule_on_hand_made_similarities_with_exact_ties():
    right = triplet_scores(np.array([[0.3, 0.25, 0.2]]), (0.9, 0.5, 0.4))
    assert right == {"itt": True, "image_p1_neg": True, "image_p2_neg": True, "tie_itt": False,
                     "tot": True, "tie_tot": False, "tie": False}
    p2_ties = triplet_scores(np.array([[0.3, 0.2, 0.2]]), (0.9, 0.5, 0.4))
    assert (p2_ties["itt"], p2_ties["image_p1_neg"], p2_ties["image_p2_neg"]) == (False, True, False)
    assert p2_ties["tie_itt"] and p2_ties["tie"] and not p2_ties["tie_tot"]
    p1_loses = triplet_scores(np.array([[0.1, 0.3, 0.2]]), (0.9, 0.5, 0.4))
    assert (p1_loses["itt"], p1_loses["image_p1_neg"], p1_loses["image_p2_neg"]) == (False, False, True)
    text_tie = triplet_scores(np.array([[0.3, 0.25, 0.2]]), (0.5, 0.4, 0.5))  # s(P1,P2) == s(P2,N)
    assert text_tie["itt"] and not text_tie["tot"] and text_tie["tie_tot"] and text_tie["tie"]
    text_lose = triplet_scores(np.array([[0.3, 0.25, 0.2]]), (0.5, 0.6, 0.1))  # s(P1,N) beats s(P1,P2)
    assert not text_lose["tot"] and not text_lose["tie_tot"]
    unscored = triplet_scores(np.array([[0.3, 0.25, 0.2]]), None)
    assert unscored["tot"] is None and unscored["tie_tot"] is None and not unscored["tie"]


def test_official_rule_equals_ours_on_every_item_of_the_real_sample(tmp_path):
    root = _fixture_copy(tmp_path)
    benchmark = SugarCrepePP(root, images=tmp_path / "images")
    outcomes = benchmark.outcomes(HashScorer())
    official, per_item = official_scores(str(root / "data"), str(tmp_path / "images"), image_text, text_text)
    assert [o["id"] for o in outcomes] == [item.id for item in benchmark.items()]
    assert {o["id"] for o in outcomes} == set(per_item)
    for outcome in outcomes:
        assert {metric: outcome[metric] for metric in METRICS} == per_item[outcome["id"]], outcome["id"]
    result = SugarCrepePP.aggregate(outcomes)
    for subset, accuracies in official.items():
        for metric, fraction in accuracies.items():
            assert result[f"{metric}/{subset}"] == pytest.approx(100.0 * fraction), (metric, subset)
    assert result["ties_itt"] > 20 and result["ties_tot"] > 20  # the scorer ties often; the test must see it
    for key in ("swap_obj/2", "swap_obj/8"):  # negative == P1: a tie in both tasks, so wrong
        outcome = next(o for o in outcomes if o["id"] == key)
        assert outcome["tie_itt"] and outcome["tie_tot"] and not outcome["itt"] and not outcome["tot"]


def test_official_rule_equals_ours_on_the_standin(tmp_path):
    benchmark = SugarCrepePP(tmp_path, **write_sugarcrepe_pp(tmp_path, n_items=60, seed=4))
    outcomes = benchmark.outcomes(HashScorer())
    official, per_item = official_scores(str(tmp_path / "data"), str(tmp_path / "images"), image_text, text_text)
    assert all({m: o[m] for m in METRICS} == per_item[o["id"]] for o in outcomes)
    result = SugarCrepePP.aggregate(outcomes)
    assert all(result[f"{m}/{s}"] == pytest.approx(100.0 * f) for s, acc in official.items() for m, f in acc.items())


def test_aggregates_by_hand_micro_macro_ties_and_empty_subsets():
    def outcome(subset, itt, tot, tie=False):
        return {"id": f"{subset}/{itt}{tot}{tie}", "subset": subset, "itt": itt, "image_p1_neg": True,
                "image_p2_neg": itt, "tot": tot, "tie_itt": tie, "tie_tot": False, "tie": tie}

    outcomes = [outcome("swap_obj", True, True), outcome("swap_obj", False, True, tie=True),
                outcome("swap_obj", False, False)] + [outcome(s, True, False) for s in SUBSETS[1:]]
    result = SugarCrepePP.aggregate(outcomes)
    assert result["itt/swap_obj"] == pytest.approx(100 / 3) and result["tot/swap_obj"] == pytest.approx(200 / 3)
    assert result["itt_micro"] == pytest.approx(100 * 5 / 7) and result["itt_macro"] == pytest.approx(
        (100 / 3 + 400) / 5)
    assert result["tot_micro"] == pytest.approx(100 * 2 / 7) and result["tot_macro"] == pytest.approx(200 / 3 / 5)
    assert result["image_p1_neg_macro"] == 100.0
    assert (result["n"], result["n/swap_obj"], result["ties"], result["ties_itt"], result["tot_unscored"]) == (
        7.0, 3.0, 1.0, 1.0, 0.0)
    partial = SugarCrepePP.aggregate(outcomes[:3])  # four subsets without items: NaN, and so is every macro
    assert math.isnan(partial["itt/replace_rel"]) and math.isnan(partial["itt_macro"])
    assert partial["itt_micro"] == pytest.approx(100 / 3)


def test_aggregates_recompute_from_json_round_tripped_outcomes(tmp_path):
    benchmark = SugarCrepePP(tmp_path, **write_sugarcrepe_pp(tmp_path, n_items=40, seed=2))
    outcomes = benchmark.outcomes(HashScorer())
    stored = [json.loads(json.dumps(o)) for o in outcomes]
    direct, again = SugarCrepePP.aggregate(outcomes), SugarCrepePP.aggregate(stored)
    assert direct.keys() == again.keys() and set(SugarCrepePP.headline) <= set(direct)
    assert all(same(direct[key], again[key]) for key in direct)


def test_a_scorer_without_text_embeddings_gets_itt_and_no_tot(tmp_path, caplog):
    benchmark = SugarCrepePP(tmp_path, **write_sugarcrepe_pp(tmp_path, n_items=15, seed=1))
    with caplog.at_level(logging.WARNING):
        outcomes = benchmark.outcomes(FunctionScorer(lambda ref, text: image_text(ref.path, text)))
    assert "TOT (text-only) not scored for 15 items" in caplog.text
    assert all(o["tot"] is None and o["tie_tot"] is None for o in outcomes)
    result = SugarCrepePP.aggregate(outcomes)
    assert result["tot_unscored"] == 15 and math.isnan(result["tot/swap_obj"]) and math.isnan(result["tot_micro"])
    with_text = SugarCrepePP.aggregate(benchmark.outcomes(HashScorer()))
    assert all(result[f"itt/{s}"] == with_text[f"itt/{s}"] for s in SUBSETS)


# ---------------------------------------------------------------- end to end with a tiny CLIP


def test_tiny_clip_matches_the_rule_on_its_own_embeddings_with_exact_ties(tmp_path):
    """Real sample texts, generated images under the real names: ITT from the image-text matrix, TOT from the
    text tower alone, and the release's degenerate triplets tie exactly (P1 == N; P2 == P1 up to a space)."""
    root = _fixture_copy(tmp_path)
    benchmark = SugarCrepePP(root)
    for index, name in enumerate(sorted({item.meta["image"] for item in benchmark.items()})):
        write_image(root / "images" / name, seed=index, size=(64, 64))
    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained("ViT-Tiny-16-64", None, batch_size=64)
    outcomes = {o["id"]: o for o in benchmark.outcomes(scorer)}
    for item in benchmark.items():
        image = scorer.image_embeddings(item.images)[0]
        p1, p2, negative = scorer.text_embeddings(item.texts)
        expected_pairs = {"image_p1_neg": (image @ p1, image @ negative),
                          "image_p2_neg": (image @ p2, image @ negative),
                          "tot_vs_p1": (p1 @ p2, p1 @ negative), "tot_vs_p2": (p1 @ p2, p2 @ negative)}
        got = outcomes[item.id]
        won = {name: bool(a > b) for name, (a, b) in expected_pairs.items()}
        clear = {name: abs(float(a - b)) > 1e-5 for name, (a, b) in expected_pairs.items()}
        for name in ("image_p1_neg", "image_p2_neg"):
            assert not clear[name] or got[name] == won[name], (item.id, name)
        if clear["tot_vs_p1"] and clear["tot_vs_p2"]:
            assert got["tot"] == (won["tot_vs_p1"] and won["tot_vs_p2"]), item.id
        assert got["itt"] == (got["image_p1_neg"] and got["image_p2_neg"])
    for key in ("swap_obj/2", "swap_obj/8"):
        assert outcomes[key]["tie_itt"] and outcomes[key]["tie_tot"]
        assert not outcomes[key]["itt"] and not outcomes[key]["tot"] and not outcomes[key]["image_p1_neg"]
    for key in ("replace_att/14", "replace_rel/369"):  # P1 and P2 are one text to CLIP: equal comparisons
        assert outcomes[key]["image_p1_neg"] == outcomes[key]["image_p2_neg"]
    result = SugarCrepePP.aggregate(list(outcomes.values()))
    assert result["n"] == 201 and result["tot_unscored"] == 0 and result["ties"] >= 2
