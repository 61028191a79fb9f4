"""Scenes and true captions: object placement, scene sampling, caption sampling, and one image's example."""

from __future__ import annotations

import itertools
import random

from datamodules.shapes.heldout import ANY_SCENE, SplitRule
from datamodules.shapes.negatives import hard_negatives
from datamodules.shapes.world import (
    ATTRIBUTE_TRIPLES,
    CAPTION_ATTEMPTS,
    OBJECT_GAP,
    OPTIONAL_SIZE_RATE,
    PAIR_TEMPLATES,
    PLACEMENT_ATTEMPTS,
    RELATION_WORDINGS,
    RELATIONS,
    SINGLE_CAPTION_RATE,
    SINGLE_TEMPLATES,
    SIZES,
    Caption,
    Description,
    ImageExample,
    Scene,
    SceneObject,
    holds,
    scene_relations,
)


# ---------------------------------------------------------------- scenes


def object_side(size: str, image_size: int) -> int:
    """Side length in pixels of an object of `size` in an image of side `image_size`."""
    return round(SIZES[size] * image_size)


def _boxes_apart(a: tuple[int, ...], b: tuple[int, ...], gap: int) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def _gap(image_size: int) -> int:
    return max(1, round(OBJECT_GAP * image_size))


def _free_box(rng: random.Random, image_size: int, side: int, taken: list) -> tuple[int, ...] | None:
    for _ in range(PLACEMENT_ATTEMPTS):
        x0, y0 = rng.randrange(image_size - side + 1), rng.randrange(image_size - side + 1)
        box = (x0, y0, x0 + side, y0 + side)
        if all(_boxes_apart(box, other, _gap(image_size)) for other in taken):
            return box
    return None


def place(rng: random.Random, image_size: int, triples: list[tuple[str, str, str]]) -> Scene | None:
    """Place objects with the given (size, colour, shape) at random free spots; None if they do not fit."""
    boxes: list[tuple[int, ...]] = []
    for size, _, _ in triples:
        box = _free_box(rng, image_size, object_side(size, image_size), boxes)
        if box is None:
            return None
        boxes.append(box)
    objects = tuple(
        SceneObject(index + 1, shape, color, size, box)
        for index, ((size, color, shape), box) in enumerate(zip(triples, boxes))
    )
    return Scene(image_size, objects)


def sample_scene(rng: random.Random, image_size: int, rule: SplitRule = ANY_SCENE) -> Scene:
    """Sample 2-3 non-overlapping objects with pairwise different (size, colour, shape).

    Args:
        rng: Source of randomness.
        image_size: Image side in pixels.
        rule: The split's rule; scenes it does not allow are drawn again.

    Returns:
        The scene.
    """
    while True:
        triples = rng.sample(ATTRIBUTE_TRIPLES, rng.choice((2, 3)))
        scene = place(rng, image_size, triples)
        if scene is not None and rule.allows_scene(scene):
            return scene


def is_valid_scene(scene: Scene) -> bool:
    """Whether every object lies inside the image, apart from the others, and differs from them."""
    inside = all(0 <= min(obj.bbox) and max(obj.bbox) <= scene.image_size for obj in scene.objects)
    pairs = list(itertools.combinations(scene.objects, 2))
    apart = all(_boxes_apart(a.bbox, b.bbox, _gap(scene.image_size)) for a, b in pairs)
    distinct = all((a.size, a.color, a.shape) != (b.size, b.color, b.shape) for a, b in pairs)
    return inside and apart and distinct


# ---------------------------------------------------------------- captions


def needs_size(scene: Scene, target: SceneObject) -> bool:
    """Whether another object of `scene` has the colour and shape of `target`, so only its size tells them apart."""
    return any(
        obj is not target and (obj.color, obj.shape) == (target.color, target.shape)
        for obj in scene.objects
    )


def describe(target: SceneObject, with_size: bool) -> Description:
    """The noun phrase naming `target`, with its size or without."""
    return Description(target.color, target.shape, target.size if with_size else None)


def _sampled_description(rng: random.Random, scene: Scene, target: SceneObject) -> Description:
    # The size is said whenever colour and shape alone would not single the object out.
    with_size = needs_size(scene, target) or rng.random() < OPTIONAL_SIZE_RATE
    return describe(target, with_size)


def sample_caption(rng: random.Random, scene: Scene, relations: tuple[str, ...] = RELATIONS) -> Caption:
    """Sample a caption about `scene`: usually a relation between two objects, sometimes one object.

    Args:
        rng: Source of randomness.
        scene: The scene to describe.
        relations: The relations a caption may state (`CAPTION_RELATIONS`).

    Returns:
        A structured caption that is true of the scene.
    """
    if rng.random() < SINGLE_CAPTION_RATE:
        target = rng.choice(scene.objects)
        return Caption(rng.choice(list(SINGLE_TEMPLATES)), _sampled_description(rng, scene, target))
    # The relation list holds both directions, so a pair is stated as "X left of Y" or "Y right of X" when both
    # relations are allowed, and as "X left of Y" alone when only "left of" is.
    stated = [triple for triple in scene_relations(scene) if triple[1] in relations]
    subject, relation, obj = rng.choice(stated)
    return Caption(
        template=rng.choice(list(PAIR_TEMPLATES)),
        subject=_sampled_description(rng, scene, subject),
        relation=relation,
        obj=_sampled_description(rng, scene, obj),
        wording=rng.randrange(max(map(len, RELATION_WORDINGS.values()))),
    )


def sample_captions(rng: random.Random, scene: Scene, count: int, rule: SplitRule = ANY_SCENE,
                    relations: tuple[str, ...] = RELATIONS) -> tuple[Caption, ...]:
    """Sample `count` captions with different texts, each checked to be true of `scene` and allowed by `rule`.

    Args:
        rng: Source of randomness.
        scene: The scene to describe.
        count: Number of captions.
        rule: The split's rule (the unseen split's captions each name a held-out combination or pair).
        relations: The relations a caption may state.

    Returns:
        The captions.

    Raises:
        RuntimeError: If the scene does not admit `count` different captions.
    """
    captions: dict[str, Caption] = {}
    for _ in range(CAPTION_ATTEMPTS * count):
        caption = sample_caption(rng, scene, relations)
        if caption.text not in captions and holds(scene, caption) and rule.allows_caption(caption):
            captions[caption.text] = caption
        if len(captions) == count:
            return tuple(captions.values())
    raise RuntimeError(f"could not find {count} different true captions for {scene}")


def sample_example(
    rng: random.Random, image_id: int, image_size: int, captions_per_image: int, rule: SplitRule = ANY_SCENE,
    relations: tuple[str, ...] = RELATIONS,
) -> ImageExample:
    """Sample one image's scene, captions and hard negatives.

    Args:
        rng: Source of randomness.
        image_id: Id of the image within its split.
        image_size: Image side in pixels.
        captions_per_image: Number of different captions.
        rule: The split's rule about held-out combinations and colour pairs.
        relations: The relations its captions and their hard negatives may state.

    Returns:
        The example.
    """
    scene = sample_scene(rng, image_size, rule)
    captions = sample_captions(rng, scene, captions_per_image, rule, relations)
    negatives = tuple(hard_negatives(rng, scene, caption, rule, relations) for caption in captions)
    return ImageExample(image_id, scene, captions, negatives)
