"""COCO-Counterfactuals retrieval: the official files, the strict ranks over shared captions, and parity with the
authors' retrieval loop on the released annotations."""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
import torch

from evaluation.benchmarks.base import GENERATED, MissingBenchmarkData
from evaluation.benchmarks.coco_counterfactuals import (EXAMPLES, TEST_SPLIT, CocoCounterfactuals,
                                                        CocoCounterfactualsTest)
from evaluation.benchmarks.retrieval import RECALL_AT
from evaluation.harness import run_benchmark
from evaluation.scorers import ClipScorer, FunctionScorer
from testkit.standin.coco_counterfactuals import captions, write_coco_counterfactuals, write_coco_counterfactuals_test

FIXTURE = Path(__file__).resolve().parent / "data" / "benchmarks" / "coco_counterfactuals"
TENNIS = "A man holding a tennis racquet on a tennis court."


def hashed(image_path: str, text: str, decimals: int) -> float:
    """A deterministic similarity from the image's file name and the text; one decimal gives many exact ties."""
    digest = hashlib.sha256(f"{Path(image_path).name}\x1f{text}".encode()).digest()
    return round(int.from_bytes(digest[:6], "big") / 2 ** 48, decimals)


def hash_scorer(decimals: int) -> FunctionScorer:
    return FunctionScorer(lambda ref, text: hashed(ref.path, text, decimals))


def write_examples(root: Path, records: list[dict]) -> Path:
    path = root / EXAMPLES
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def record(identifier: str, caption_0: str, caption_1: str) -> dict:
    return {"id": identifier, "caption_0": caption_0, "caption_1": caption_1, "image_0": f"{identifier}_img_0",
            "image_1": f"{identifier}_img_1"}


def by_id(outcomes: list[dict]) -> dict[str, dict]:
    return {outcome["id"]: outcome for outcome in outcomes}


# --- the authors' loop ------------------------------------------------------------------------------------

def official_hits(rows: list[tuple[str, str]], similarity, order) -> dict[tuple[str, str], dict[int, bool]]:
    """`CLIP_evaluation.py` (IntelLabs/multimodal_cognitive_ai 860cd01, COCO-Counterfactuals/coco-counterfactuals-src/
    coco-cfs-evaluation), step by step: the table of (image_path, caption) rows; the distinct images and the
    distinct captions; for each image, every caption scored, sorted with a stable descending sort, and a hit at K
    when one of the first K forms a row of the table with the image (`compute_topk_image_text_retrieval`); the
    same for each caption over the images (`compute_topk_text_image_retrieval`).

    Their candidate order is that of a Python set, which varies between runs; `order(direction, query,
    candidates)` gives the one used here. Returns {(direction, query): {K: hit}}.
    """
    table = set(rows)
    images, captions = list(dict.fromkeys(p for p, _ in rows)), list(dict.fromkeys(c for _, c in rows))
    hits = {}
    for direction, queries, candidates in (("i2t", images, captions), ("t2i", captions, images)):
        for query in queries:
            ordered = order(direction, query, candidates)
            scores = torch.tensor([similarity(query, c) if direction == "i2t" else similarity(c, query)
                                   for c in ordered], dtype=torch.float64)
            _, indices = scores.sort(stable=True, descending=True)
            pair = (lambda c: (query, c)) if direction == "i2t" else (lambda c: (c, query))
            hits[direction, query] = {k: any(pair(ordered[i]) in table for i in indices[:k].tolist())
                                      for k in RECALL_AT}
    return hits


def wrong_first(rows):
    """The order under which a stable sort puts every tied wrong candidate first: the strict rule."""
    table = set(rows)

    def order(direction, query, candidates):
        pair = (lambda c: (query, c)) if direction == "i2t" else (lambda c: (c, query))
        return sorted(candidates, key=lambda c: pair(c) in table)
    return order


def shuffled(seed):
    rng = random.Random(seed)
    return lambda direction, query, candidates: rng.sample(candidates, len(candidates))


def official_queries(benchmark):
    """Our outcome id of every official query: (direction, image path) and (direction, caption)."""
    table = benchmark.table
    images = {("i2t", pair.image.path): f"i2t/{pair.item}/{pair.side}" for pair in table.pairs}
    captions = {("t2i", caption): f"t2i/{pair.item}/{pair.side}"
                for caption, pair in zip(table.captions, table.first_pair_of_caption())}
    return {**images, **captions}


