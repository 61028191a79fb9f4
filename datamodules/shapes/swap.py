"""The Winoground-style swap benchmark: two scenes and two captions that differ by one swap of one type."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from datamodules.shapes.heldout import ANY_SCENE, SplitRule
from datamodules.shapes.negatives import swap_field
from datamodules.shapes.scenes import describe, is_valid_scene, needs_size, place
from datamodules.shapes.world import (
    ATTRIBUTE_TRIPLES,
    DISTRACTOR_RATE,
    OPTIONAL_SIZE_RATE,
    PAIR_TEMPLATES,
    RELATION_WORDINGS,
    RELATIONS,
    Caption,
    Scene,
    SceneObject,
    holds,
    relation_holds,
)


def _sample_swap_scene(rng: random.Random, image_size: int) -> Scene | None:
    """A scene whose first two objects differ in colour and shape, plus an optional distractor."""
    first, second = rng.sample(ATTRIBUTE_TRIPLES, 2)
    if first[1] == second[1] or first[2] == second[2]:
        return None
    triples = [first, second]
    if rng.random() < DISTRACTOR_RATE:
        triples.append(rng.choice([t for t in ATTRIBUTE_TRIPLES if t not in triples]))
    return place(rng, image_size, triples)


def _stated_relations(scene: Scene, relations: tuple[str, ...]) -> list[str]:
    """The relations of `relations` that the first object stands in to the second."""
    first, second = scene.objects[:2]
    return [r for r in relations if relation_holds(first, r, second, scene.image_size)]


def _stated_order(scene: Scene, relations: tuple[str, ...]) -> Scene | None:
    """`scene` with its first two objects in an order that one of `relations` states ("left of" alone cannot say
    that the first object is right of the second), or None when neither order has one."""
    if _stated_relations(scene, relations):
        return scene
    first, second = scene.objects[:2]
    exchanged = _swap_first_two(scene, second, first)
    return exchanged if _stated_relations(exchanged, relations) else None


def _swap_base_caption(rng: random.Random, scene: Scene, relations: tuple[str, ...]) -> Caption:
    first, second = scene.objects[:2]
    # Both descriptions carry a size or neither does, so the swapped caption has the same words.
    with_size = needs_size(scene, first) or needs_size(scene, second) or rng.random() < OPTIONAL_SIZE_RATE
    return Caption(
        template=rng.choice(list(PAIR_TEMPLATES)),
        subject=describe(first, with_size),
        relation=rng.choice(_stated_relations(scene, relations)),
        obj=describe(second, with_size),
        wording=rng.randrange(max(map(len, RELATION_WORDINGS.values()))),
    )


def _swap_first_two(scene: Scene, first: SceneObject, second: SceneObject) -> Scene:
    return Scene(scene.image_size, (first, second, *scene.objects[2:]))


def _swap_colors(scene: Scene, caption: Caption) -> tuple[Scene, Caption]:
    first, second = scene.objects[:2]
    swapped = _swap_first_two(scene, replace(first, color=second.color), replace(second, color=first.color))
    return swapped, swap_field(caption, "color")


def _centred_box(center: tuple[float, float], side: int) -> tuple[int, int, int, int]:
    x0, y0 = round(center[0] - side / 2), round(center[1] - side / 2)
    return x0, y0, x0 + side, y0 + side


def _swap_positions(scene: Scene, caption: Caption) -> tuple[Scene, Caption]:
    first, second = scene.objects[:2]
    moved_first = replace(first, bbox=_centred_box(second.center, first.bbox[2] - first.bbox[0]))
    moved_second = replace(second, bbox=_centred_box(first.center, second.bbox[2] - second.bbox[0]))
    swapped = _swap_first_two(scene, moved_first, moved_second)
    return swapped, replace(caption, subject=caption.obj, obj=caption.subject)


def _swap_shapes(scene: Scene, caption: Caption) -> tuple[Scene, Caption]:
    first, second = scene.objects[:2]
    swapped = _swap_first_two(scene, replace(first, shape=second.shape), replace(second, shape=first.shape))
    return swapped, swap_field(caption, "shape")


SWAPPERS: dict[str, Callable[[Scene, Caption], tuple[Scene, Caption]]] = {
    "attribute": _swap_colors,
    "relation": _swap_positions,
    "object": _swap_shapes,
}


def _is_valid_swap(scenes: tuple[Scene, Scene], captions: tuple[Caption, Caption]) -> bool:
    """Caption i must be true of image i and false of image 1 - i."""
    return is_valid_scene(scenes[1]) and all(
        holds(scenes[i], captions[i]) and not holds(scenes[1 - i], captions[i]) for i in (0, 1)
    )


def sample_swap_pair(
    rng: random.Random, image_size: int, swap_type: str, rule: SplitRule = ANY_SCENE,
    relations: tuple[str, ...] = RELATIONS,
) -> tuple[tuple[Scene, Scene], tuple[Caption, Caption]]:
    """Sample two scenes and two captions that differ only by a swap of `swap_type`.

    Args:
        rng: Source of randomness.
        image_size: Image side in pixels.
        swap_type: One of `SWAP_TYPES`: swap colours, positions or shapes of the first two objects.
        rule: The split's rule. An in-distribution split shows no held-out combination or pair in either
            image (a colour or shape swap can create one); in the unseen split one caption at least names one.
        relations: The relations the captions may state.

    Returns:
        (scene 0, scene 1) and (caption 0, caption 1), caption i true of scene i only.
    """
    while True:
        scene = _sample_swap_scene(rng, image_size)
        if scene is not None:
            scene = _stated_order(scene, relations)
        if scene is None:
            continue
        caption = _swap_base_caption(rng, scene, relations)
        swapped_scene, swapped_caption = SWAPPERS[swap_type](scene, caption)
        scenes, captions = (scene, swapped_scene), (caption, swapped_caption)
        if _is_valid_swap(scenes, captions) and rule.allows_swap(scenes, captions):
            return scenes, captions
