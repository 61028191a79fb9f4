"""Cola: the official multi-object file, the matching rule with exact ties, single-object mAP, and parity with the
authors' `scripts/eval.py`."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.benchmarks.base import COCO, OTHER, VISUAL_GENOME, MissingBenchmarkData
from evaluation.benchmarks.cola import (MULTI_OBJECT_FILE, SUBSETS, ColaMultiObject, ColaSingleObject,
                                        average_precision, multi_object_scores, single_object_file)
from evaluation.scorers import FunctionScorer
from testkit.standin.cola import (ABSENT, NO_HARD, NO_POSITIVE_HARD, write_cola_multi_object,
                                  write_cola_single_object)

FIXTURE = Path(__file__).resolve().parent / "data" / "benchmarks" / "cola"


def hashed(image_name: str, text: str) -> float:
    """A value in {0.0, 0.1, ..., 1.0} from an image name and a text: deterministic, and full of exact ties."""
    digest = hashlib.sha256(f"{image_name}\x1f{text}".encode()).digest()
    return round(digest[0] / 255, 1)


def hash_scorer() -> FunctionScorer:
    return FunctionScorer(lambda ref, text: hashed(Path(ref.path).name, text))


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)


def _fixture_copy(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURE / "data", tmp_path / "data")
    return tmp_path


# ---------------------------------------------------------------- multi-object: loading


def test_multi_object_standin_reads_back_ids_captions_and_images(tmp_path):
    options = write_cola_multi_object(tmp_path, n_items=25, seed=1)
    benchmark = ColaMultiObject(tmp_path, **options)
    records = json.loads((tmp_path / MULTI_OBJECT_FILE).read_text())
    items = benchmark.items()
    assert [item.id for item in items] == [str(k) for k in range(25)]
    assert [item.texts for item in items] == [[r[1], r[3]] for r in records]
    assert [[ref.path for ref in item.images] for item in items] == \
        [[str(tmp_path / "images" / r[k].rsplit("/", 1)[1]) for k in (0, 2)] for r in records]
    assert all(Path(ref.path).is_file() for item in items for ref in item.images)
    assert all(item.images[0] != item.images[1] for item in items)
    assert ColaMultiObject(tmp_path).items()[3].images == items[3].images  # default images folder


def test_multi_object_standin_writes_thousands_of_items(tmp_path):
    benchmark = ColaMultiObject(tmp_path, **write_cola_multi_object(tmp_path, n_items=3000))
    assert len(benchmark.items()) == 3000 and len({item.id for item in benchmark.items()}) == 3000


def test_the_official_file_reads_210_items_over_218_visual_genome_images(tmp_path):
    root = _fixture_copy(tmp_path)
    benchmark = ColaMultiObject(root, images=tmp_path / "gqa_images")
    items = benchmark.items()
    assert len(items) == 210
    assert items[0].texts == ["standing tall long giraffe to the right of brown giraffe",
                              "brown giraffe behind tall white giraffe"]
    assert [ref.path for ref in items[0].images] == [str(tmp_path / "gqa_images" / "2390970.jpg"),
                                                    str(tmp_path / "gqa_images" / "2388902.jpg")]
    refs = benchmark.image_refs()
    assert len(refs) == 218
    origins = [benchmark.image_origin(ref) for ref in refs]
    assert {origin.source for origin in origins} == {VISUAL_GENOME}  # the leakage guard sees their VG ids
    assert origins[0].id == 2390970 and benchmark.coco_image_ids() == set()


def test_the_download_is_the_fixture_file_pinned_at_the_commit():
    (download,) = ColaMultiObject.data_source.downloads
    data = (FIXTURE / MULTI_OBJECT_FILE).read_bytes()
    assert download.target == MULTI_OBJECT_FILE
    assert download.url == ("https://raw.githubusercontent.com/arijitray1993/COLA/"
                            "1fa52fba9cff4e6ffb7bfcf3550838748347273b/data/COLA_multiobjects_matching_benchmark.json")
    assert (download.size, download.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert "vg_gqa_images" in ColaMultiObject.data_source.by_hand and dict(ColaMultiObject.published) == {}


def test_missing_and_malformed_multi_object_files_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match=r"lacks data/COLA_multiobjects_matching_benchmark\.json"):
        ColaMultiObject(tmp_path)
    path = _fixture_copy(tmp_path) / MULTI_OBJECT_FILE
    records = json.loads(path.read_text())
    for bad, message in ((records[:4] + [records[4][:3]], r"record 4 is not \[image 0 URL, caption 0"),
                         (records[:2] + [[records[2][0], 7, records[2][2], "x"]], "record 2 is not"),
                         (records[:1] + [["https://host/", "a", "https://host/1.jpg", "b"]],
                          "record 1 has an image URL without a file name"),
                         ({"0": records[0]}, "expected a JSON list of records, found dict")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"COLA_multiobjects_matching_benchmark\.json: " + message):
            ColaMultiObject(tmp_path).items()
    original = (FIXTURE / MULTI_OBJECT_FILE).read_bytes()
    for broken in (original[: len(original) // 2], original.replace(b"giraffe", "girafe\u00e9".encode("latin-1"), 1)):
        path.write_bytes(broken)
        with pytest.raises(ValueError,
                           match=r"COLA_multiobjects_matching_benchmark\.json: not a (UTF-8 text|whole JSON) file"):
            ColaMultiObject(tmp_path).items()


# ---------------------------------------------------------------- multi-object: the rule


def test_multi_object_rule_on_hand_made_matrices_with_exact_ties():
    # s[image i, caption j]; correct iff each caption scores its own image higher
    assert multi_object_scores(np.array([[0.9, 0.1], [0.2, 0.8]])) == \
        {"correct": True, "caption_0": True, "caption_1": True, "tie": False}
    # both images prefer caption 0 (text side wrong), yet each caption picks its image: correct
    assert multi_object_scores(np.array([[0.9, 0.3], [0.8, 0.4]]))["correct"] is True
    # caption 1 prefers image 0
    assert multi_object_scores(np.array([[0.9, 0.5], [0.2, 0.4]])) == \
        {"correct": False, "caption_0": True, "caption_1": False, "tie": False}
    tie = multi_object_scores(np.array([[0.5, 0.1], [0.5, 0.9]]))  # caption 0 ties between the images
    assert tie == {"correct": False, "caption_0": False, "caption_1": True, "tie": True}
    # a tie on the text side does not enter the rule
    assert multi_object_scores(np.array([[0.5, 0.5], [0.1, 0.9]]))["tie"] is False


def official_multi_object(records: list, similarity) -> tuple[list[bool], float]:
    """`scripts/eval.py` (arijitray1993/COLA 1fa52fb), step by step: per record a 2x2 `preds` with rows the images
    and columns the captions, `ColaMultiObjAcc`, then `np.mean` of the booleans."""
    def cola_multi_obj_acc(preds):
        im0_c0, im0_c1, im1_c0, im1_c1 = preds[0, 0], preds[0, 1], preds[1, 0], preds[1, 1]
        return im0_c0 > im1_c0 and im1_c1 > im0_c1

    batch_acc = []
    for image_1, caption_1, image_2, caption_2 in records:
        preds = np.array([[similarity(image_1, caption_1), similarity(image_1, caption_2)],
                          [similarity(image_2, caption_1), similarity(image_2, caption_2)]])
        batch_acc.append(bool(cola_multi_obj_acc(preds)))
    return batch_acc, float(np.mean(batch_acc))


def _url_similarity(url: str, caption: str) -> float:
    return hashed(url.rsplit("/", 1)[1], caption)


@pytest.mark.parametrize("source", ["fixture", "standin"])
def test_official_rule_equals_ours_on_every_item(tmp_path, source):
    root = _fixture_copy(tmp_path) if source == "fixture" else tmp_path
    options = write_cola_multi_object(tmp_path, n_items=300, seed=3) if source == "standin" else {}
    benchmark = ColaMultiObject(root, **options)
    outcomes = benchmark.outcomes(hash_scorer())
    per_item, accuracy = official_multi_object(json.loads((root / MULTI_OBJECT_FILE).read_text()), _url_similarity)
    assert [o["correct"] for o in outcomes] == per_item
    result = ColaMultiObject.aggregate(outcomes)
    assert result["accuracy"] == pytest.approx(100.0 * accuracy) and result["n"] == len(per_item)
    assert result["ties"] >= 20  # the scorer ties often; the test must see ties decide outcomes
    assert not any(o["correct"] for o in outcomes if o["tie"])


def test_multi_object_aggregates_by_hand_and_from_json_round_tripped_outcomes(tmp_path):
    outcomes = [{"id": "0", "correct": True, "tie": False}, {"id": "1", "correct": False, "tie": True},
                {"id": "2", "correct": False, "tie": False}, {"id": "3", "correct": True, "tie": False}]
    assert ColaMultiObject.aggregate(outcomes) == {"accuracy": 50.0, "ties": 1.0, "n": 4.0}
    assert math.isnan(ColaMultiObject.aggregate([])["accuracy"])
    benchmark = ColaMultiObject(tmp_path, **write_cola_multi_object(tmp_path, n_items=40))
    stored = benchmark.outcomes(hash_scorer())
    again = ColaMultiObject.aggregate([json.loads(json.dumps(o)) for o in stored])
    assert again == ColaMultiObject.aggregate(stored)


# ---------------------------------------------------------------- single-object: loading


def test_single_object_standin_reads_every_form_and_skips_as_the_official_code(tmp_path):
    options = write_cola_single_object(tmp_path, n_items=12, seed=2)
    benchmark = ColaSingleObject(tmp_path, **options)
    assert benchmark.subsets() == list(SUBSETS)
    items = benchmark.items()
    ids = [item.id for item in items]
    # labels no image has, and labels without hard images, are not items; GQA's all-negative label is
    assert not any(i.endswith((f"/{ABSENT}", f"/{NO_HARD}")) for i in ids)
    assert f"GQA/{NO_POSITIVE_HARD}" in ids and f"CLEVR/{NO_POSITIVE_HARD}" in ids
    gqa = json.loads((tmp_path / single_object_file("GQA")).read_text())
    item = next(i for i in items if i.id == "GQA/3")
    hard = [k for k, record in enumerate(gqa["data"]) if record[3][3] == 1]
    assert [ref.path for ref in item.images] == \
        [str(tmp_path / "images" / "GQA" / gqa["data"][k][0].rsplit("/", 1)[1]) for k in hard]
    assert item.meta["targets"] == [bool(gqa["data"][k][2][3]) for k in hard]
    # labels as [[attributes], object] pairs (GQA) and as captions (CLEVR) read the same
    assert next(i for i in items if i.id == "GQA/4").texts == ["black shiny car"]
    assert next(i for i in items if i.id == "CLEVR/4").texts == ["black shiny car"]
    assert next(i for i in items if i.id == "PACO/4").texts == ["black shiny car"]  # records without annotation
    assert all(Path(ref.path).is_file() for i in items for ref in i.images)


def test_single_object_image_origins_gqa_is_visual_genome_paco_coco(tmp_path):
    benchmark = ColaSingleObject(tmp_path, **write_cola_single_object(tmp_path, n_items=6))
    by_subset = {subset: {benchmark.image_origin(ref).source for ref in benchmark.image_refs()
                          if Path(ref.path).parent.name == subset} for subset in SUBSETS}
    assert by_subset == {"GQA": {VISUAL_GENOME}, "CLEVR": {OTHER}, "PACO": {COCO}}


def test_single_object_reads_the_subsets_present_and_needs_one(tmp_path):
    with pytest.raises(MissingBenchmarkData, match=r"COLA_singleobjects_benchmark_GQA\.json \| "):
        ColaSingleObject(tmp_path)
    write_cola_single_object(tmp_path, n_items=5)
    (tmp_path / single_object_file("CLEVR")).unlink()
    benchmark = ColaSingleObject(tmp_path)
    assert benchmark.subsets() == ["GQA", "PACO"]
    result = ColaSingleObject.aggregate(benchmark.outcomes(hash_scorer()))
    assert math.isnan(result["CLEVR"]) and result["labels/CLEVR"] == 0 and not math.isnan(result["GQA"])


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["data"][2][2].append(0), r"record 2: label must be a list of 6 numbers"),
    (lambda c: c["data"][1][3].__setitem__(4, 2), r"record 1: hard_list values must be 0 or 1"),
    (lambda c: c["data"][0][2].__setitem__(0, "1"), r"record 0: label must be a list of 6 numbers"),
    (lambda c: c["data"].__setitem__(3, ["x.jpg", [0] * 6]), r"record 3 is not \[image_file"),
    (lambda c: c["labels"].__setitem__(1, ["red", "table"]), r"label 1: a label is a caption or"),
    (lambda c: c.pop("data"), r"expected the keys 'labels' and 'data'"),
])
def test_malformed_single_object_files_name_the_file_and_record(tmp_path, edit, message):
    write_cola_single_object(tmp_path, n_items=5)
    path = tmp_path / single_object_file("GQA")
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"COLA_singleobjects_benchmark_GQA\.json: " + message):
        ColaSingleObject(tmp_path).items()
    path.write_text(json.dumps([["a label"], [], []]))
    with pytest.raises(ValueError, match=r"GQA\.json: expected \{'labels': \[\.\.\.\], 'data'"):
        ColaSingleObject(tmp_path).items()
    path.write_bytes(b'{"labels": ["a"], "da')
    with pytest.raises(ValueError, match=r"GQA\.json: not a (UTF-8 text|whole JSON) file"):
        ColaSingleObject(tmp_path).items()


# ---------------------------------------------------------------- single-object: average precision


def naive_average_precision(scores, targets) -> float:
    """Per positive, the precision among the items scoring at least as high; their mean (ties: one threshold)."""
    scores, targets = list(map(float, scores)), list(map(bool, targets))
    precisions = [sum(t for s2, t in zip(scores, targets) if s2 >= s) / sum(s2 >= s for s2 in scores)
                  for s, t in zip(scores, targets) if t]
    return sum(precisions) / len(precisions) if precisions else float("nan")


def test_average_precision_by_hand_with_ties():
    # ranked 0.5 (neg); {0.3 pos, 0.3 neg} one threshold: P = 1/3; 0.1 pos: P = 2/4
    assert average_precision([0.3, 0.3, 0.5, 0.1], [1, 0, 0, 1]) == pytest.approx(0.5 * (1 / 3) + 0.5 * 0.5)
    assert average_precision([0.9, 0.1], [1, 0]) == 1.0 and average_precision([0.1, 0.9], [1, 0]) == 0.5
    assert average_precision([0.2, 0.2], [1, 0]) == 0.5  # a tie is not resolved in the positive's favour
    assert math.isnan(average_precision([0.2, 0.4], [0, 0]))


def test_average_precision_equals_the_naive_definition_and_torchmetrics_on_tied_scores():
    functional = pytest.importorskip("torchmetrics.functional")
    rng = np.random.default_rng(0)
    for _ in range(300):
        size = int(rng.integers(1, 15))
        scores, targets = rng.integers(0, 4, size).astype(float) / 4, rng.integers(0, 2, size)
        if not targets.any():
            continue
        ours = average_precision(scores, targets)
        assert ours == pytest.approx(naive_average_precision(scores, targets)), (scores, targets)
        theirs = functional.average_precision(torch.tensor(scores), torch.tensor(targets), task="binary")
        assert ours == pytest.approx(float(theirs)), (scores, targets)


# ---------------------------------------------------------------- single-object: the official rule


def official_single_object(path: Path, similarity) -> tuple[dict[int, float], float]:
    """`ColaSingleObjAP` (`scripts/eval.py`, arijitray1993/COLA 1fa52fb), step by step: scores [images, labels],
    transposed, per label skip if it is in no image or has no hard image, torchmetrics AP over the hard images,
    then the mean. Returns ({label index: AP}, mean) over the labels kept; a kept label whose hard images hold no
    positive gets what the installed torchmetrics gives it (0 from 0.11 on)."""
    functional = pytest.importorskip("torchmetrics.functional")
    content = json.loads(path.read_text())
    labels, data = (content["labels"], content["data"]) if isinstance(content, dict) else content
    captions = [label if isinstance(label, str) else " ".join([*label[0], label[1]]) for label in labels]
    preds = [torch.tensor([similarity(record[0], caption) for caption in captions]) for record in data]
    scores = torch.stack(preds).T
    all_labels = torch.tensor([record[-2] for record in data]).T
    im_obj_inds = torch.tensor([record[-1] for record in data]).T
    obj_level_avg = {}
    for index, (s_row, l_row, im_ind) in enumerate(zip(scores, all_labels, im_obj_inds)):
        if torch.sum(l_row) == 0:
            continue
        obj_present_inds = torch.where(im_ind == 1)[0]
        if len(obj_present_inds) == 0:
            continue
        obj_level_avg[index] = float(functional.average_precision(s_row[obj_present_inds],
                                                                  l_row[obj_present_inds], task="binary"))
    return obj_level_avg, float(torch.mean(torch.tensor(list(obj_level_avg.values()))))


@pytest.mark.filterwarnings("ignore:No positive samples found")  # torchmetrics on GQA's all-negative hard set
def test_official_rule_equals_ours_on_every_label_of_the_standin(tmp_path):
    benchmark = ColaSingleObject(tmp_path, **write_cola_single_object(tmp_path, n_items=60, seed=5))
    outcomes = benchmark.outcomes(hash_scorer())
    result = ColaSingleObject.aggregate(outcomes)
    assert result["ties"] >= 5  # hashed scores tie positives with negatives; AP must treat them as one threshold
    for subset in SUBSETS:
        official, _ = official_single_object(tmp_path / single_object_file(subset),
                                             lambda image_file, caption: hashed(image_file.rsplit("/", 1)[1], caption))
        mine = {int(o["id"].split("/")[1]): o for o in outcomes if o["subset"] == subset}
        assert set(mine) == set(official)  # the same labels kept
        undefined = {k for k, o in mine.items() if o["ap"] is None}
        assert undefined == ({NO_POSITIVE_HARD} if subset == "GQA" else set())
        for k in set(mine) - undefined:
            assert mine[k]["ap"] == pytest.approx(100.0 * official[k]), (subset, k)
        defined = [official[k] for k in set(official) - undefined]
        assert result[subset] == pytest.approx(100.0 * float(np.mean(defined)))
        assert result[f"labels/{subset}"] == len(defined)
    assert result["undefined"] == 1 and result["n"] == len(outcomes)


def test_single_object_aggregates_by_hand_and_from_json_round_tripped_outcomes(tmp_path):
    outcomes = [{"id": "GQA/3", "subset": "GQA", "ap": 50.0, "tie": True},
                {"id": "GQA/4", "subset": "GQA", "ap": 100.0, "tie": False},
                {"id": "GQA/5", "subset": "GQA", "ap": None, "tie": False},
                {"id": "PACO/3", "subset": "PACO", "ap": 20.0, "tie": False}]
    result = ColaSingleObject.aggregate(outcomes)
    assert (result["GQA"], result["labels/GQA"], result["PACO"], result["labels/PACO"]) == (75.0, 2.0, 20.0, 1.0)
    assert math.isnan(result["CLEVR"]) and result["labels/CLEVR"] == 0
    assert (result["undefined"], result["ties"], result["n"]) == (1.0, 1.0, 4.0)
    benchmark = ColaSingleObject(tmp_path, **write_cola_single_object(tmp_path, n_items=20))
    stored = benchmark.outcomes(hash_scorer())
    again = ColaSingleObject.aggregate([json.loads(json.dumps(o)) for o in stored])
    original = ColaSingleObject.aggregate(stored)
    assert again.keys() == original.keys() and all(same(again[k], original[k]) for k in again)
