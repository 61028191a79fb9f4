"""VL-CheckList: the corpus YAMLs, first-N-with-an-image sampling, strict scoring and the category means."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from evaluation import evaluate
from evaluation.benchmarks.base import ImageRef, MissingBenchmarkData
from testkit.standin.vlchecklist import official_paths, write_vl_checklist
from evaluation.benchmarks.vlchecklist import TAXONOMY, VLCheckList, dataset_of, first_with_image
from evaluation.scorers import FunctionScorer

N_ITEMS = 20
MISSING_KEPT = [i for i in range(N_ITEMS) if i % 3 != 1]  # Attribute/color/vaw: every third image is missing
N_SOURCES = sum(len(names) for names in TAXONOMY.values())


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlc") / "VL-CheckList"
    return root, write_vl_checklist(root, n_items=N_ITEMS)


def test_official_yaml_paths_of_the_standin():
    assert N_SOURCES == 56
    assert official_paths("Relation/spatial", "vg") == ("data/Relation/vg/spatial.json", "vg/")
    assert official_paths("Object/Location/center", "hake") == \
        ("data/Object/Location/hake_location/hake_obj_center.json", "hake/")
    assert official_paths("Object/Size/small", "vg_obj") == ("data/Object/Size/vg_size/vg_obj_small.json", "vg/")
    assert official_paths("Attribute/color", "vaw") == ("data/Attribute/vaw/color.json", "vg")


def test_standin_loads_with_stripped_texts_and_images_under_the_images_option(standin):
    root, options = standin
    benchmark = VLCheckList(root, **options)
    items = benchmark.items()
    assert len(items) == 54 * N_ITEMS + len(MISSING_KEPT) + 1000
    by_id = {item.id: item for item in items}
    first = by_id["Object/Location/center/hake/0"]
    # POS[0] first; the NEG text " Object/..." loses its leading space
    assert first.texts == ["Object/Location/center/hake positive 0", "Object/Location/center/hake negative 0"]
    assert first.images == [ImageRef(str(Path(options["images"]) / "hake" / "openimages" / "0000000000000000.jpg"))]
    vaw = by_id["Attribute/color/vaw/2"]
    assert vaw.images[0].path == str(Path(options["images"]) / "vg" / "VG_100K" / "2317899.jpg")  # IMG_ROOT "vg"
    kept = [int(i.id.rsplit("/", 1)[1]) for i in items if i.id.startswith("Attribute/color/vaw/")]
    assert kept == MISSING_KEPT
    spatial = [i for i in items if i.id.startswith("Relation/spatial/vg/")]
    assert [int(i.id.rsplit("/", 1)[1]) for i in spatial] == list(range(1000))  # the default cap
    assert spatial[0].meta["beyond_cap"] == N_ITEMS and vaw.meta["skipped_missing_image"] == N_ITEMS - len(MISSING_KEPT)
    assert all(Path(ref.path).is_file() for ref in benchmark.image_refs())


def test_first_n_with_an_existing_image_in_file_order():
    paths = [f"img{i}.jpg" for i in range(1, 9)]  # items 1..8; item 2 has no image
    kept, missing, beyond = first_with_image(paths, lambda path: path != "img2.jpg", cap=4)
    assert [paths[i] for i in kept] == ["img1.jpg", "img3.jpg", "img4.jpg", "img5.jpg"]
    assert (missing, beyond) == (1, 3)  # items 6, 7, 8 have an image but fall beyond the cap
    assert first_with_image(paths, lambda path: path != "img2.jpg", cap=None) == ([0, 2, 3, 4, 5, 6, 7], 1, 0)


def test_max_items_option_keeps_the_first_items_with_an_image(standin):
    root, options = standin
    items = VLCheckList(root, max_items=5, **options).items()
    vaw = [i for i in items if i.id.startswith("Attribute/color/vaw/")]
    assert [i.id.rsplit("/", 1)[1] for i in vaw] == ["0", "2", "3", "5", "6"]
    assert vaw[0].meta["beyond_cap"] == len(MISSING_KEPT) - 5
    assert len(items) == N_SOURCES * 5


def test_strict_comparison_makes_ties_wrong(standin):
    root, options = standin
    benchmark = VLCheckList(root, **options)
    item = benchmark.items()[0]
    assert benchmark.outcome(item, np.array([[0.3, 0.2]]))["correct"] is True
    tie = benchmark.outcome(item, np.array([[0.3, 0.3]]))
    assert tie["correct"] is False and tie["tie"] is True
    assert benchmark.outcome(item, np.array([[0.2, 0.3]]))["correct"] is False


def outcome(subtype: str, source: str, correct: bool, skipped: int = 0, beyond: int = 0) -> dict:
    return {"id": f"{subtype}/{source}", "type": subtype, "source": source, "correct": correct, "tie": False,
            "source_skipped_missing_image": skipped, "source_beyond_cap": beyond}


def hand_made_outcomes(correct: dict[tuple[str, str], list[bool]], skip: set = frozenset(), **counts) -> list:
    """One correct outcome per (type, source) of the taxonomy, except the listed ones; `skip` has none."""
    return [outcome(t, s, hit, **counts.get(f"{t}/{s}", {})) for t, names in TAXONOMY.items() for s in names
            if (t, s) not in skip for hit in correct.get((t, s), [True])]


def test_official_dataset_grouping_of_every_source():
    """`vl_checklist/corpus.json`: Object files group into vg (obj, subj), swig (4 roles) and hake; every
    Attribute and Relation file is a dataset of its own."""
    assert {s: dataset_of(s) for s in TAXONOMY["Object/Size/small"]} == {
        "hake": "hake", "swig_agent": "swig", "swig_destination": "swig", "swig_item": "swig", "swig_tool": "swig",
        "vg_obj": "vg", "vg_subj": "vg"}
    assert [dataset_of(s) for s in TAXONOMY["Attribute/state"]] == ["vaw", "vg"]
    assert [dataset_of(s) for s in TAXONOMY["Relation/action"]] == ["hake", "swig", "vg"]
    assert [dataset_of(s) for s in TAXONOMY["Relation/spatial"]] == ["vg"]


def test_sub_types_average_datasets_not_sources_as_the_authors_chart_does():
    """Hand-made outcomes where the mean over datasets and the mean over the 7 sources differ."""
    margin, small = "Object/Location/margin", "Object/Size/small"
    correct = {(margin, "hake"): [True], (margin, "swig_agent"): [False], (margin, "swig_destination"): [False],
               (margin, "swig_item"): [True, False], (margin, "swig_tool"): [False], (margin, "vg_obj"): [True],
               (margin, "vg_subj"): [False], (small, "hake"): [False],
               ("Attribute/color", "vaw"): [True, False], ("Relation/action", "hake"): [False],
               ("Relation/spatial", "vg"): [True, False, False, False]}
    counts = {"Attribute/color/vaw": {"skipped": 3}, "Relation/spatial/vg": {"beyond": 7}}
    result = VLCheckList.aggregate(hand_made_outcomes(correct, **counts))
    # margin: hake 100, swig (0 + 0 + 50 + 0) / 4 = 12.5, vg (100 + 0) / 2 = 50; over the 7 sources it is 250 / 7
    assert result["Object/Location/margin/swig_item"] == 50.0 and result["dataset/Object/Location/margin/swig"] == 12.5
    assert result["dataset/Object/Location/margin/vg"] == 50.0 and result["dataset/Object/Location/margin/hake"] == 100
    assert result[margin] == pytest.approx(162.5 / 3) and result[margin] != pytest.approx(250 / 7)
    # small: hake 0, swig 100, vg 100 -> 200 / 3 (over the sources: 600 / 7)
    assert result[small] == pytest.approx(200 / 3)
    assert result["Object/Location"] == pytest.approx((200 + 162.5 / 3) / 3)
    assert result["Object/Size"] == pytest.approx((200 + 200 / 3) / 3)
    assert result["object"] == pytest.approx((400 + 162.5 / 3 + 200 / 3) / 6)
    assert result["Attribute/color"] == 75.0 and result["attribute"] == 95.0
    assert result["Relation/action"] == pytest.approx(200 / 3) and result["Relation/spatial"] == 25.0
    assert result["relation"] == pytest.approx(275 / 6)
    assert result["average"] == pytest.approx(((400 + 162.5 / 3 + 200 / 3) / 6 + 95 + 275 / 6) / 3)
    assert result["object_location_size"] == pytest.approx(((200 + 162.5 / 3) / 3 + (200 + 200 / 3) / 3) / 2)
    assert result["partial"] == 0.0 and result["missing_sources"] == 0 and result["items"] == 56 + 5
    assert result["skipped_missing_image"] == 3 and result["skipped_missing_image/Attribute/color/vaw"] == 3
    assert result["beyond_cap"] == 7 and result["beyond_cap/Relation/spatial/vg"] == 7


def test_missing_sources_make_the_aggregates_partial_with_means_over_what_is_present():
    large = "Object/Size/large"
    skip = {(large, "swig_tool"), ("Relation/spatial", "vg")}
    result = VLCheckList.aggregate(hand_made_outcomes({(large, "swig_agent"): [False]}, skip=skip))
    assert result["partial"] == 1.0 and result["missing_sources"] == 2
    assert result["missing/Object/Size/large/swig_tool"] == 1.0 and result["missing/Relation/spatial/vg"] == 1.0
    assert "Object/Size/large/swig_tool" not in result
    # large: hake 100, swig over its 3 present roles (0 + 100 + 100) / 3, vg 100
    assert result["dataset/Object/Size/large/swig"] == pytest.approx(200 / 3)
    assert result[large] == pytest.approx((200 + 200 / 3) / 3)
    assert np.isnan(result["Relation/spatial"]) and result["relation"] == 100.0  # over the present sub-type
    assert result["object"] == pytest.approx((500 + (200 + 200 / 3) / 3) / 6)
    assert result["average"] == pytest.approx((result["object"] + 200) / 3)


def index_of(text: str) -> int:
    return int(re.search(r"(\d+)$", text).group(1))


def test_end_to_end_with_a_function_scorer_on_standin_data(standin):
    """POS wins on even entry indices and ties on odd ones, so every source scores its share of even indices."""
    root, options = standin

    def similarity(image: ImageRef, text: str) -> float:
        return 1.0 if " positive " in text and index_of(text) % 2 == 0 else 0.0

    result = VLCheckList.aggregate(VLCheckList(root, **options).outcomes(FunctionScorer(similarity)))
    vaw = 100 * sum(i % 2 == 0 for i in MISSING_KEPT) / len(MISSING_KEPT)  # 7 of 13
    assert result["Attribute/color/vaw"] == pytest.approx(vaw) and result["Relation/spatial/vg"] == 50.0
    assert result["object"] == 50.0 and result["relation"] == 50.0
    assert result["attribute"] == pytest.approx((4 * 50 + (vaw + 50) / 2) / 5)
    assert result["average"] == pytest.approx((50 + result["attribute"] + 50) / 3)
    odd = 54 * N_ITEMS // 2 + sum(i % 2 for i in MISSING_KEPT) + 500
    assert result["ties"] == odd and result["items"] == 54 * N_ITEMS + len(MISSING_KEPT) + 1000
    assert result["skipped_missing_image"] == 7 and result["beyond_cap"] == N_ITEMS
    assert result["partial"] == 0.0 and result["missing_sources"] == 0


def test_an_empty_source_is_an_error_naming_it(tmp_path):
    root = tmp_path / "vlc"
    options = write_vl_checklist(root, n_items=3)
    (root / official_paths("Object/Size/large", "swig_tool")[0]).write_text("[]")
    with pytest.raises(MissingBenchmarkData, match=r"Object/Size/large/swig_tool: .*swig_tool_large.json has no "
                                                   r"entries.*allow_partial=true"):
        VLCheckList(root, max_items=3, **options).items()


def test_missing_yaml_and_annotation_files_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match="corpus/v1/Relation/spatial/vg.yaml"):
        VLCheckList(tmp_path)
    root = tmp_path / "vlc"
    options = write_vl_checklist(root, n_items=2)
    (root / "data/Relation/vg/spatial.json").unlink()
    (root / official_paths("Attribute/size", "vaw")[0]).unlink()
    with pytest.raises(MissingBenchmarkData, match=r"2 \(type, source\).*Attribute/size/vaw: annotation file .*"
                                                   r"Relation/spatial/vg: .*data/Relation/vg/spatial.json \(named by "
                                                   r"corpus/v1/Relation/spatial/vg.yaml\)"):
        VLCheckList(root, **options)


def break_four_sources(root: Path) -> None:
    """No YAML for Relation/spatial/vg, no annotation file for Object/Size/large/swig_tool, no entries in
    Attribute/state/vg, and no existing image in Attribute/size/vaw."""
    (root / "corpus/v1/Relation/spatial/vg.yaml").unlink()
    (root / official_paths("Object/Size/large", "swig_tool")[0]).unlink()
    (root / official_paths("Attribute/state", "vg")[0]).write_text("[]")
    entries = [[f"VG_100K/absent_{i}.jpg", {"POS": ["a"], "NEG": ["b"]}] for i in range(3)]
    (root / official_paths("Attribute/size", "vaw")[0]).write_text(json.dumps(entries))


def test_allow_partial_scores_what_is_present_and_says_what_is_missing(tmp_path):
    root = tmp_path / "vlc"
    options = write_vl_checklist(root, n_items=3)
    break_four_sources(root)
    with pytest.raises(MissingBenchmarkData, match="Relation/spatial/vg"):
        VLCheckList(root, max_items=3, **options)
    benchmark = VLCheckList(root, max_items=3, allow_partial=True, **options)
    outcomes = benchmark.outcomes(FunctionScorer(lambda image, text: float("positive" in text)))
    assert len(outcomes) == (56 - 4 - 1) * 3 + 2  # Attribute/color/vaw lacks the image of its entry 1
    assert sorted(benchmark.missing) == ["Attribute/size/vaw", "Attribute/state/vg", "Object/Size/large/swig_tool",
                                         "Relation/spatial/vg"]
    assert "no entries" in benchmark.missing["Attribute/state/vg"]
    assert "none of its 3 images exists" in benchmark.missing["Attribute/size/vaw"]
    result = VLCheckList.aggregate(outcomes)
    assert result["partial"] == 1.0 and result["missing_sources"] == 4
    assert {key for key in result if key.startswith("missing/")} == {f"missing/{key}" for key in benchmark.missing}
    assert np.isnan(result["Relation/spatial"]) and result["Attribute/state"] == 100.0  # vaw is present
    assert result["object"] == result["attribute"] == result["relation"] == result["average"] == 100.0


def test_allow_partial_is_set_from_the_cli_and_checked(tmp_path):
    root = tmp_path / "bench" / "vl_checklist"
    options = write_vl_checklist(root, n_items=2)
    break_four_sources(root)
    args = evaluate.parse_args(["--benchmarks", "vl_checklist", "--data-root", str(tmp_path / "bench"),
                                f"options.vl_checklist.images={options['images']}",
                                "options.vl_checklist.allow_partial=true"])
    benchmark = evaluate.select_benchmarks(args)["vl_checklist"]
    assert benchmark.allow_partial is True and "Relation/spatial/vg" in benchmark.missing
    with pytest.raises(TypeError, match="allow_partial must be true or false"):
        VLCheckList(root, allow_partial="sometimes", **options)


def test_allow_partial_with_nothing_to_score_is_an_error(tmp_path):
    root = tmp_path / "vlc"
    write_vl_checklist(root, n_items=2)
    with pytest.raises(MissingBenchmarkData, match=r"no \(type, source\) .* can be scored"):
        VLCheckList(root, images=tmp_path / "nowhere", allow_partial=True).items()


def test_malformed_inputs_are_clear_errors(tmp_path):
    root = tmp_path / "vlc"
    options = write_vl_checklist(root, n_items=2)
    annotation = root / "data/Attribute/vg/state.json"
    annotation.write_text(json.dumps([["VG_100K/1.jpg", {"POS": ["a"], "NEG": ["b"]}], ["VG_100K/2.jpg", {"POS": []}]]))
    with pytest.raises(ValueError, match=r"state.json: entry 1 is not \[image_path"):
        VLCheckList(root, **options).items()
    yaml_file = root / "corpus/v1/Attribute/state/vg.yaml"
    yaml_file.write_text('ANNO_PATH: "data/Attribute/vg/state.json"\nTYPE: "TUPLE_JSON"\n')
    with pytest.raises(ValueError, match=r"vg.yaml: expected a string 'IMG_ROOT'"):
        VLCheckList(root, **options)


def test_wrong_images_folder_is_an_error_not_an_empty_source(tmp_path):
    root = tmp_path / "vlc"
    write_vl_checklist(root, n_items=2)
    with pytest.raises(MissingBenchmarkData, match=r"56 \(type, source\).*Object/Location/center/hake: none of its 2 "
                                                   r"images exists under .*`images`"):
        VLCheckList(root, images=tmp_path / "nowhere").items()
