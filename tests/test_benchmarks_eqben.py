"""EqBen: the shuffled full-set annotation and its key files, the 10 % subset, YouCook2's BGR frames, the
server's per-source scores and vl_compo's five-part mean."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from evaluation.benchmarks.base import GENERATED, OTHER, ImageRef, MissingBenchmarkData
from evaluation.benchmarks.eqben import (FULL_ANNOTATIONS, PRIVATE_INDEX, PRIVATE_INFO, SOURCES, SUBSET_ANNOTATIONS,
                                         EqBen, five_part_mean)
from evaluation.scorers import FunctionScorer
from parsers.images import read_npy_frame
from testkit.standin.eqben import GLOBAL_ANNOTATIONS, write_eqben

# ytaek-oh/vl_compo individual_results.csv, ViT-B-32 / openai: group per source; results.csv's `eqben`.
VL_COMPO_GROUP = {"eqbenyoucook2": 37.34, "eqbengebc": 4.5203969128996695, "eqbenag": 3.04, "eqbenkubric_loc": 1.0,
                  "eqbenkubric_cnt": 6.1, "eqbenkubric_attr": 22.2, "eqbensd": 77.79246530072703}
VL_COMPO_EQBEN = 26.49190578


def tied_similarity(ref: ImageRef, text: str) -> float:
    """A deterministic score in {0.0, 0.1, ..., 1.0}: many exact ties."""
    digest = hashlib.md5(f"{ref.path}|{text}".encode()).hexdigest()
    return round((int(digest, 16) % 11) / 10, 1)


def _build(root: Path, n_items: int = 70, seed: int = 0, layout: str = "full") -> EqBen:
    return EqBen(root, **write_eqben(root, n_items=n_items, seed=seed, layout=layout))


# ---------------------------------------------------------------- loading


def test_full_set_items_are_rebuilt_from_the_shuffled_pairs_and_the_key_files(tmp_path):
    items = _build(tmp_path, n_items=70).items()
    pairs = json.loads((tmp_path / FULL_ANNOTATIONS).read_text())
    assert len(items) == 70 and 4 * len(items) == len(pairs)
    assert [item.id for item in items[:2]] == ["eqbenyoucook2/0", "eqbenyoucook2/1"]  # sample_cnt order
    assert [item.meta["source"] for item in items[::10]] == list(SOURCES)  # 10 per source, in source blocks
    # every pair of the annotation is one (image, caption) cell of an item
    cells = {(ref.path, text) for item in items for ref in item.images for text in item.texts}
    assert cells == {(str(tmp_path / "image" / pair["image"]), pair["caption"]) for pair in pairs}
    youcook = items[0]
    assert youcook.images[0].path.endswith(".npy") and youcook.texts == ["a red dog left of a cat",
                                                                         "a red cat left of a dog"]
    assert all(Path(ref.path).is_file() for item in items for ref in item.images)


def test_the_global_annotation_and_the_key_files_give_the_same_items(tmp_path):
    keyed = _build(tmp_path / "k", seed=4).items()
    inline = _build(tmp_path / "g", seed=4, layout="global").items()
    assert [(i.id, i.texts, [Path(r.path).relative_to(tmp_path / "k") for r in i.images]) for i in keyed] == \
        [(i.id, i.texts, [Path(r.path).relative_to(tmp_path / "g") for r in i.images]) for i in inline]


def test_subset_records_and_sources_from_the_image_path(tmp_path):
    benchmark = _build(tmp_path, n_items=35, layout="subset")
    records = json.loads((tmp_path / SUBSET_ANNOTATIONS).read_text())
    items = benchmark.items()
    assert [item.texts for item in items] == [[r["caption0"], r["caption1"]] for r in records]
    assert [item.meta["source"] for item in items] == [r["image0"].split("/")[0] for r in records]
    assert items[3].id == f"{records[3]['image0'].split('/')[0]}/3"
    assert items[3].images[1].path == str(tmp_path / "image_subset" / records[3]["image1"])


def test_light_release_reads_png_paths_as_jpg_and_images_may_live_elsewhere(tmp_path):
    write_eqben(tmp_path, n_items=14)
    benchmark = EqBen(tmp_path, images=tmp_path / "jpg", png_as_jpg=True)
    paths = [ref.path for item in benchmark.items() for ref in item.images]
    assert all(p.startswith(str(tmp_path / "jpg")) for p in paths)
    assert all(p.endswith(".npy") for p in paths[:4]) and all(p.endswith(".jpg") for p in paths[4:])


def test_youcook2_frames_are_bgr_arrays_read_as_rgb(tmp_path):
    """`process_img_npy`: `Image.fromarray(np.load(path)[:, :, [2, 1, 0]], 'RGB')`."""
    item = _build(tmp_path, n_items=7).items()[0]
    path = item.images[0].path
    official = Image.fromarray(np.load(path)[:, :, [2, 1, 0]], "RGB")
    assert np.array_equal(np.asarray(read_npy_frame(path)), np.asarray(official))
    assert not np.array_equal(np.load(path), np.asarray(official))  # the stored order is BGR
    np.save(tmp_path / "flat.npy", np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(OSError, match="expected a \\[H, W, 3\\] uint8 array"):
        read_npy_frame(tmp_path / "flat.npy")
    (tmp_path / "broken.npy").write_bytes(b"not numpy")
    with pytest.raises(OSError, match="not a numpy array file"):
        read_npy_frame(tmp_path / "broken.npy")


def test_image_origin_generated_for_renders_and_generations(tmp_path):
    benchmark = _build(tmp_path, n_items=7)
    origins = {item.meta["source"]: benchmark.image_origin(item.images[0]).source for item in benchmark.items()}
    assert origins == {"eqbenyoucook2": OTHER, "eqbengebc": OTHER, "eqbenag": OTHER, "eqbenkubric_loc": GENERATED,
                       "eqbenkubric_cnt": GENERATED, "eqbenkubric_attr": GENERATED, "eqbensd": GENERATED}
    assert benchmark.coco_image_ids() == set()


# ---------------------------------------------------------------- missing and malformed files


def test_missing_annotation_and_key_files_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match=FULL_ANNOTATIONS):
        EqBen(tmp_path)
    with pytest.raises(MissingBenchmarkData, match=SUBSET_ANNOTATIONS):
        EqBen(tmp_path, subset=True)
    write_eqben(tmp_path, n_items=7)
    (tmp_path / PRIVATE_INFO).unlink()
    with pytest.raises(MissingBenchmarkData, match=f"lacks {PRIVATE_INFO}"):
        EqBen(tmp_path).items()


def _rewrite(path: Path, edit) -> None:
    records = json.loads(path.read_text())
    edit(records)
    path.write_text(json.dumps(records))


def _swap_first_two(records: list) -> None:
    records[0], records[1] = records[1], records[0]


@pytest.mark.parametrize("target, edit, message", [
    (PRIVATE_INDEX, lambda r: r.__setitem__(0, r[1]), "private_random_idx.json: not a permutation"),
    (PRIVATE_INDEX, lambda r: r.pop(), "56 pairs, but src_file/private_random_idx.json has 55"),
    (PRIVATE_INFO, lambda r: r[0].__setitem__("dataset", "eqbenvg"), "private info .* is not"),
    (PRIVATE_INFO, lambda r: r[1].__setitem__("name", "c0i0"), "item 0 has two c0i0 pairs"),
    (PRIVATE_INFO, lambda r: r[8].__setitem__("sample_cnt", 0), r"item 0 has pairs in eqben\w+ and eqben\w+"),
    (PRIVATE_INFO, lambda r: [i.__setitem__("sample_cnt", 99) for i in r[12:16]],  # gebc's second item
     "eqbengebc do not hold a contiguous sample_cnt range"),
    (FULL_ANNOTATIONS, lambda r: r[0].pop("caption"), "pair 0 lacks image or caption"),
    (FULL_ANNOTATIONS, lambda r: r[0].__setitem__("private_info", {}), "some pairs carry private_info"),
])
def test_malformed_full_set_files_name_the_file_and_record(tmp_path, target, edit, message):
    write_eqben(tmp_path, n_items=14)  # two items per source, the records of each source in one block
    _rewrite(tmp_path / target, edit)
    with pytest.raises(ValueError, match=message):
        EqBen(tmp_path).items()


def test_an_item_whose_pairs_disagree_or_lack_a_pair_is_an_error(tmp_path):
    write_eqben(tmp_path, n_items=7, layout="global")
    path = tmp_path / GLOBAL_ANNOTATIONS
    records = json.loads(path.read_text())
    first = next(r for r in records if r["private_info"] == {"dataset": "eqbengebc", "name": "c1i0", "sample_cnt": 1})
    first["image"] = "eqbengebc/elsewhere.png"
    path.write_text(json.dumps(records))
    with pytest.raises(ValueError, match=f"{path}: item 1 \\(eqbengebc\\): the pairs disagree on image 0"):
        EqBen(tmp_path, annotations=GLOBAL_ANNOTATIONS).items()
    path.write_text(json.dumps([r for r in records if r is not first]))
    with pytest.raises(ValueError, match="item 1 \\(eqbengebc\\) has pairs \\['c0i0', 'c0i1', 'c1i1'\\]"):
        EqBen(tmp_path, annotations=GLOBAL_ANNOTATIONS).items()


@pytest.mark.parametrize("edit, message", [
    (lambda r: r[0].pop("caption1"), "record 0 lacks one of image0, image1, caption0, caption1"),
    (lambda r: r[0].__setitem__("image0", "coco/1.jpg"), "record 0: image 'coco/1.jpg' is not under a known source"),
    (lambda r: r[0].__setitem__("image0", "eqbenyoucook2/a/0.png"), "frames are .npy files"),
    (lambda r: r[0].__setitem__("image1", r[0]["image1"][:-4] + ".npy") if not r[0]["image1"].endswith(".npy")
     else r[0].__setitem__("image1", r[0]["image1"][:-4] + ".png"), "frames are .npy files"),
])
def test_malformed_subset_records_name_the_file_and_record(tmp_path, edit, message):
    write_eqben(tmp_path, n_items=7, layout="subset")
    _rewrite(tmp_path / SUBSET_ANNOTATIONS, edit)
    with pytest.raises(ValueError, match=message):
        EqBen(tmp_path, subset=True).items()


def test_truncated_or_non_utf8_annotations_name_the_file(tmp_path):
    write_eqben(tmp_path, n_items=7)
    path = tmp_path / FULL_ANNOTATIONS
    text = path.read_bytes()
    path.write_bytes(text[: len(text) // 2])
    with pytest.raises(ValueError, match=f"{path}: not a (UTF-8 text|whole JSON) file"):
        EqBen(tmp_path).items()
    path.write_bytes(text.replace(b"dog", "d\u00f6g".encode("latin-1")))
    with pytest.raises(ValueError, match=f"{path}: not a (UTF-8 text|whole JSON) file"):
        EqBen(tmp_path).items()


# ---------------------------------------------------------------- the rule


def test_outcome_is_the_winoground_rule_with_ties_wrong(tmp_path):
    benchmark = _build(tmp_path, n_items=7)
    item = benchmark.items()[0]
    right = benchmark.outcome(item, np.array([[0.9, 0.1], [0.2, 0.8]]))
    assert (right["text"], right["image"], right["group"], right["tie"], right["source"]) == \
        (True, True, True, False, "eqbenyoucook2")
    tie = benchmark.outcome(item, np.array([[0.5, 0.5], [0.2, 0.8]]))  # c0i0 == c1i0: text wrong, image right
    assert (tie["text"], tie["image"], tie["group"], tie["tie"]) == (False, True, False, True)


def official_server_scores(root: Path, similarity) -> tuple[dict, dict]:
    """`evaluate_eqben_locally.py` step by step, after `eqben_eval_CLIP.py` scored every pair of the shuffled
    annotation in file order (`EqBenALL`): un-shuffle, fill the four arrays, slice each dataset, `cal_wino_score`.
    Returns per-source scores and, per (dataset, sample_cnt), the text / image / group booleans."""
    pairs = json.loads((root / FULL_ANNOTATIONS).read_text())
    submission = np.array([similarity(ImageRef(str(root / "image" / p["image"])), p["caption"]) for p in pairs])
    private_idx = json.loads((root / PRIVATE_INDEX).read_text())
    private_info = json.loads((root / PRIVATE_INFO).read_text())
    recovered = submission[np.argsort(private_idx)]
    arrays = {name: np.zeros(len(submission) // 4) for name in ("c0i0", "c0i1", "c1i0", "c1i1")}
    blocks: dict[str, dict[str, int]] = {}
    for idx, (score, info) in enumerate(zip(recovered, private_info)):
        arrays[info["name"]][info["sample_cnt"]] = score
        block = blocks.setdefault(info["dataset"], {"start": idx, "end": idx})
        block["end"] += 1
    scores, per_item = {}, {}
    for dataset in SOURCES:
        start, end = blocks[dataset]["start"] // 4, blocks[dataset]["end"] // 4
        r = {name: torch.from_numpy(values[start:end]) for name, values in arrays.items()}
        text = torch.logical_and(r["c0i0"] > r["c1i0"], r["c1i1"] > r["c0i1"])
        image = torch.logical_and(r["c0i0"] > r["c0i1"], r["c1i1"] > r["c1i0"])
        group = torch.logical_and(image, text)
        scores[dataset] = {name: float(v.sum() / len(v)) for name, v in (("text", text), ("image", image),
                                                                           ("group", group))}
        for offset in range(end - start):
            per_item[f"{dataset}/{start + offset}"] = (bool(text[offset]), bool(image[offset]), bool(group[offset]))
    return scores, per_item


def test_official_server_equals_ours_on_every_item(tmp_path):
    benchmark = _build(tmp_path, n_items=700, seed=5)
    outcomes = benchmark.outcomes(FunctionScorer(tied_similarity))
    scores, per_item = official_server_scores(tmp_path, tied_similarity)
    assert {o["id"]: (o["text"], o["image"], o["group"]) for o in outcomes} == per_item
    assert sum(o["tie"] for o in outcomes) > 100
    result = EqBen.aggregate(outcomes)
    for dataset, values in scores.items():
        for score, value in values.items():
            assert result[f"{dataset}/{score}"] == pytest.approx(100 * value), (dataset, score)
    assert result["group_mean"] == pytest.approx(five_part_mean({d: 100 * v["group"] for d, v in scores.items()}))


def test_subset_scores_are_the_same_rule_per_item(tmp_path):
    benchmark = _build(tmp_path, n_items=140, seed=6, layout="subset")
    for item, outcome in zip(benchmark.items(), benchmark.outcomes(FunctionScorer(tied_similarity))):
        s = {f"c{c}i{i}": tied_similarity(item.images[i], item.texts[c]) for c in (0, 1) for i in (0, 1)}
        text = s["c0i0"] > s["c1i0"] and s["c1i1"] > s["c0i1"]
        image = s["c0i0"] > s["c0i1"] and s["c1i1"] > s["c1i0"]
        assert (outcome["text"], outcome["image"], outcome["group"]) == (text, image, text and image)


# ---------------------------------------------------------------- aggregates


def test_vl_compo_headline_is_the_five_part_mean_of_its_per_source_groups():
    assert five_part_mean(VL_COMPO_GROUP) == pytest.approx(VL_COMPO_EQBEN, abs=1e-6)
    assert EqBen.published["group_mean"].value == round(VL_COMPO_EQBEN, 2)
    assert {s: EqBen.published[f"{s}/group"].value for s in SOURCES} == \
        {s: round(v, 2) for s, v in VL_COMPO_GROUP.items()}
    assert math.isnan(five_part_mean({**VL_COMPO_GROUP, "eqbenkubric_cnt": math.nan}))


def test_aggregate_by_hand_per_source_kubric_mean_and_headline():
    def outcome(source: str, text: bool, image: bool) -> dict:
        return {"source": source, "text": text, "image": image, "group": text and image, "tie": False}

    outcomes = [outcome("eqbenyoucook2", True, True), outcome("eqbenyoucook2", True, False),
                outcome("eqbengebc", False, False), outcome("eqbenag", True, True), outcome("eqbensd", True, True),
                outcome("eqbenkubric_loc", True, True), outcome("eqbenkubric_cnt", False, True),
                outcome("eqbenkubric_attr", False, False)]
    result = EqBen.aggregate(outcomes)
    assert result["eqbenyoucook2/group"] == 50.0 and result["eqbenyoucook2/text"] == 100.0
    assert result["eqbenyoucook2/n"] == 2 and result["kubric/group"] == pytest.approx(100 / 3)
    assert result["group_mean"] == pytest.approx((50 + 0 + 100 + 100 / 3 + 100) / 5)
    assert result["group"] == pytest.approx(100 * 4 / 8) and result["n"] == 8 and result["ties"] == 0
    assert math.isnan(EqBen.aggregate(outcomes[:5])["group_mean"])  # no Kubric items: no headline


def test_aggregates_recompute_from_json_round_tripped_outcomes(tmp_path):
    outcomes = _build(tmp_path, n_items=35, layout="subset").outcomes(FunctionScorer(tied_similarity))
    stored = [json.loads(json.dumps(outcome)) for outcome in outcomes]
    first, again = EqBen.aggregate(outcomes), EqBen.aggregate(stored)
    assert first.keys() == again.keys() and set(EqBen.headline) <= set(first)
    assert all((math.isnan(first[k]) and math.isnan(again[k])) or first[k] == again[k] for k in first)
