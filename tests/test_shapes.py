"""Tests for the shapes world generator (the `datamodules.shapes` package), on real files in tmp_path."""

from __future__ import annotations

import collections
import json
import random
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from datamodules.shapes import (
    BACKGROUND,
    CAPTION_RELATIONS,
    COLORS,
    RELATION_WORDINGS,
    RELATIONS,
    SHAPES,
    SIZES,
    SPLITS,
    SWAP_TYPES,
    Caption,
    Description,
    Scene,
    SceneObject,
    caption_from_dict,
    generate,
    hard_negatives,
    holds,
    load_scene_graphs,
    load_swap_items,
    sample_example,
    scene_from_dict,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
N_IMAGES = {"train": 200, "val": 30, "test": 24, "test_unseen": 21}
N_SWAP = {"train": 20, "val": 30, "test": 24, "test_unseen": 21}  # the defaults: n_train // 10, else n_images
IMAGE_SIZE = 48
CAPTIONS_PER_IMAGE = 2


# Every test of a world runs on both caption styles: relations stated either way, and one way only.
@pytest.fixture(scope="module", params=sorted(CAPTION_RELATIONS))
def dataset(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    generate(root, N_IMAGES["train"], N_IMAGES["val"], image_size=IMAGE_SIZE, seed=3,
             captions_per_image=CAPTIONS_PER_IMAGE, n_test=N_IMAGES["test"], n_test_unseen=N_IMAGES["test_unseen"],
             relations=request.param)
    return root


def _stated_relations(root: Path) -> tuple[str, ...]:
    """The relations the world's captions may state, from the style its caption files record."""
    return CAPTION_RELATIONS[_annotations(root, "captions_train.json")["info"]["relations"]]


def _annotations(root: Path, name: str) -> dict:
    return json.loads((root / "annotations" / name).read_text())


def _all_files(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*") if path.is_file()}


def _pixels(path: Path | str) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def _object_mask(pixels: np.ndarray, bbox: list[int]) -> np.ndarray:
    x0, y0, x1, y1 = bbox
    return np.any(pixels[y0:y1, x0:x1] != BACKGROUND, axis=-1)


def _dominant_color(pixels: np.ndarray, bbox: list[int]) -> tuple[int, ...]:
    """Most frequent non-background colour inside the box."""
    x0, y0, x1, y1 = bbox
    region = pixels[y0:y1, x0:x1].reshape(-1, 3)
    colors = collections.Counter(tuple(int(v) for v in p) for p in region if tuple(p) != BACKGROUND)
    return colors.most_common(1)[0][0]


def _pixel_shape(mask: np.ndarray) -> str:
    """Classify a filled box mask by how much of the box it covers and how wide its bottom row is."""
    fill = mask.mean()
    if fill > 0.95:
        return "square"
    if fill > 0.68:
        return "circle"
    return "triangle" if mask[-1].mean() > 0.8 else "diamond"


def _center(bbox: list[int]) -> tuple[float, float]:
    return (bbox[0] + bbox[2]) / 2, (bbox[1] + bbox[3]) / 2


def _assert_scene_matches_pixels(pixels: np.ndarray, objects: list[dict]) -> None:
    outside = np.ones(pixels.shape[:2], dtype=bool)
    for obj in objects:
        x0, y0, x1, y1 = obj["bbox"]
        outside[y0:y1, x0:x1] = False
        assert _dominant_color(pixels, obj["bbox"]) == COLORS[obj["color"]]
        assert _pixel_shape(_object_mask(pixels, obj["bbox"])) == obj["shape"]
    assert np.all(pixels[outside] == BACKGROUND)


def _sides_by_size(records: list[dict]) -> dict[str, set[int]]:
    sides = collections.defaultdict(set)
    for record in records:
        for obj in record["objects"]:
            sides[obj["size"]].add(obj["bbox"][2] - obj["bbox"][0])
    return sides


# ---------------------------------------------------------------- determinism


def test_same_arguments_give_identical_files_and_other_seed_differs(tmp_path: Path) -> None:
    arguments = {"n_train": 12, "n_val": 6, "image_size": 32, "captions_per_image": 2}
    first, second, other = tmp_path / "first", tmp_path / "second", tmp_path / "other"
    counts = generate(first, seed=1, **arguments)
    generate(second, seed=1, **arguments)
    generate(other, seed=2, **arguments)

    first_files, other_files = _all_files(first), _all_files(other)
    assert first_files == _all_files(second)
    assert not any(name.endswith(".tmp") for name in first_files)
    assert first_files.keys() == other_files.keys()
    changed = [name for name in first_files if first_files[name] != other_files[name]]
    assert "annotations/captions_train.json" in changed
    assert any(name.startswith("images/train/") for name in changed)
    assert counts == {
        "train": {"images": 12, "captions": 24, "swap_items": 1},
        "val": {"images": 6, "captions": 12, "swap_items": 6},
        "test": {"images": 6, "captions": 12, "swap_items": 6},
        "test_unseen": {"images": 6, "captions": 12, "swap_items": 6},
    }


# ---------------------------------------------------------------- schema


@pytest.mark.parametrize("split", SPLITS)
def test_coco_captions_schema_counts_and_images(dataset: Path, split: str) -> None:
    coco = _annotations(dataset, f"captions_{split}.json")
    assert set(coco) == {"info", "images", "annotations"}
    assert len(coco["images"]) == N_IMAGES[split]
    assert len(coco["annotations"]) == N_IMAGES[split] * CAPTIONS_PER_IMAGE
    assert len({image["id"] for image in coco["images"]}) == N_IMAGES[split]
    assert len({ann["id"] for ann in coco["annotations"]}) == len(coco["annotations"])
    assert min(image["id"] for image in coco["images"]) == 1
    for image in coco["images"]:
        assert set(image) == {"id", "file_name", "width", "height"}
        with Image.open(dataset / "images" / split / image["file_name"]) as png:
            assert png.mode == "RGB" and png.size == (IMAGE_SIZE, IMAGE_SIZE)
        assert (image["width"], image["height"]) == (IMAGE_SIZE, IMAGE_SIZE)
    image_ids = {image["id"] for image in coco["images"]}
    captions_by_image = collections.defaultdict(list)
    for ann in coco["annotations"]:
        assert set(ann) == {"id", "image_id", "caption", "neg_captions"}
        assert ann["image_id"] in image_ids
        assert len(ann["neg_captions"]) == 3 and len(set(ann["neg_captions"])) == 3
        assert ann["caption"] not in ann["neg_captions"]
        captions_by_image[ann["image_id"]].append(ann["caption"])
    assert all(len(set(captions)) == CAPTIONS_PER_IMAGE for captions in captions_by_image.values())


@pytest.mark.parametrize("split", SPLITS)
def test_scene_graph_schema_matches_captions(dataset: Path, split: str) -> None:
    records = load_scene_graphs(dataset, split)
    coco = _annotations(dataset, f"captions_{split}.json")
    annotations = {ann["id"]: ann for ann in coco["annotations"]}
    assert [r["image_id"] for r in records] == [image["id"] for image in coco["images"]]
    for record in records:
        objects = record["objects"]
        assert 2 <= len(objects) <= 3
        assert len({(o["size"], o["color"], o["shape"]) for o in objects}) == len(objects)
        assert len({o["id"] for o in objects}) == len(objects)
        for obj in objects:
            assert set(obj) == {"id", "shape", "color", "size", "bbox"}
            assert obj["shape"] in SHAPES and obj["color"] in COLORS and obj["size"] in SIZES
            x0, y0, x1, y1 = obj["bbox"]
            assert 0 <= x0 < x1 <= IMAGE_SIZE and 0 <= y0 < y1 <= IMAGE_SIZE
        object_ids = {o["id"] for o in objects}
        assert record["relations"], "non-overlapping objects always stand in some relation"
        for relation in record["relations"]:
            assert relation["predicate"] in RELATIONS
            assert {relation["subject"], relation["object"]} <= object_ids
        for caption in record["captions"]:
            ann = annotations[caption["caption_id"]]
            assert ann["image_id"] == record["image_id"] and ann["caption"] == caption["caption"]
            assert [caption_from_dict(n).text for n in caption["neg_structures"]] == ann["neg_captions"]


@pytest.mark.parametrize("split", SPLITS)
def test_swap_file_schema_and_counts(dataset: Path, split: str) -> None:
    items = _annotations(dataset, f"swap_{split}.json")["items"]
    assert len(items) == N_SWAP[split]
    assert len({item["id"] for item in items}) == len(items)
    for item in items:
        assert {"id", "type", "images", "captions"} <= set(item)
        assert item["type"] in SWAP_TYPES and len(item["captions"]) == 2
        for path in item["images"]:
            assert path.startswith(f"images/swap_{split}/") and (dataset / path).is_file()


def test_invalid_arguments_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="image_size"):
        generate(tmp_path, 2, 2, image_size=16)
    with pytest.raises(ValueError, match="captions_per_image"):
        generate(tmp_path, 2, 2, captions_per_image=0)
    with pytest.raises(ValueError, match="non-negative"):
        generate(tmp_path, 2, 2, n_test_unseen=-1)
    with pytest.raises(ValueError, match="relations must be one of"):
        generate(tmp_path, 2, 2, relations="converse")


# ---------------------------------------------------------------- semantics


@pytest.mark.parametrize("split", SPLITS)
def test_every_caption_true_and_every_negative_false(dataset: Path, split: str) -> None:
    for record in load_scene_graphs(dataset, split):
        scene = scene_from_dict(record)
        for caption in record["captions"]:
            structure = caption_from_dict(caption["structure"])
            assert structure.text == caption["caption"]
            assert holds(scene, structure), caption["caption"]
            for negative in caption["neg_structures"]:
                assert not holds(scene, caption_from_dict(negative)), caption_from_dict(negative).text


@pytest.mark.parametrize("split", SPLITS)
def test_scene_graphs_match_pixels(dataset: Path, split: str) -> None:
    records = load_scene_graphs(dataset, split)
    for record in records:
        _assert_scene_matches_pixels(_pixels(dataset / "images" / split / record["file_name"]), record["objects"])
    sides = _sides_by_size(records)
    assert max(sides["small"]) < min(sides["large"])


def test_caption_relations_and_colours_hold_on_pixels(dataset: Path) -> None:
    checked = 0
    for record in load_scene_graphs(dataset, "train"):
        pixels = _pixels(dataset / "images" / "train" / record["file_name"])
        for caption in record["captions"]:
            structure = caption["structure"]
            if structure["relation"] is None:
                continue
            (relation_phrase,) = [p for p in caption["phrases"] if p["type"] == "relation"]
            subject_box, object_box = relation_phrase["boxes"]
            (subject_x, subject_y), (object_x, object_y) = _center(subject_box), _center(object_box)
            assert {
                "left of": subject_x < object_x,
                "right of": subject_x > object_x,
                "above": subject_y < object_y,
                "below": subject_y > object_y,
            }[structure["relation"]], caption["caption"]
            assert _dominant_color(pixels, subject_box) == COLORS[structure["subject"]["color"]]
            assert _dominant_color(pixels, object_box) == COLORS[structure["object"]["color"]]
            checked += 1
    assert checked > 100


def _scene(*objects: tuple[str, str, str, tuple[int, int, int, int]]) -> Scene:
    return Scene(64, tuple(SceneObject(i + 1, shape, color, size, box) for i, (size, color, shape, box) in
                           enumerate(objects)))


def test_checker_on_hand_made_scene() -> None:
    scene = _scene(("large", "red", "square", (2, 20, 24, 42)), ("small", "blue", "circle", (40, 24, 53, 37)))
    red_square, blue_circle = Description("red", "square"), Description("blue", "circle", "small")
    assert holds(scene, Caption("plain", red_square, "left of", blue_circle))
    assert holds(scene, Caption("plain", blue_circle, "right of", red_square))
    assert not holds(scene, Caption("plain", blue_circle, "left of", red_square))
    # The centres differ by 1.5 px vertically: far below the margin, so neither "above" nor "below".
    assert not holds(scene, Caption("plain", red_square, "above", blue_circle))
    assert not holds(scene, Caption("plain", blue_circle, "above", red_square))
    assert not holds(scene, Caption("plain", Description("red", "square", "small"), "left of", blue_circle))
    assert holds(scene, Caption("single", Description("blue", "circle")))
    assert not holds(scene, Caption("single", Description("blue", "square")))


class _RefusingExchangedRoles:
    """A split rule that refuses any negative whose subject is `obj`: the relation flip's first candidate."""

    def __init__(self, obj: Description) -> None:
        self.obj = obj

    def allows_negative(self, candidate: Caption) -> bool:
        return candidate.subject != self.obj


def test_relation_flip_never_states_a_relation_the_world_does_not() -> None:
    scene = _scene(("large", "red", "square", (2, 2, 24, 24)), ("large", "blue", "circle", (40, 40, 62, 62)))
    caption = Caption("plain", Description("red", "square"), "above", Description("blue", "circle"))
    rule = _RefusingExchangedRoles(caption.obj)
    # Stated either way, the flip's next candidate is the converse relation ...
    both = hard_negatives(random.Random(0), scene, caption, rule, CAPTION_RELATIONS["both"])
    assert both[1] == replace(caption, relation="below")
    # ... which a one-way world never states: its next candidate, an absent colour, is taken instead.
    one_way = hard_negatives(random.Random(0), scene, caption, rule, CAPTION_RELATIONS["one-way"])
    assert one_way[1].relation == "above" and one_way[1].subject.color not in {"red", "blue"}
    assert not any(holds(scene, negative) for negative in both + one_way)


def test_negatives_fall_back_when_a_swap_is_still_true() -> None:
    # Both objects red: swapping colours gives the caption back, which must not be used as a negative.
    scene = _scene(("large", "red", "square", (2, 2, 24, 24)), ("large", "red", "circle", (40, 40, 62, 62)))
    caption = Caption("is", Description("red", "square"), "above", Description("red", "circle"))
    assert holds(scene, caption)
    negatives = hard_negatives(random.Random(0), scene, caption)
    assert len(negatives) == 3 and len({n.text for n in negatives}) == 3
    assert caption.text not in {n.text for n in negatives}
    assert not any(holds(scene, negative) for negative in negatives)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), image_size=st.integers(32, 96), count=st.integers(1, 4))
