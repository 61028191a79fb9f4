"""The shapes world's splits: held-out colour-shape combinations and colour pairs stay out of train / val / test.

The leak checks read what a model sees, independently of the generator's own structures: object colours and
shapes from the pixels, combinations and colour pairs from the caption text.
"""

from __future__ import annotations

import collections
import itertools
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import datamodules.shapes
from datamodules.shapes import (
    COLORS,
    HELDOUT_COLOR_PAIRS,
    SHAPES,
    SPLITS,
    UNSEEN_SPLIT,
    Caption,
    Description,
    HeldOut,
    Scene,
    SceneObject,
    SplitRule,
    choose_heldout,
    generate,
    hard_negatives,
    holds,
    load_heldout,
    load_scene_graphs,
    load_swap_items,
    sample_example,
    sample_swap_pair,
    split_rule,
    write_swap_split,
)
from test_shapes import _dominant_color, _object_mask, _pixel_shape, _pixels

SEED = 11
IN_DISTRIBUTION = tuple(split for split in SPLITS if split != UNSEEN_SPLIT)
N_IMAGES = {"train": 150, "val": 15, "test": 15, "test_unseen": 30}
IMAGE_SIZE = 48
COLOR_NAMES = {rgb: name for name, rgb in COLORS.items()}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shapes_splits")
    generate(root, N_IMAGES["train"], N_IMAGES["val"], image_size=IMAGE_SIZE, seed=SEED,
             n_test=N_IMAGES["test"], n_test_unseen=N_IMAGES["test_unseen"])
    return root


@pytest.fixture(scope="module")
def heldout_words() -> tuple[set[tuple[str, str]], list[set[str]]]:
    """The held-out combinations as (colour, shape) word pairs and the colour pairs as word sets."""
    heldout = choose_heldout(SEED)
    return set(heldout.combos), [set(pair) for pair in heldout.pairs]


def _seen_objects(path: Path | str, objects: list[dict]) -> list[tuple[str, str]]:
    """(colour, shape) of every object as the pixels show it, whatever its record says."""
    pixels = _pixels(path)
    return [(COLOR_NAMES[_dominant_color(pixels, obj["bbox"])], _pixel_shape(_object_mask(pixels, obj["bbox"])))
            for obj in objects]


def _image_shows_heldout(objects: list[tuple[str, str]], words: tuple) -> bool:
    combos, pairs = words
    colors_together = [{a[0], b[0]} for a, b in itertools.combinations(objects, 2)]
    return bool(set(objects) & combos) or any(pair in colors_together for pair in pairs)


def _text_names_heldout(text: str, words: tuple) -> bool:
    """A held-out "colour shape" in the text, or both colours of a held-out pair (the colours of a caption are
    those of its subject and its object)."""
    combos, pairs = words
    tokens = text.split()
    colors = set(tokens) & set(COLORS)
    return bool(set(zip(tokens, tokens[1:])) & combos) or any(pair <= colors for pair in pairs)


def _caption_images(world: Path, split: str) -> list[tuple[Path, dict]]:
    return [(world / "images" / split / record["file_name"], record) for record in load_scene_graphs(world, split)]


def _coco_texts(world: Path, split: str) -> list[str]:
    """Every caption and hard negative of the split's COCO file, as the training loader reads them."""
    coco = json.loads((world / "annotations" / f"captions_{split}.json").read_text())
    return [text for ann in coco["annotations"] for text in (ann["caption"], *ann["neg_captions"])]


# ---------------------------------------------------------------- the held-out sets


@pytest.mark.parametrize("seed", range(12))
def test_heldout_sets_are_latin_and_leave_every_colour_and_shape_in_training(seed: int) -> None:
    heldout = choose_heldout(seed)
    assert heldout == choose_heldout(seed), "chosen from the seed alone"
    combo_colors = [color for color, _ in heldout.combos]
    assert sorted(shape for _, shape in heldout.combos) == sorted(SHAPES), "one combination per shape"
    assert len(set(combo_colors)) == len(SHAPES), "all colours different"
    seen = set(itertools.product(COLORS, SHAPES)) - heldout.combos
    assert {color for color, _ in seen} == set(COLORS) and {shape for _, shape in seen} == set(SHAPES)
    assert len(heldout.pairs) == HELDOUT_COLOR_PAIRS
    assert all(len(pair) == 2 and pair <= set(COLORS) for pair in heldout.pairs)
    assert len(set().union(*heldout.pairs)) == 2 * HELDOUT_COLOR_PAIRS, "the pairs are disjoint"


