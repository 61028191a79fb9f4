"""The 2x2 family: Winoground (JSONL and parquet), BiVLC, BiSCoR-Ctrl and the shapes-world swap set."""
from __future__ import annotations

import csv
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from datamodules.shapes import generate, load_swap_items
from evaluation.benchmarks.base import ImageRef, MissingBenchmarkData
from evaluation.benchmarks.images import load_image
from testkit.standin import two_by_two as standin
from evaluation.benchmarks.two_by_two import BiSCoRCtrl, BiVLC, ShapesSwap, Winoground, two_by_two_scores
from evaluation.scorers import ClipScorer, FunctionScorer

RIGHT = np.array([[0.9, 0.1], [0.2, 0.8]])  # s[image i, caption j]: every comparison right
TEXT_WRONG = np.array([[0.5, 0.6], [0.1, 0.9]])  # image 0 prefers caption 1; captions still pick their image
IMAGE_TIE = np.array([[0.5, 0.1], [0.5, 0.9]])  # caption 0 ties between the images


def _pixels(ref) -> np.ndarray:
    return np.asarray(load_image(ref))


# ---------------------------------------------------------------- loading


def test_winoground_jsonl_standin_loads_ids_captions_tags_and_png_paths(tmp_path):
    benchmark = Winoground(tmp_path, **standin.write_winoground(tmp_path, n_items=20, seed=0))
    records = [json.loads(line) for line in (tmp_path / "data" / "examples.jsonl").read_text().splitlines()]
    items = benchmark.items()
    assert benchmark.source == "jsonl" and len(items) == 20 and [i.id for i in items] == [str(k) for k in range(20)]
    assert [item.texts for item in items] == [[r["caption_0"], r["caption_1"]] for r in records]
    assert items[3].images[0].path == str(tmp_path / "data" / "images" / "ex_3_img_0.png")
    assert items[3].images[1].path == str(tmp_path / "data" / "images" / "ex_3_img_1.png")
    tags = ("tag", "secondary_tag", "collapsed_tag", "num_main_preds")
    assert items[3].meta == {key: records[3][key] for key in tags}
    assert all(Path(ref.path).is_file() for item in items for ref in item.images)
    assert Winoground(tmp_path).items()[0].images[0].path == items[0].images[0].path  # default images folder


def test_winoground_parquet_rows_and_embedded_images_match_the_jsonl_layout(tmp_path):
    jsonl = Winoground(tmp_path / "j", **standin.write_winoground(tmp_path / "j", n_items=6, seed=2))
    parquet = Winoground(tmp_path / "p", **standin.write_winoground(tmp_path / "p", n_items=6, seed=2,
                                                                    layout="parquet"))
    assert parquet.source == "parquet" and Winoground(tmp_path / "p").source == "parquet"  # "auto" finds it
    for file_item, cell_item in zip(jsonl.items(), parquet.items()):
        assert (file_item.id, file_item.texts, file_item.meta) == (cell_item.id, cell_item.texts, cell_item.meta)
        assert [ref.member for ref in cell_item.images] == [f"image_0:{cell_item.id}", f"image_1:{cell_item.id}"]
        for file_ref, cell_ref in zip(file_item.images, cell_item.images):
            assert np.array_equal(_pixels(file_ref), _pixels(cell_ref))  # the bytes decode to the written image
        assert not np.array_equal(_pixels(cell_item.images[0]), _pixels(cell_item.images[1]))


def test_bivlc_reads_both_shards_in_order_with_embedded_images(tmp_path):
    benchmark = BiVLC(tmp_path, **standin.write_bivlc(tmp_path, n_items=9, seed=1))
    shards = sorted((tmp_path / "data").glob("test-*.parquet"))
    assert [s.name for s in shards] == ["test-00000-of-00002.parquet", "test-00001-of-00002.parquet"]
    items = benchmark.items()
    assert [i.id for i in items] == [str(k) for k in range(9)]
    assert items[6].images[1] .path == str(shards[1]) and items[6].images[1].member == "negative_image:1"
    assert items[0].texts == list(standin.swapped_captions(0))
    assert items[0].meta == {"type": "replace", "subtype": "obj"}
    assert items[3].meta == {"type": "swap", "subtype": "obj"}
    pool = standin.encoded_pool(1, ".png")
    for index in (0, 6):
        for which in (0, 1):
            encoded = pool[standin.pool_index(index, which, len(pool))]
            expected = np.asarray(Image.open(io.BytesIO(encoded)).convert("RGB"))
            assert np.array_equal(_pixels(items[index].images[which]), expected)