def test_sampled_examples_are_consistent(seed: int, image_size: int, count: int) -> None:
    example = sample_example(random.Random(seed), 1, image_size, count)
    assert len({caption.text for caption in example.captions}) == count
    for caption, negatives in zip(example.captions, example.negatives):
        assert holds(example.scene, caption)
        assert not any(holds(example.scene, negative) for negative in negatives)
        assert len({negative.text for negative in negatives} | {caption.text}) == 4


# ---------------------------------------------------------------- captions and phrases


def _template_of(caption: str) -> str:
    """The caption with attribute words and relation wordings replaced by placeholders."""
    text = f" {caption} "
    wordings = sorted((w for ws in RELATION_WORDINGS.values() for w in ws), key=len, reverse=True)
    for wording in wordings:
        text = text.replace(f" {wording} ", " REL ")
    words = ["a" if w == "an" else w for w in text.split() if w not in SIZES]
    return " ".join("COLOR" if w in COLORS else "SHAPE" if w in SHAPES else w for w in words)


def test_captions_use_varied_templates(dataset: Path) -> None:
    captions = [ann["caption"] for ann in _annotations(dataset, "captions_train.json")["annotations"]]
    templates = {_template_of(caption) for caption in captions}
    assert len(templates) >= 8, templates
    words = collections.Counter(word for caption in captions for word in caption.split())
    assert all(words[size] > 0 for size in SIZES)
    stated = {structure["relation"] for image in load_scene_graphs(dataset, "train")
              for structure in (caption["structure"] for caption in image["captions"])} - {None}
    assert stated == set(_stated_relations(dataset))
    assert any(" to the left of " in caption for caption in captions)
    assert any(re.search(r"(?<!the) left of ", caption) for caption in captions)
    assert any(not set(caption.split()) & set(SIZES) for caption in captions), "size is sometimes omitted"