def official_recalls(hits) -> dict[str, float]:
    return {f"{direction}_r{k}": 100 * sum(h[k] for (d, _), h in hits.items() if d == direction)
            / sum(1 for d, _ in hits if d == direction) for direction in ("i2t", "t2i") for k in RECALL_AT}


@pytest.mark.parametrize("benchmark_class", [CocoCounterfactuals, CocoCounterfactualsTest])
def test_official_rule_equals_ours_on_every_query_of_the_released_annotations(benchmark_class):
    benchmark = benchmark_class(FIXTURE)
    rows = [(pair.image.path, pair.caption) for pair in benchmark.table.pairs]
    similarity = lambda path, text: hashed(path, text, 1)  # noqa: E731
    outcomes = by_id(benchmark.outcomes(hash_scorer(1)))
    queries = official_queries(benchmark)
    assert sorted(queries.values()) == sorted(outcomes)

    strict = official_hits(rows, similarity, wrong_first(rows))
    for query, outcome_id in queries.items():
        assert strict[query] == {k: outcomes[outcome_id]["rank"] < k for k in RECALL_AT}, outcome_id
    ours = benchmark.aggregate(list(outcomes.values()))
    assert all(ours[key] == pytest.approx(value) for key, value in official_recalls(strict).items())
    assert ours["ties"] > 20  # the scorer's ties decided many queries: the comparison above exercised them

    # Any other candidate order changes only queries decided by a tie.
    for seed in range(3):
        loose = official_hits(rows, similarity, shuffled(seed))
        for query, outcome_id in queries.items():
            if outcomes[outcome_id]["ties"] == 0:
                assert loose[query] == strict[query], outcome_id


def test_without_ties_the_official_rule_equals_ours_in_any_candidate_order():
    benchmark = CocoCounterfactuals(FIXTURE)
    rows = [(pair.image.path, pair.caption) for pair in benchmark.table.pairs]
    outcomes = by_id(benchmark.outcomes(hash_scorer(12)))
    # Twelve decimals: no two scores tie, so the candidate order cannot matter.
    assert sum(outcome["ties"] for outcome in outcomes.values()) == 0
    hits = official_hits(rows, lambda path, text: hashed(path, text, 12), shuffled(7))
    for query, outcome_id in official_queries(benchmark).items():
        assert hits[query] == {k: outcomes[outcome_id]["rank"] < k for k in RECALL_AT}, outcome_id


# --- the released annotations -----------------------------------------------------------------------------

def test_fixture_reads_both_rows_of_every_example_and_merges_repeated_captions():
    benchmark = CocoCounterfactuals(FIXTURE)
    table = benchmark.table
    assert len(benchmark.examples) == 66 and len(table.pairs) == 132 and len(table.captions) == 94
    first = table.pairs[0]
    assert (first.item, first.side, first.caption) == ("158956_0", 0, "A woman is cutting into a cake with a large "
                                                                          "knife.")
    assert first.image.path == str(FIXTURE / "data" / "images" / "158956_0_img_0.jpg")
    assert table.pairs[1].caption == "A baker is cutting into a cake with a large knife."
    tennis = table.captions.index(TENNIS)
    assert (table.caption_of_image == tennis).sum() == 9  # one T2I query, nine correct images
    # Captions are compared raw: a trailing space makes another caption.
    assert {"A man riding a wave on a surfboard.", "A man riding a wave on a surfboard. "} <= set(table.captions)


def test_fixture_test_split_keeps_the_listed_rows_in_file_order():
    benchmark = CocoCounterfactualsTest(FIXTURE)
    table = benchmark.table
    assert len(table.pairs) == 54 and len(table.captions) == 49
    assert [pair.side for pair in table.pairs] == [0] * 27 + [1] * 27  # originals, then counterfactuals
    assert table.pairs[0].item == "567011_2" and table.pairs[0].caption == "A man riding a wave on a surfboard. "
    assert table.pairs[27].image.path == str(FIXTURE / "data" / "images" / "164602_4_img_1.jpg")
    assert {pair.item for pair in table.pairs[:27]} == {pair.item for pair in table.pairs[27:]}
    assert {pair.item for pair in table.pairs} < {r["id"] for r in benchmark.examples}


# --- the stand-in and malformed files ---------------------------------------------------------------------