def test_different_seeds_give_different_heldout_sets(tmp_path: Path, world: Path) -> None:
    assert choose_heldout(0) != choose_heldout(1)
    assert len({str(choose_heldout(seed)) for seed in range(20)}) >= 15
    generate(tmp_path, 0, 0, image_size=32, seed=SEED + 1, n_test=0, n_test_unseen=0)
    assert load_heldout(world) == choose_heldout(SEED)
    assert load_heldout(tmp_path) == choose_heldout(SEED + 1) != load_heldout(world)


def test_package_docstring_records_the_makefile_worlds_heldout_sets() -> None:
    docstring = " ".join(datamodules.shapes.__doc__.split())
    assert str(choose_heldout(0)) in docstring


def test_unknown_split_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        write_swap_split(tmp_path, "dev", 1, image_size=32, seed=0)


# ---------------------------------------------------------------- nothing held out leaks into train / val / test


@pytest.mark.parametrize("split", IN_DISTRIBUTION)
def test_no_heldout_in_images_captions_or_negatives(world: Path, split: str, heldout_words: tuple) -> None:
    for path, record in _caption_images(world, split):
        assert not _image_shows_heldout(_seen_objects(path, record["objects"]), heldout_words), path
    texts = _coco_texts(world, split)
    assert len(texts) == N_IMAGES[split] * 2 * 4, "two captions per image, three negatives per caption"
    assert not [text for text in texts if _text_names_heldout(text, heldout_words)]


@pytest.mark.parametrize("split", IN_DISTRIBUTION)
def test_no_heldout_in_either_image_or_caption_of_a_swap_item(world: Path, split: str, heldout_words: tuple
                                                               ) -> None:
    for item in load_swap_items(world, split):
        for path, scene, text in zip(item["images"], item["scenes"], item["captions"]):
            assert not _image_shows_heldout(_seen_objects(path, scene["objects"]), heldout_words), path
            assert not _text_names_heldout(text, heldout_words), text


def test_the_leak_checks_see_a_leak(heldout_words: tuple) -> None:
    (color, shape), (first, second) = sorted(heldout_words[0])[0], sorted(heldout_words[1][0])
    assert _text_names_heldout(f"there is a small {color} {shape}", heldout_words)
    assert not _text_names_heldout("the square is above the circle", heldout_words)
    assert _text_names_heldout(f"a {first} square left of a {second} circle", heldout_words)
    assert _image_shows_heldout([(second, "circle"), (first, "square")], heldout_words)
    assert _image_shows_heldout([(color, shape)], heldout_words)


# ---------------------------------------------------------------- test_unseen


def test_every_unseen_image_and_caption_names_a_heldout_combination(world: Path, heldout_words: tuple) -> None:
    kinds = collections.Counter()
    for path, record in _caption_images(world, UNSEEN_SPLIT):
        objects = _seen_objects(path, record["objects"])
        assert _image_shows_heldout(objects, heldout_words), path
        kinds["combination"] += bool(set(objects) & heldout_words[0])
        for caption in record["captions"]:
            assert _text_names_heldout(caption["caption"], heldout_words), caption["caption"]
            kinds["pair"] += any(pair <= set(caption["caption"].split()) for pair in heldout_words[1])
    assert kinds["combination"] > 0 and kinds["pair"] > 0, "both kinds of held-out parts are tested"


def test_every_unseen_swap_item_names_a_heldout_combination_shown_in_its_image(world: Path,
                                                                             heldout_words: tuple) -> None:
    for item in load_swap_items(world, UNSEEN_SPLIT):
        naming = [index for index, text in enumerate(item["captions"]) if _text_names_heldout(text, heldout_words)]
        assert naming, item["captions"]
        shown = [_image_shows_heldout(_seen_objects(item["images"][i], item["scenes"][i]["objects"]), heldout_words)
                 for i in naming]
        assert all(shown), item["images"]