@pytest.mark.parametrize("split", SPLITS)
def test_captions_negatives_and_swap_items_state_only_the_worlds_relations(dataset: Path, split: str) -> None:
    # A negative stating a relation that no true caption states would be false by its wording alone.
    allowed = set(_stated_relations(dataset)) | {None}
    for image in load_scene_graphs(dataset, split):
        for caption in image["captions"]:
            assert {s["relation"] for s in [caption["structure"], *caption["neg_structures"]]} <= allowed
    assert {s["relation"] for item in load_swap_items(dataset, split) for s in item["structures"]} <= allowed
    if allowed == {None, "left of", "above"}:
        texts = [a["caption"] for a in _annotations(dataset, f"captions_{split}.json")["annotations"]]
        assert not any(word in text.split() for text in texts for word in ("right", "below", "under", "beneath"))


@pytest.mark.parametrize("split", SPLITS)
def test_phrases_point_into_caption_and_image(dataset: Path, split: str) -> None:
    for record in load_scene_graphs(dataset, split):
        object_boxes = {tuple(obj["bbox"]): obj for obj in record["objects"]}
        for caption in record["captions"]:
            text, phrases = caption["caption"], caption["phrases"]
            kinds = collections.Counter(phrase["type"] for phrase in phrases)
            is_pair = caption["structure"]["relation"] is not None
            assert kinds == ({"attribute": 2, "relation": 1} if is_pair else {"attribute": 1})
            for phrase in phrases:
                start, end = phrase["char_span"]
                assert text[start:end] == phrase["text"]
                assert len(phrase["boxes"]) == (2 if phrase["type"] == "relation" else 1)
                for box in phrase["boxes"]:
                    assert 0 <= box[0] < box[2] <= IMAGE_SIZE and 0 <= box[1] < box[3] <= IMAGE_SIZE
                    assert tuple(box) in object_boxes
                if phrase["type"] == "attribute":
                    obj = object_boxes[tuple(phrase["boxes"][0])]
                    assert phrase["text"].endswith(f"{obj['color']} {obj['shape']}")