def _reshard(source: Path, shards: list[Path]) -> None:
    """Split a parquet file's rows into consecutive shards (same schema and metadata) and delete it."""
    table = pq.read_table(source)
    bounds = np.linspace(0, table.num_rows, len(shards) + 1).astype(int)
    for shard, start, stop in zip(shards, bounds[:-1], bounds[1:]):
        shard.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.slice(start, stop - start), shard)
    source.unlink()


def _same_items(ours, reference) -> None:
    """Same ids, captions and meta in the same order, and the same decoded pixels for every image."""
    assert [(i.id, i.texts, i.meta) for i in ours] == [(i.id, i.texts, i.meta) for i in reference]
    for mine, theirs in zip(ours, reference):
        for my_ref, their_ref in zip(mine.images, theirs.images):
            assert np.array_equal(_pixels(my_ref), _pixels(their_ref))


def test_winoground_reads_several_shards_in_name_order(tmp_path):
    reference = Winoground(tmp_path / "one", **standin.write_winoground(tmp_path / "one", n_items=7, layout="parquet"))
    standin.write_winoground(tmp_path / "three", n_items=7, layout="parquet")
    data = tmp_path / "three" / "data"
    # A hash-suffixed name (as older revisions have) still sorts by its shard number.
    shards = [data / "test-00000-of-00003-1f2e.parquet", data / "test-00001-of-00003-0a9b.parquet",
              data / "test-00002-of-00003-c3d4.parquet"]
    _reshard(data / "test-00000-of-00001.parquet", shards)
    benchmark = Winoground(tmp_path / "three")
    items = benchmark.items()
    assert benchmark.source == "parquet" and [i.id for i in items] == [str(k) for k in range(7)]
    # rows 0-1 in the first shard, 2-3 in the second, 4-6 in the third: members count rows within a shard
    assert [(ref.path, ref.member) for ref in items[3].images] == [(str(shards[1]), "image_0:1"),
                                                                  (str(shards[1]), "image_1:1")]
    assert items[4].images[0] == ImageRef(str(shards[2]), member="image_0:0")
    _same_items(items, reference.items())


@pytest.mark.parametrize("benchmark_class", [Winoground, BiVLC])
def test_the_hubs_converted_parquet_layout_reads_as_the_repository_layout(tmp_path, benchmark_class):
    write = standin.write_winoground if benchmark_class is Winoground else standin.write_bivlc
    options = {"layout": "parquet"} if benchmark_class is Winoground else {}
    reference = benchmark_class(tmp_path / "repo", **write(tmp_path / "repo", n_items=9, seed=3, **options))
    write(tmp_path / "hub", n_items=9, seed=3, **options)
    originals = sorted((tmp_path / "hub" / "data").glob("test-*.parquet"))
    converted = [tmp_path / "hub" / "default" / "test" / f"{k:04d}.parquet" for k in range(len(originals))]
    for original, target in zip(originals, converted):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(original, target)
    (tmp_path / "hub" / "data").rmdir()
    benchmark = benchmark_class(tmp_path / "hub")
    assert {ref.path for item in benchmark.items() for ref in item.images} == {str(path) for path in converted}
    _same_items(benchmark.items(), reference.items())


def test_one_shard_layout_is_read_and_two_converted_configs_are_refused(tmp_path):
    standin.write_bivlc(tmp_path, n_items=6)
    hub = tmp_path / "default" / "test"
    hub.mkdir(parents=True)
    for k, shard in enumerate(sorted((tmp_path / "data").glob("test-*.parquet"))):
        shutil.copy(shard, hub / f"{k:04d}.parquet")
    # data/ wins and the converted copy is ignored; reading both would count every item twice
    items = BiVLC(tmp_path).items()
    assert len(items) == 6 and {Path(ref.path).parent for i in items for ref in i.images} == {tmp_path / "data"}
    shutil.rmtree(tmp_path / "data")
    shutil.copytree(hub, tmp_path / "other" / "test")
    with pytest.raises(ValueError, match=r"test shards in several folders \(default/test, other/test\)"):
        BiVLC(tmp_path).items()


def test_winoground_explicit_source_needs_its_files_and_ids_must_not_repeat(tmp_path):
    standin.write_winoground(tmp_path / "j", n_items=3)
    with pytest.raises(MissingBenchmarkData, match=re.escape("lacks data/test-*.parquet | */test/*.parquet")):
        Winoground(tmp_path / "j", source="parquet")
    standin.write_winoground(tmp_path / "p", n_items=3, layout="parquet")
    with pytest.raises(MissingBenchmarkData, match="source='jsonl' but .* lacks data/examples.jsonl"):
        Winoground(tmp_path / "p", source="jsonl")
    data = tmp_path / "p" / "data"
    shutil.copy(data / "test-00000-of-00001.parquet", data / "test-00000-of-00001-0a9b.parquet")
    with pytest.raises(ValueError, match=r"ids repeat across the test shards \(e.g. \['0', '1', '2'\]\)"):
        Winoground(tmp_path / "p").items()