@pytest.mark.parametrize("split", SPLITS)
def test_each_swap_set_is_balanced_and_each_caption_true_of_its_own_image_only(world: Path, split: str) -> None:
    items = load_swap_items(world, split)
    assert len(items) == (max(1, N_IMAGES[split] // 10) if split == "train" else N_IMAGES[split])
    counts = collections.Counter(item["type"] for item in items)
    assert max(counts.values()) - min(counts.values()) <= 1 and len(counts) == 3
    for item in items:
        scenes = [datamodules.shapes.scene_from_dict(scene) for scene in item["scenes"]]
        captions = [datamodules.shapes.caption_from_dict(structure) for structure in item["structures"]]
        assert [caption.text for caption in captions] == item["captions"]
        for index in (0, 1):
            assert holds(scenes[index], captions[index]) and not holds(scenes[1 - index], captions[index])


# ---------------------------------------------------------------- the rules, on sampled and hand-made data


def _scene(*objects: tuple[str, str, str, tuple[int, int, int, int]]) -> Scene:
    return Scene(64, tuple(SceneObject(i + 1, shape, color, size, box)
                           for i, (size, color, shape, box) in enumerate(objects)))


def test_a_negative_that_would_name_a_heldout_combination_gives_way_to_the_next_false_one() -> None:
    scene = _scene(("large", "red", "square", (2, 2, 24, 24)), ("large", "blue", "circle", (40, 40, 62, 62)))
    caption = Caption("plain", Description("red", "square"), "above", Description("blue", "circle"))
    free = hard_negatives(random.Random(0), scene, caption)
    assert free[0].text == "a blue square above a red circle", "without held-out sets the colour swap comes first"
    # Blue square held out: the colour swap and the subject taking the object's colour name it; the object
    # taking the subject's colour is the next false candidate.
    one = SplitRule(HeldOut(combos=frozenset({("blue", "square")}), pairs=frozenset()))
    assert hard_negatives(random.Random(0), scene, caption, one)[0].text == "a red square above a red circle"
    # Red circle held out too, and green with blue: every binding swap is barred, and so is a green subject
    # (green beside blue); a colour absent from the scene takes their place.
    heldout = HeldOut(combos=frozenset({("blue", "square"), ("red", "circle")}),
                      pairs=frozenset({frozenset(("green", "blue"))}))
    rule = SplitRule(heldout)
    assert rule.allows_scene(scene) and rule.allows_caption(caption)
    negatives = hard_negatives(random.Random(0), scene, caption, rule)
    assert negatives[0].subject.color not in {"red", "blue", "green"}
    assert negatives[0].subject.shape == "square" and negatives[0].obj == caption.obj
    assert len({n.text for n in negatives}) == 3
    assert not any(holds(scene, n) or heldout.named_in(n) for n in negatives)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), world_seed=st.integers(0, 50), count=st.integers(1, 3))
def test_sampled_examples_follow_their_split_rule(seed: int, world_seed: int, count: int) -> None:
    heldout = choose_heldout(world_seed)
    seen = sample_example(random.Random(seed), 1, 48, count, split_rule(world_seed, "train"))
    assert not heldout.shown_in(seen.scene)
    assert not any(heldout.named_in(c) for c in (*seen.captions, *itertools.chain(*seen.negatives)))
    unseen = sample_example(random.Random(seed), 1, 48, count, split_rule(world_seed, UNSEEN_SPLIT))
    assert heldout.shown_in(unseen.scene) and all(heldout.named_in(c) for c in unseen.captions)
    for caption, negatives in zip(unseen.captions, unseen.negatives):
        assert holds(unseen.scene, caption) and not any(holds(unseen.scene, n) for n in negatives)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), swap_type=st.sampled_from(("attribute", "object")))
def test_in_distribution_swaps_never_create_a_heldout_combination(seed: int, swap_type: str) -> None:
    heldout = choose_heldout(SEED)
    scenes, captions = sample_swap_pair(random.Random(seed), 48, swap_type, split_rule(SEED, "val"))
    assert not any(heldout.shown_in(scene) for scene in scenes)
    assert not any(heldout.named_in(caption) for caption in captions)