def test_stand_in_round_trip(tmp_path):
    write_coco_counterfactuals_test(tmp_path, n_items=14)
    whole, split = CocoCounterfactuals(tmp_path), CocoCounterfactualsTest(tmp_path)
    assert len(whole.table.pairs) == 28 and len(whole.table.captions) == 24  # 6 and 13 repeat 5 and 12
    assert [r["id"] for r in whole.examples][:2] == ["100000_0", "100037_1"]
    assert whole.examples[5]["caption_0"].endswith(". ")
    assert all(ref.file.is_file() for ref in whole.image_refs())
    assert [pair.item for pair in split.table.pairs] == ["100000_0", "100111_3", "100222_1", "100370_0", "100481_3"] * 2
    assert all(whole.image_origin(ref).source == GENERATED for ref in whole.image_refs())
    assert whole.coco_image_ids() == set()


def test_stand_in_captions_stay_distinct_for_thousands_of_examples(tmp_path):
    originals = [captions(index) for index in range(3000) if index % 7 != 6]  # the rest repeat on purpose
    assert len({text for pair in originals for text in pair}) == 2 * len(originals)
    write_coco_counterfactuals(tmp_path, n_items=700)
    table = CocoCounterfactuals(tmp_path).table
    assert len(table.pairs) == 1400 and len(table.captions) == 1400 - 2 * 100


def test_missing_files_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match="data/examples.jsonl"):
        CocoCounterfactuals(tmp_path)
    write_coco_counterfactuals(tmp_path, n_items=3)
    CocoCounterfactuals(tmp_path)
    with pytest.raises(MissingBenchmarkData, match="test-coco-cfs.csv"):
        CocoCounterfactualsTest(tmp_path)
    with pytest.raises(ValueError, match="chunk_size"):
        CocoCounterfactuals(tmp_path, chunk_size=0)


@pytest.mark.parametrize("content, message", [
    ('{"id": "1_0", "caption_0": "a", "caption_1": "b", "image_0": "1_0_img_0"}\n', r"line 1 .*'image_1'"),
    ('{"id": "1_0", "caption_0": "a", "caption_1": 3, "image_0": "x", "image_1": "y"}\n', r"line 1 .*'caption_1'"),
    ('{"id": "1_0", "caption_0": "a", "caption_1": "b", "image_0": "x", "ima', r"line 1 is not JSON"),
    ('["1_0"]\n', r"line 1 is not a JSON object"),
    ("\n", r"no examples"),
])
def test_malformed_examples_name_the_file_and_line(tmp_path, content, message):
    path = tmp_path / EXAMPLES
    path.parent.mkdir(parents=True)
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as error:
        _ = CocoCounterfactuals(tmp_path).table
    assert str(path) in str(error.value)


def test_repeated_ids_images_and_bad_encoding_are_errors(tmp_path):
    path = write_examples(tmp_path, [record("1_0", "a", "b"), record("1_0", "c", "d")])
    with pytest.raises(ValueError, match=r"line 2 repeats id '1_0'"):
        _ = CocoCounterfactuals(tmp_path).table
    shared = {**record("2_0", "c", "d"), "image_0": "1_0_img_0"}
    write_examples(tmp_path, [record("1_0", "a", "b"), shared])
    with pytest.raises(ValueError, match="1_0_img_0.jpg appears in two rows"):
        _ = CocoCounterfactuals(tmp_path).table
    path.write_bytes(json.dumps(record("1_0", "caf\u00e9", "b"), ensure_ascii=False).encode("latin-1"))
    with pytest.raises(ValueError, match="not a UTF-8") as error:
        _ = CocoCounterfactuals(tmp_path).table
    assert str(path) in str(error.value)