def test_biscor_ctrl_and_shapes_swap_standins_load(tmp_path):
    biscor = BiSCoRCtrl(tmp_path / "b", **standin.write_biscor_ctrl(tmp_path / "b", n_items=10))
    items = biscor.items()
    assert [i.id for i in items[:2]] == ["ctrl-0", "ctrl-1"] and items[5].meta == {"category": "Material"}
    assert items[0].images[1].path == str(tmp_path / "b" / "images" / "scene_00001.png")
    assert all(Path(ref.path).is_file() for item in items for ref in item.images)
    shapes = ShapesSwap(tmp_path / "s", **standin.write_shapes_swap(tmp_path / "s", n_items=6))
    reference = load_swap_items(tmp_path / "s", "val")
    assert [(i.id, [r.path for r in i.images], i.texts, i.meta["type"]) for i in shapes.items()] == \
        [(str(r["id"]), r["images"], r["captions"], r["type"]) for r in reference]


# ---------------------------------------------------------------- per-item rule


def test_two_by_two_scores_on_hand_made_matrices_with_ties():
    assert two_by_two_scores(RIGHT) == {"text": True, "image": True, "group": True, "text_i0": True,
                                        "text_i1": True, "image_c0": True, "image_c1": True, "tie": False}
    text_wrong = two_by_two_scores(TEXT_WRONG)
    assert (text_wrong["text"], text_wrong["image"], text_wrong["group"]) == (False, True, False)
    tie = two_by_two_scores(IMAGE_TIE)
    assert (tie["text"], tie["image"], tie["image_c0"], tie["tie"]) == (True, False, False, True)
    # s(C1, I0) > s(C0, I0) makes text wrong; s(C0, I1) > s(C0, I0) makes image wrong
    assert two_by_two_scores(np.array([[0.5, 0.1], [0.6, 0.9]]))["image"] is False


def reference_2x2(s) -> dict:
    """Winoground's definitions written out literally (Thrush et al. 2022), with C_j / I_i indices."""
    def sim(caption, image):
        return s[image][caption]
    text = sim(0, 0) > sim(1, 0) and sim(1, 1) > sim(0, 1)
    image = sim(0, 0) > sim(0, 1) and sim(1, 1) > sim(1, 0)
    return {"text": text, "image": image, "group": text and image}


def test_two_by_two_scores_agree_with_the_literal_definitions_on_random_matrices():
    rng = np.random.default_rng(0)
    for _ in range(300):
        sim = rng.integers(0, 3, size=(2, 2)).astype(float)  # small integers: many ties
        ours, theirs = two_by_two_scores(sim), reference_2x2(sim.tolist())
        assert all(ours[key] == theirs[key] for key in ("text", "image", "group")), sim
        assert ours["tie"] == bool(len({sim[0, 0], sim[0, 1]}) < 2 or len({sim[1, 1], sim[1, 0]}) < 2
                                   or sim[0, 0] == sim[1, 0] or sim[1, 1] == sim[0, 1])


# ---------------------------------------------------------------- aggregates by hand


def _outcome(matrix: np.ndarray, **meta) -> dict:
    return {**meta, **two_by_two_scores(matrix)}


def test_winoground_aggregate_by_hand_overall_and_per_tag():
    outcomes = [_outcome(RIGHT, collapsed_tag="Object", tag="Noun", num_main_preds=1),
                _outcome(TEXT_WRONG, collapsed_tag="Object", tag="Noun", num_main_preds=1),
                _outcome(IMAGE_TIE, collapsed_tag="Relation", tag="Verb", num_main_preds=2),
                _outcome(RIGHT, collapsed_tag="Both", tag="Verb", num_main_preds=2)]
    result = Winoground.aggregate(outcomes)
    assert (result["text"], result["image"], result["group"]) == (75.0, 75.0, 50.0)
    assert result["ties"] == 1 and result["n"] == 4
    assert (result["text/Object"], result["image/Object"], result["group/Object"]) == (50.0, 100.0, 50.0)
    assert (result["text/Relation"], result["image/Relation"]) == (100.0, 0.0)
    assert result["group/tag/Verb"] == 50.0 and result["text/tag/Noun"] == 50.0
    assert result["image/main_preds_2"] == 50.0 and result["image/main_preds_1"] == 100.0