# ---------------------------------------------------------------- swap benchmark


def _changed_objects(item: dict) -> list[tuple[dict, dict]]:
    first, second = (scene["objects"] for scene in item["scenes"])
    return [(a, b) for a, b in zip(first, second) if a != b]


@pytest.mark.parametrize("split", SPLITS)
def test_swap_items_differ_only_by_their_swap(dataset: Path, split: str) -> None:
    items = load_swap_items(dataset, split)
    type_counts = collections.Counter(item["type"] for item in items)
    assert set(type_counts) == set(SWAP_TYPES)
    assert max(type_counts.values()) - min(type_counts.values()) <= 1
    for item in items:
        first, second = item["captions"]
        assert first != second
        assert collections.Counter(first.split()) == collections.Counter(second.split())
        scenes = [scene_from_dict(scene) for scene in item["scenes"]]
        structures = [caption_from_dict(structure) for structure in item["structures"]]
        assert [structure.text for structure in structures] == item["captions"]
        for index in (0, 1):
            assert holds(scenes[index], structures[index])
            assert not holds(scenes[1 - index], structures[index])
        changed = _changed_objects(item)
        assert len(changed) == 2, "only the two captioned objects change"
        changed_field = {"attribute": "color", "relation": "bbox", "object": "shape"}[item["type"]]
        for before, after in changed:
            assert {k for k in before if before[k] != after[k]} == {changed_field}