@pytest.mark.parametrize("row, message", [
    ("../../x/synthetic-images-for-original-captions/1_0.jpg,a different caption", r"line 2: caption .* caption_0"),
    ("../../x/synthetic-images-for-counterfactual-captions/9_9.jpg,b", r"line 2: example '9_9' is not in"),
    ("../../x/other-images/1_0.jpg,a", r"line 2: image_path .* is not"),
    ("../../x/synthetic-images-for-original-captions/1_0.jpg", r"line 2 has the wrong number of cells"),
])
def test_malformed_test_split_rows_name_the_file_and_line(tmp_path, row, message):
    write_examples(tmp_path, [record("1_0", "a", "b")])
    path = tmp_path / TEST_SPLIT
    path.parent.mkdir(parents=True)
    path.write_text(f"image_path,caption\n{row}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as error:
        _ = CocoCounterfactualsTest(tmp_path).table
    assert str(path) in str(error.value)


def test_a_truncated_test_split_is_an_error_naming_the_file(tmp_path):
    write_coco_counterfactuals_test(tmp_path, n_items=10)
    path = tmp_path / TEST_SPLIT
    path.write_bytes(path.read_bytes()[:-9])  # cut inside the last caption
    with pytest.raises(ValueError, match="line 7: caption") as error:
        _ = CocoCounterfactualsTest(tmp_path).table
    assert str(path) in str(error.value)


# --- the rule on a hand-made matrix -----------------------------------------------------------------------

SCORES = {  # image -> {caption: similarity}; captions x (shared by a0 and b0), y, z
    "a_img_0": {"x": 0.9, "y": 0.1, "z": 0.9},
    "a_img_1": {"x": 0.5, "y": 0.4, "z": 0.7},
    "b_img_0": {"x": 0.3, "y": 0.2, "z": 0.1},
    "b_img_1": {"x": 0.0, "y": 0.0, "z": 0.7},
}


@pytest.mark.parametrize("chunk_size", [1, 2, 1024])
def test_hand_made_matrix_with_a_shared_caption_and_exact_ties(tmp_path, chunk_size):
    write_examples(tmp_path, [record("a", "x", "y"), record("b", "x", "z")])
    benchmark = CocoCounterfactuals(tmp_path, chunk_size=chunk_size)
    outcomes = by_id(benchmark.outcomes(FunctionScorer(lambda ref, text: SCORES[Path(ref.path).stem][text])))
    ranks = {key: (o["rank"], o["ties"]) for key, o in outcomes.items()}
    assert ranks == {
        "i2t/a/0": (1, 1),  # x 0.9 ties the wrong z 0.9: a tie counts against
        "i2t/a/1": (2, 0),  # y 0.4 under x 0.5 and z 0.7
        "i2t/b/0": (0, 0),
        "i2t/b/1": (0, 0),
        "t2i/a/0": (0, 0),  # x: its best image a_img_0 (0.9); b_img_0 (0.3) is also correct, not counted
        "t2i/a/1": (0, 0),
        "t2i/b/1": (2, 1),  # z: a_img_0 0.9 above, a_img_1 0.7 tied with b_img_1
    }
    assert outcomes["t2i/a/0"]["images"] == 2 and outcomes["t2i/b/1"]["side"] == "counterfactual"
    result = benchmark.aggregate(list(outcomes.values()))
    assert (result["i2t_r1"], result["i2t_r5"], result["t2i_r5"]) == (50.0, 100.0, 100.0)
    assert result["t2i_r1"] == pytest.approx(200 / 3)
    assert result["rsum"] == pytest.approx(50 + 100 + 100 + 200 / 3 + 100 + 100)
    assert (result["ties"], result["i2t_tied"], result["t2i_tied"]) == (2.0, 1, 1)
    assert (result["n"], result["images"], result["captions"]) == (2.0, 4, 3)


def test_aggregates_recompute_from_json_and_do_not_depend_on_chunking(tmp_path):
    write_coco_counterfactuals(tmp_path, n_items=25)
    outcomes = CocoCounterfactuals(tmp_path, chunk_size=7).outcomes(hash_scorer(1))
    assert outcomes == CocoCounterfactuals(tmp_path).outcomes(hash_scorer(1))
    stored = [json.loads(json.dumps(outcome)) for outcome in outcomes]
    assert CocoCounterfactuals.aggregate(stored) == CocoCounterfactuals.aggregate(outcomes)
    assert len({o["id"] for o in outcomes}) == len(outcomes) == 50 + 50 - 2 * 3


def test_published_numbers_are_the_authors_test_split_baseline():
    assert dict(CocoCounterfactuals.published) == {}
    numbers = {key: value.value for key, value in CocoCounterfactualsTest.published.items()}
    assert numbers == {"i2t_r1": 50.96, "i2t_r5": 79.33, "i2t_r10": 86.45,
                       "t2i_r1": 47.89, "t2i_r5": 77.19, "t2i_r10": 85.73}
    assert set(numbers) <= set(CocoCounterfactualsTest.headline)
    assert [d.target for d in CocoCounterfactualsTest.data_source.downloads] == [TEST_SPLIT]


def test_tiny_clip_end_to_end_on_the_stand_in(tmp_path):
    write_coco_counterfactuals_test(tmp_path, n_items=12)
    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained("ViT-Tiny-16-64", None, batch_size=64)
    result = run_benchmark(CocoCounterfactualsTest(tmp_path), scorer)
    assert result.aggregates["images"] == 8 and result.aggregates["n"] == 4.0
    assert 0.0 <= result.aggregates["i2t_r1"] <= result.aggregates["i2t_r5"] <= 100.0