BIVLC_CSV = """\
"caption","negative_caption","type","subtype","text_score_i0","text_score_i1","image_score_c0","image_score_c1","text_score","image_score","group_score"
"a","b","add","obj","True","True","False","True","True","False","False"
"c","d","add","obj","True","True","True","True","True","True","True"
"e","f","add","att","False","True","True","True","False","True","False"
"g","h","replace","rel","True","True","True","True","True","True","True"
"i","j","swap","att","True","False","True","False","False","False","False"
"""


def test_bivlc_aggregate_from_per_item_csv_rows_shaped_like_the_authors_results():
    """Rows in the layout of `IMirandaM/BiVLC:results/BiVLC_ViT-B-32.csv` (image columns left out)."""
    rows = list(csv.DictReader(io.StringIO(BIVLC_CSV)))
    outcomes = [{"type": r["type"], "subtype": r["subtype"], "tie": False, "text": r["text_score"] == "True",
                 "image": r["image_score"] == "True", "group": r["group_score"] == "True"} for r in rows]
    result = BiVLC.aggregate(outcomes)
    assert (result["I2T"], result["T2I"], result["Group"]) == (60.0, 60.0, 40.0)
    assert result["I2T/add"] == pytest.approx(200 / 3) and result["T2I/add"] == pytest.approx(200 / 3)
    assert result["Group/add"] == pytest.approx(100 / 3) and result["Group/replace"] == 100.0
    assert result["I2T/swap"] == 0.0 and result["I2T/add_obj"] == 100.0 and result["T2I/add_obj"] == 50.0
    assert result["I2T/add_att"] == 0.0 and result["Group/replace_rel"] == 100.0


def test_biscor_and_shapes_aggregates_by_hand():
    biscor = BiSCoRCtrl.aggregate([_outcome(RIGHT, category="Color"), _outcome(TEXT_WRONG, category="Color"),
                                   _outcome(IMAGE_TIE, category="Size")])
    assert biscor["group"] == pytest.approx(100 / 3) and biscor["group/Color"] == 50.0 and biscor["text/Size"] == 100.0
    items = [_outcome(RIGHT, type="relation"), _outcome(TEXT_WRONG, type="relation"),
             _outcome(np.array([[0.1, 0.9], [0.9, 0.1]]), type="object")]
    ours = ShapesSwap.aggregate(items)
    # RIGHT is right everywhere; TEXT_WRONG fails text, keeps image; the object item fails all four.
    assert ours["text"] == pytest.approx(100 / 3) and ours["image"] == pytest.approx(200 / 3)
    assert ours["group"] == pytest.approx(100 / 3)
    assert ours["acc_relation"] == 75.0 and ours["acc_object"] == 0.0


# ---------------------------------------------------------------- end to end

PATTERNS = (RIGHT, TEXT_WRONG, IMAGE_TIE)  # item k gets PATTERNS[k % 3]


def _patterned_scorer(benchmark) -> FunctionScorer:
    """A scorer whose matrix on item k is PATTERNS[k % 3] (captions are unique per item)."""
    table = {}
    for position, item in enumerate(benchmark.items()):
        matrix = PATTERNS[position % 3]
        for i, ref in enumerate(item.images):
            for j, text in enumerate(item.texts):
                assert table.setdefault((ref, text), matrix[i, j]) == matrix[i, j]
    return FunctionScorer(lambda ref, text: table[ref, text])


@pytest.mark.parametrize("layout", ["jsonl", "parquet"])
def test_end_to_end_winoground_with_known_answers(tmp_path, layout):
    benchmark = Winoground(tmp_path, **standin.write_winoground(tmp_path, n_items=20, layout=layout))
    result = Winoground.aggregate(benchmark.outcomes(_patterned_scorer(benchmark)))
    # 7 RIGHT, 7 TEXT_WRONG, 6 IMAGE_TIE items
    assert (result["text"], result["image"], result["group"]) == (65.0, 70.0, 35.0)
    assert result["ties"] == 6


def test_end_to_end_bivlc_and_biscor_with_known_answers(tmp_path):
    bivlc = BiVLC(tmp_path / "v", **standin.write_bivlc(tmp_path / "v", n_items=20))
    result = BiVLC.aggregate(bivlc.outcomes(_patterned_scorer(bivlc)))
    assert (result["I2T"], result["T2I"], result["Group"]) == (65.0, 70.0, 35.0)
    # replace_obj holds items 0, 7, 14 -> RIGHT, TEXT_WRONG, IMAGE_TIE
    assert result["Group/replace_obj"] == pytest.approx(100 / 3) and result["I2T/replace_obj"] == pytest.approx(200 / 3)
    biscor = BiSCoRCtrl(tmp_path / "b", **standin.write_biscor_ctrl(tmp_path / "b", n_items=20))
    assert BiSCoRCtrl.aggregate(biscor.outcomes(_patterned_scorer(biscor)))["group"] == 35.0