@pytest.mark.parametrize("split", SPLITS)
def test_swap_images_exist_and_match_their_scenes(dataset: Path, split: str) -> None:
    for item in load_swap_items(dataset, split):
        for path, scene in zip(item["images"], item["scenes"]):
            assert Path(path).is_absolute()
            pixels = _pixels(path)
            assert pixels.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
            _assert_scene_matches_pixels(pixels, scene["objects"])


# ---------------------------------------------------------------- CLI


def test_cli_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    command = [sys.executable, "-m", "datamodules.shapes", "--out", str(out), "--n-train", "4", "--n-val", "2",
               "--image-size", "32", "--seed", "5", "--captions-per-image", "3", "--n-swap", "3", "--n-test", "1",
               "--n-test-unseen", "2", "--relations", "one-way"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "train": {"images": 4, "captions": 12, "swap_items": 3},
        "val": {"images": 2, "captions": 6, "swap_items": 3},
        "test": {"images": 1, "captions": 3, "swap_items": 3},
        "test_unseen": {"images": 2, "captions": 6, "swap_items": 3},
    }
    assert len(list((out / "images" / "train").glob("*.png"))) == 4
    assert len(list((out / "images" / "test_unseen").glob("*.png"))) == 2
    assert len(_annotations(out, "captions_train.json")["annotations"]) == 12
    assert _annotations(out, "captions_train.json")["info"]["relations"] == "one-way"
    assert len(list((out / "images" / "swap_val").glob("*.png"))) == 6
    assert len(load_swap_items(out, "val")) == 3
