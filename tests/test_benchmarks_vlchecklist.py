"""VL-CheckList: the corpus YAMLs, first-N-with-an-image sampling, strict scoring and the category means."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from datamodules.benchmarks.base import ImageRef, MissingBenchmarkData
from datamodules.benchmarks.standin.vlchecklist import official_paths, write_vl_checklist
from datamodules.benchmarks.vlchecklist import TAXONOMY, VLCheckList, first_with_image
from lightning_modules.scorers import FunctionScorer

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


def test_category_means_from_hand_made_outcomes():
    wrong = {("Object/Location/center", "hake"), ("Relation/spatial", "vg")}
    outcomes = [outcome(t, s, (t, s) not in wrong, beyond=7 if t == "Relation/spatial" else 0)
                for t, names in TAXONOMY.items() for s in names if (t, s) != ("Object/Size/large", "swig_tool")]
    outcomes.append(outcome("Attribute/color", "vaw", False, skipped=3))  # color/vaw: 1 of 2 right
    outcomes = [dict(o, source_skipped_missing_image=3) if o["id"] == "Attribute/color/vaw" else o for o in outcomes]
    result = VLCheckList.aggregate(outcomes)
    center = 6 * 100 / 7
    assert result["Object/Location/center/hake"] == 0.0 and result["Object/Location/center"] == pytest.approx(center)
    assert result["Object/Size/large"] == 100.0 and "Object/Size/large/swig_tool" not in result
    assert result["object"] == pytest.approx((center + 5 * 100) / 6)
    assert result["Attribute/color"] == pytest.approx((50 + 100) / 2)
    assert result["attribute"] == pytest.approx((75 + 4 * 100) / 5)
    assert result["relation"] == pytest.approx((100 + 0) / 2)
    assert result["average"] == pytest.approx((result["object"] + 95 + 50) / 3)
    location = (center + 200) / 3
    assert result["object_location_size"] == pytest.approx((location + 100) / 2)
    assert result["empty_sources"] == 1 and result["items"] == 56
    assert result["skipped_missing_image"] == 3 and result["skipped_missing_image/Attribute/color/vaw"] == 3
    assert result["beyond_cap"] == 7 and result["beyond_cap/Relation/spatial/vg"] == 7


def test_a_missing_subtype_makes_its_category_nan_not_smaller():
    outcomes = [outcome(t, s, True) for t, names in TAXONOMY.items() for s in names if t != "Relation/spatial"]
    result = VLCheckList.aggregate(outcomes)
    assert np.isnan(result["Relation/spatial"]) and np.isnan(result["relation"]) and np.isnan(result["average"])
    assert result["object"] == 100.0


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
    assert result["skipped_missing_image"] == 7 and result["beyond_cap"] == N_ITEMS and result["empty_sources"] == 0


def test_an_empty_source_is_skipped_and_counted(tmp_path):
    root = tmp_path / "vlc"
    options = write_vl_checklist(root, n_items=3)
    (root / official_paths("Object/Size/large", "swig_tool")[0]).write_text("[]")
    benchmark = VLCheckList(root, max_items=3, **options)
    assert not [i for i in benchmark.items() if i.id.startswith("Object/Size/large/swig_tool/")]
    result = VLCheckList.aggregate(benchmark.outcomes(FunctionScorer(lambda image, text: float("positive" in text))))
    assert result["empty_sources"] == 1 and result["Object/Size/large"] == 100.0


def test_missing_yaml_and_annotation_files_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match="corpus/v1/Relation/spatial/vg.yaml"):
        VLCheckList(tmp_path)
    root = tmp_path / "vlc"
    options = write_vl_checklist(root, n_items=2)
    (root / "data/Relation/vg/spatial.json").unlink()
    with pytest.raises(MissingBenchmarkData, match=r"data/Relation/vg/spatial.json \(named by corpus/v1/Relation"):
        VLCheckList(root, **options)


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
    with pytest.raises(MissingBenchmarkData, match=r"none of the 2 images of Object/Location/center/hake.*`images`"):
        VLCheckList(root, images=tmp_path / "nowhere").items()