def test_shapes_swap_with_a_tiny_clip_equals_a_direct_computation(tmp_path):
    from PIL import Image

    from modeling.encoders import build_model

    generate(tmp_path, n_train=4, n_val=6, image_size=64, seed=0, n_swap=9)
    torch.manual_seed(0)
    built = build_model("ViT-Tiny-16-64", None, "configs/models")
    model = built.model.eval()
    items = load_swap_items(tmp_path, "val")
    outcomes = ShapesSwap(tmp_path).outcomes(ClipScorer(model, built.tokenizer, built.preprocess_val))
    expected, choices = [], {}
    with torch.no_grad():
        for item in items:
            pixels = torch.stack([built.preprocess_val(Image.open(p).convert("RGB")) for p in item["images"]])
            image = torch.nn.functional.normalize(model.encode_image(pixels), dim=-1)
            text = torch.nn.functional.normalize(model.encode_text(built.tokenizer(item["captions"])), dim=-1)
            sim = (image @ text.T).tolist()
            expected.append((str(item["id"]), *reference_2x2(sim).values()))
            choices.setdefault(item["type"], []).extend([sim[0][0] > sim[0][1], sim[1][1] > sim[1][0]])
    assert [(o["id"], o["text"], o["image"], o["group"]) for o in outcomes] == expected
    result = ShapesSwap.aggregate(outcomes)
    assert result["group"] == pytest.approx(100.0 * sum(e[3] for e in expected) / len(expected))
    for swap_type, hits in choices.items():
        assert result[f"acc_{swap_type}"] == pytest.approx(100.0 * sum(hits) / len(hits))


# ---------------------------------------------------------------- missing and malformed files


def test_missing_files_are_named(tmp_path):
    accepted = "data/test-*.parquet | */test/*.parquet"
    with pytest.raises(MissingBenchmarkData, match=re.escape(f"expected files: data/examples.jsonl | {accepted}")):
        Winoground(tmp_path)
    with pytest.raises(MissingBenchmarkData, match=re.escape(f"expected files: {accepted}")):
        BiVLC(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test-00000-of-00001.parquet").mkdir()  # a folder named like a shard is not a shard
    with pytest.raises(MissingBenchmarkData, match=re.escape(accepted)):
        BiVLC(tmp_path)
    with pytest.raises(MissingBenchmarkData, match="biscor_ctrl.jsonl"):
        BiSCoRCtrl(tmp_path)
    with pytest.raises(MissingBenchmarkData, match="annotations/swap_train.json"):
        ShapesSwap(tmp_path, split="train")


def test_malformed_winoground_inputs_name_the_file_and_record(tmp_path):
    standin.write_winoground(tmp_path, n_items=3)
    path = tmp_path / "data" / "examples.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    del record["caption_1"]
    path.write_text("\n".join([lines[0], json.dumps(record), lines[2]]))
    with pytest.raises(ValueError, match=r"examples.jsonl: record 1 lacks field 'caption_1'"):
        Winoground(tmp_path).items()
    path.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(ValueError, match="examples.jsonl: line 2 is not JSON"):
        Winoground(tmp_path).items()
    with pytest.raises(ValueError, match="source must be"):
        Winoground(tmp_path, source="zip")


def test_malformed_parquet_and_biscor_inputs_name_the_file_and_column(tmp_path):
    shard = tmp_path / "v" / "data" / "test-00000-of-00001.parquet"
    shard.parent.mkdir(parents=True)
    pq.write_table(pa.table({"caption": ["a"], "negative_caption": ["b"], "type": ["add"], "subtype": ["obj"],
                             "image": [{"bytes": b"x", "path": None}]}), shard)
    with pytest.raises(ValueError, match="test-00000-of-00001.parquet: missing column.*negative_image"):
        BiVLC(tmp_path / "v").items()
    standin.write_biscor_ctrl(tmp_path / "b", n_items=2)
    annotations = tmp_path / "b" / "biscor_ctrl.jsonl"
    first = json.loads(annotations.read_text().splitlines()[0])
    annotations.write_text(json.dumps({key: value for key, value in first.items() if key != "category"}) + "\n")
    with pytest.raises(ValueError, match="biscor_ctrl.jsonl: record 0 lacks field 'category'"):
        BiSCoRCtrl(tmp_path / "b").items()
