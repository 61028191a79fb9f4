"""The shapes world: a deterministic CLEVR-like synthetic dataset in COCO captions format.

Every image holds 2-3 non-overlapping objects (shape x colour x size) on a plain background. Captions are
drawn from varied templates as structured data (`Caption`) and rendered to text; a semantic checker
(`holds`) decides whether a structured caption is true of a scene, which guarantees that every caption is
true and every hard negative is false. A Winoground-style swap benchmark pairs two images that differ only
in attribute binding, relation direction or object identity.

Same arguments give byte-identical files: every random choice comes from a `random.Random` seeded by
(seed, split, stream), and no file holds a timestamp.

Usage:
    python -m datamodules.shapes --out data/shapes --n-train 4000 --n-val 500 --image-size 64 --seed 0
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import random
import string
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from datamodules.files import atomic_write_bytes

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 230),
    "yellow": (240, 220, 30),
    "purple": (140, 40, 180),
    "orange": (250, 140, 20),
}
BACKGROUND: tuple[int, int, int] = (128, 128, 128)
SHAPES: tuple[str, ...] = ("square", "circle", "triangle", "diamond")
# Side length of an object's box as a fraction of the image side.
SIZES: dict[str, float] = {"small": 0.2, "large": 0.34}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
OPPOSITE_RELATION: dict[str, str] = {
    "left of": "right of",
    "right of": "left of",
    "above": "below",
    "below": "above",
}
RELATION_WORDINGS: dict[str, tuple[str, ...]] = {
    "left of": ("left of", "to the left of", "on the left of"),
    "right of": ("right of", "to the right of", "on the right of"),
    "above": ("above", "over", "on top of"),
    "below": ("below", "under", "beneath"),
}
# Box centres must differ by this fraction of the image side for a relation to hold. Two boxes that do
# not overlap are always further apart than this on at least one axis, so every pair has a relation,
# while pairs that are nearly aligned on an axis get no relation on that axis.
RELATION_MARGIN = 0.15
# Minimum empty gap between two boxes, as a fraction of the image side.
OBJECT_GAP = 0.03
MIN_IMAGE_SIZE = 32

PAIR_TEMPLATES: dict[str, str] = {
    "plain": "{sa} {s} {r} {oa} {o}",
    "is": "{sa} {s} is {r} {oa} {o}",
    "there_is": "there is {sa} {s} {r} {oa} {o}",
    "definite": "the {s} is {r} the {o}",
    "sits": "{sa} {s} sits {r} {oa} {o}",
    "placed": "{sa} {s} placed {r} {oa} {o}",
    "image_showing": "an image showing {sa} {s} {r} {oa} {o}",
    "can_be_seen": "{sa} {s} can be seen {r} {oa} {o}",
    "with_it": "{oa} {o} with {sa} {s} {r} it",
}
SINGLE_TEMPLATES: dict[str, str] = {
    "single": "{sa} {s}",
    "single_there_is": "there is {sa} {s}",
    "single_picture": "a picture of {sa} {s}",
}
TEMPLATES: dict[str, str] = {**PAIR_TEMPLATES, **SINGLE_TEMPLATES}
SINGLE_CAPTION_RATE = 0.15
OPTIONAL_SIZE_RATE = 0.5
DISTRACTOR_RATE = 0.5
SWAP_TYPES: tuple[str, ...] = ("attribute", "relation", "object")
CAPTION_ATTEMPTS = 50
PLACEMENT_ATTEMPTS = 100
SPLITS: tuple[str, ...] = ("train", "val")

# Every (size, colour, shape) an object can have, in a fixed order so that sampling is reproducible.
ATTRIBUTE_TRIPLES: tuple[tuple[str, str, str], ...] = tuple(itertools.product(SIZES, COLORS, SHAPES))
_FORMATTER = string.Formatter()


@dataclass(frozen=True)
class SceneObject:
    """One drawn object. `bbox` is (x0, y0, x1, y1) in pixels, x1 and y1 exclusive."""

    id: int
    shape: str
    color: str
    size: str
    bbox: tuple[int, int, int, int]

    @property
    def center(self) -> tuple[float, float]:
        """Centre (x, y) of the box."""
        x0, y0, x1, y1 = self.bbox
        return (x0 + x1) / 2, (y0 + y1) / 2


@dataclass(frozen=True)
class Scene:
    """The objects of one square image."""

    image_size: int
    objects: tuple[SceneObject, ...]


@dataclass(frozen=True)
class Description:
    """A noun phrase naming an object; `size` None means the caption leaves the size unsaid."""

    color: str
    shape: str
    size: str | None = None

    @property
    def text(self) -> str:
        """The phrase as it appears in a caption, e.g. "large red square"."""
        return " ".join(word for word in (self.size, self.color, self.shape) if word)

    def matches(self, obj: SceneObject) -> bool:
        """Whether `obj` fits this description."""
        size_fits = self.size is None or self.size == obj.size
        return size_fits and obj.color == self.color and obj.shape == self.shape


@dataclass(frozen=True)
class Caption:
    """A caption as structured data: `subject`, or `subject relation obj` when `relation` is set.

    `template` names an entry of `TEMPLATES`; `wording` picks the relation's phrasing from
    `RELATION_WORDINGS` (modulo its length, so a negative that changes the relation keeps its style).
    """

    template: str
    subject: Description
    relation: str | None = None
    obj: Description | None = None
    wording: int = 0

    @property
    def text(self) -> str:
        """The rendered caption."""
        return render_caption(self)[0]


@dataclass(frozen=True)
class ImageExample:
    """One generated image: its scene, its true captions and three hard negatives per caption."""

    image_id: int
    scene: Scene
    captions: tuple[Caption, ...]
    negatives: tuple[tuple[Caption, ...], ...]


# ---------------------------------------------------------------- semantics


def relation_holds(subject: SceneObject, relation: str, obj: SceneObject, image_size: int) -> bool:
    """Whether `subject` stands clearly in `relation` to `obj`, judged from the box centres.

    Args:
        subject: The object the relation is stated about.
        relation: One of `RELATIONS`.
        obj: The reference object.
        image_size: Image side in pixels; the required margin scales with it.

    Returns:
        True when the centres differ by at least the margin in the stated direction.
    """
    (subject_x, subject_y), (obj_x, obj_y) = subject.center, obj.center
    offsets = {
        "left of": obj_x - subject_x,
        "right of": subject_x - obj_x,
        "above": obj_y - subject_y,
        "below": subject_y - obj_y,
    }
    return offsets[relation] >= RELATION_MARGIN * image_size


def witness(scene: Scene, caption: Caption) -> tuple[SceneObject, SceneObject | None] | None:
    """Find objects that make `caption` true.

    Args:
        scene: The scene to check against.
        caption: A structured caption.

    Returns:
        (subject, object) that satisfy the caption (object None for a single-object caption), or None
        when the caption is false of the scene.
    """
    subjects = [obj for obj in scene.objects if caption.subject.matches(obj)]
    if caption.relation is None:
        return (subjects[0], None) if subjects else None
    for subject, obj in itertools.product(subjects, scene.objects):
        if obj is not subject and caption.obj.matches(obj):
            if relation_holds(subject, caption.relation, obj, scene.image_size):
                return subject, obj
    return None


def holds(scene: Scene, caption: Caption) -> bool:
    """Whether `caption` is true of `scene`: some objects match its descriptions and relation.

    Args:
        scene: The scene to check against.
        caption: A structured caption.

    Returns:
        True when the caption is true of the scene.
    """
    return witness(scene, caption) is not None


def scene_relations(scene: Scene) -> list[tuple[SceneObject, str, SceneObject]]:
    """Every (subject, relation, object) that holds clearly in `scene`, both directions included."""
    return [
        (subject, relation, obj)
        for subject, obj in itertools.permutations(scene.objects, 2)
        for relation in RELATIONS
        if relation_holds(subject, relation, obj, scene.image_size)
    ]


# ---------------------------------------------------------------- rendering


def _article(phrase: str) -> str:
    return "an" if phrase[0] in "aeiou" else "a"


def _slot_values(caption: Caption) -> dict[str, str]:
    values = {"s": caption.subject.text, "sa": _article(caption.subject.text)}
    if caption.relation is not None:
        wordings = RELATION_WORDINGS[caption.relation]
        values["r"] = wordings[caption.wording % len(wordings)]
        values["o"] = caption.obj.text
        values["oa"] = _article(caption.obj.text)
    return values


def render_caption(caption: Caption) -> tuple[str, dict[str, tuple[int, int]]]:
    """Render a structured caption to text.

    Args:
        caption: A structured caption.

    Returns:
        The text and the character span [start, end) of each template slot ("s" subject, "r" relation
        words, "o" object, "sa"/"oa" articles).
    """
    values = _slot_values(caption)
    text, spans = "", {}
    for literal, slot, _, _ in _FORMATTER.parse(TEMPLATES[caption.template]):
        text += literal
        if slot is not None:
            spans[slot] = (len(text), len(text) + len(values[slot]))
            text += values[slot]
    return text, spans


def _phrase(text: str, kind: str, span: tuple[int, int], boxes: list) -> dict[str, Any]:
    start, end = span
    return {"text": text[start:end], "type": kind, "char_span": [start, end], "boxes": boxes}


def caption_phrases(scene: Scene, caption: Caption) -> list[dict[str, Any]]:
    """Ground-truth phrases of a true caption: one attribute phrase per object, one relation phrase.

    Args:
        scene: The scene the caption is true of.
        caption: A structured caption.

    Returns:
        Phrase dicts with "text", "type", "char_span" and "boxes"; a relation phrase spans from its first
        to its last slot and its boxes are [subject box, object box].
    """
    text, spans = render_caption(caption)
    subject, obj = witness(scene, caption)
    phrases = [_phrase(text, "attribute", spans["s"], [list(subject.bbox)])]
    if obj is None:
        return phrases
    relation_span = (min(spans[k][0] for k in "sro"), max(spans[k][1] for k in "sro"))
    phrases.append(_phrase(text, "attribute", spans["o"], [list(obj.bbox)]))
    phrases.append(_phrase(text, "relation", relation_span, [list(subject.bbox), list(obj.bbox)]))
    return phrases


def draw_scene(scene: Scene) -> Image.Image:
    """Draw `scene` as an RGB image, each object filling its box without anti-aliasing.

    Args:
        scene: The scene to draw.

    Returns:
        The image, `scene.image_size` pixels square.
    """
    image = Image.new("RGB", (scene.image_size, scene.image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        _draw_object(draw, obj)
    return image


def _draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    x0, y0, x1, y1 = obj.bbox
    # PIL's shape coordinates are inclusive, the box's right and bottom edges are not.
    right, bottom = x1 - 1, y1 - 1
    middle_x, middle_y = (x0 + right) / 2, (y0 + bottom) / 2
    fill = COLORS[obj.color]
    if obj.shape == "square":
        draw.rectangle((x0, y0, right, bottom), fill=fill)
    elif obj.shape == "circle":
        draw.ellipse((x0, y0, right, bottom), fill=fill)
    elif obj.shape == "triangle":
        draw.polygon([(middle_x, y0), (right, bottom), (x0, bottom)], fill=fill)
    else:
        draw.polygon([(middle_x, y0), (right, middle_y), (middle_x, bottom), (x0, middle_y)], fill=fill)


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


def _place(rng: random.Random, image_size: int, triples: list[tuple[str, str, str]]) -> Scene | None:
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


def sample_scene(rng: random.Random, image_size: int) -> Scene:
    """Sample 2-3 non-overlapping objects with pairwise different (size, colour, shape).

    Args:
        rng: Source of randomness.
        image_size: Image side in pixels.

    Returns:
        The scene.
    """
    while True:
        triples = rng.sample(ATTRIBUTE_TRIPLES, rng.choice((2, 3)))
        scene = _place(rng, image_size, triples)
        if scene is not None:
            return scene


def _is_valid_scene(scene: Scene) -> bool:
    inside = all(0 <= min(obj.bbox) and max(obj.bbox) <= scene.image_size for obj in scene.objects)
    pairs = list(itertools.combinations(scene.objects, 2))
    apart = all(_boxes_apart(a.bbox, b.bbox, _gap(scene.image_size)) for a, b in pairs)
    distinct = all((a.size, a.color, a.shape) != (b.size, b.color, b.shape) for a, b in pairs)
    return inside and apart and distinct


# ---------------------------------------------------------------- captions


def _needs_size(scene: Scene, target: SceneObject) -> bool:
    return any(
        obj is not target and (obj.color, obj.shape) == (target.color, target.shape)
        for obj in scene.objects
    )


def _describe(target: SceneObject, with_size: bool) -> Description:
    return Description(target.color, target.shape, target.size if with_size else None)


def _sampled_description(rng: random.Random, scene: Scene, target: SceneObject) -> Description:
    # The size is said whenever colour and shape alone would not single the object out.
    with_size = _needs_size(scene, target) or rng.random() < OPTIONAL_SIZE_RATE
    return _describe(target, with_size)


def sample_caption(rng: random.Random, scene: Scene) -> Caption:
    """Sample a caption about `scene`: usually a relation between two objects, sometimes one object.

    Args:
        rng: Source of randomness.
        scene: The scene to describe.

    Returns:
        A structured caption that is true of the scene.
    """
    if rng.random() < SINGLE_CAPTION_RATE:
        target = rng.choice(scene.objects)
        return Caption(rng.choice(list(SINGLE_TEMPLATES)), _sampled_description(rng, scene, target))
    # The relation list holds both directions, so a pair is stated as "X left of Y" or "Y right of X".
    subject, relation, obj = rng.choice(scene_relations(scene))
    return Caption(
        template=rng.choice(list(PAIR_TEMPLATES)),
        subject=_sampled_description(rng, scene, subject),
        relation=relation,
        obj=_sampled_description(rng, scene, obj),
        wording=rng.randrange(max(map(len, RELATION_WORDINGS.values()))),
    )


def sample_captions(rng: random.Random, scene: Scene, count: int) -> tuple[Caption, ...]:
    """Sample `count` captions with different texts, each checked to be true of `scene`.

    Args:
        rng: Source of randomness.
        scene: The scene to describe.
        count: Number of captions.

    Returns:
        The captions.

    Raises:
        RuntimeError: If the scene does not admit `count` different captions.
    """
    captions: dict[str, Caption] = {}
    for _ in range(CAPTION_ATTEMPTS * count):
        caption = sample_caption(rng, scene)
        if caption.text not in captions and holds(scene, caption):
            captions[caption.text] = caption
        if len(captions) == count:
            return tuple(captions.values())
    raise RuntimeError(f"could not find {count} different true captions for {scene}")


# ---------------------------------------------------------------- hard negatives
# Each generator yields candidate negatives, hardest first, and ends with one that names a colour or
# shape absent from the scene, which cannot be true; `_first_false` keeps the first false candidate.


def _with_subject(caption: Caption, **changes: str | None) -> Caption:
    return replace(caption, subject=replace(caption.subject, **changes))


def _swap_field(caption: Caption, field: str) -> Caption:
    """Exchange one attribute ("color", "size" or "shape") between subject and object."""
    subject, obj = caption.subject, caption.obj
    return replace(
        caption,
        subject=replace(subject, **{field: getattr(obj, field)}),
        obj=replace(obj, **{field: getattr(subject, field)}),
    )


def _absent(values: Iterable[str], present: set[str]) -> list[str]:
    return [value for value in values if value not in present]


def _absent_colors(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    # At least three colours are absent from a scene, more than the other negatives of a caption can use.
    absent = _absent(COLORS, {obj.color for obj in scene.objects})
    for color in rng.sample(absent, len(absent)):
        yield _with_subject(caption, color=color)


def _attribute_swaps(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    yield _swap_field(caption, "color")
    if caption.subject.size and caption.obj.size:
        yield _swap_field(caption, "size")
    yield from _absent_colors(rng, scene, caption)


def _relation_flips(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    yield replace(caption, subject=caption.obj, obj=caption.subject)
    yield replace(caption, relation=OPPOSITE_RELATION[caption.relation])
    yield from _absent_colors(rng, scene, caption)


def _object_swaps(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    yield _swap_field(caption, "shape")
    # Three objects leave at least one of the four shapes unused.
    absent = _absent(SHAPES, {obj.shape for obj in scene.objects})
    yield _with_subject(caption, shape=rng.choice(absent))


def _color_replacements(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    # Colours that appear elsewhere in the image make harder negatives, so they come first.
    present = sorted({obj.color for obj in scene.objects} - {caption.subject.color})
    absent = _absent(COLORS, set(present) | {caption.subject.color})
    for colors in (present, absent):
        for color in rng.sample(colors, len(colors)):
            yield _with_subject(caption, color=color)


def _size_replacements(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    for size in SIZES:
        yield _with_subject(caption, size=size)
    yield from _absent_colors(rng, scene, caption)


def _shape_replacements(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    others = [shape for shape in SHAPES if shape != caption.subject.shape]
    for shape in rng.sample(others, len(others)):
        yield _with_subject(caption, shape=shape)


NegativeKind = Callable[[random.Random, Scene, Caption], Iterator[Caption]]
# Order of the three negatives: attribute swap, relation flip, object swap. A single-object caption has
# no relation, so its second negative changes the size instead.
PAIR_NEGATIVE_KINDS: tuple[NegativeKind, ...] = (_attribute_swaps, _relation_flips, _object_swaps)
SINGLE_NEGATIVE_KINDS: tuple[NegativeKind, ...] = (
    _color_replacements,
    _size_replacements,
    _shape_replacements,
)


def _first_false(scene: Scene, candidates: Iterator[Caption], taken: set[str]) -> Caption:
    """The first candidate that is false of the scene and differs from the negatives already taken."""
    return next(c for c in candidates if c.text not in taken and not holds(scene, c))


def hard_negatives(rng: random.Random, scene: Scene, caption: Caption) -> tuple[Caption, ...]:
    """Three captions false of `scene`: attribute swap, relation flip, object swap of `caption`.

    Args:
        rng: Source of randomness.
        scene: The scene `caption` is true of.
        caption: A true structured caption.

    Returns:
        Three different negatives, each checked to be false of the scene.
    """
    kinds = PAIR_NEGATIVE_KINDS if caption.relation else SINGLE_NEGATIVE_KINDS
    negatives: list[Caption] = []
    for kind in kinds:
        taken = {negative.text for negative in negatives}
        negatives.append(_first_false(scene, kind(rng, scene, caption), taken))
    return tuple(negatives)


def sample_example(
    rng: random.Random, image_id: int, image_size: int, captions_per_image: int
) -> ImageExample:
    """Sample one image's scene, captions and hard negatives.

    Args:
        rng: Source of randomness.
        image_id: Id of the image within its split.
        image_size: Image side in pixels.
        captions_per_image: Number of different captions.

    Returns:
        The example.
    """
    scene = sample_scene(rng, image_size)
    captions = sample_captions(rng, scene, captions_per_image)
    negatives = tuple(hard_negatives(rng, scene, caption) for caption in captions)
    return ImageExample(image_id, scene, captions, negatives)


# ---------------------------------------------------------------- swap benchmark


def _sample_swap_scene(rng: random.Random, image_size: int) -> Scene | None:
    """A scene whose first two objects differ in colour and shape, plus an optional distractor."""
    first, second = rng.sample(ATTRIBUTE_TRIPLES, 2)
    if first[1] == second[1] or first[2] == second[2]:
        return None
    triples = [first, second]
    if rng.random() < DISTRACTOR_RATE:
        triples.append(rng.choice([t for t in ATTRIBUTE_TRIPLES if t not in triples]))
    return _place(rng, image_size, triples)


def _swap_base_caption(rng: random.Random, scene: Scene) -> Caption:
    first, second = scene.objects[:2]
    relations = [r for r in RELATIONS if relation_holds(first, r, second, scene.image_size)]
    # Both descriptions carry a size or neither does, so the swapped caption has the same words.
    with_size = _needs_size(scene, first) or _needs_size(scene, second) or rng.random() < OPTIONAL_SIZE_RATE
    return Caption(
        template=rng.choice(list(PAIR_TEMPLATES)),
        subject=_describe(first, with_size),
        relation=rng.choice(relations),
        obj=_describe(second, with_size),
        wording=rng.randrange(max(map(len, RELATION_WORDINGS.values()))),
    )


def _swap_first_two(scene: Scene, first: SceneObject, second: SceneObject) -> Scene:
    return Scene(scene.image_size, (first, second, *scene.objects[2:]))


def _swap_colors(scene: Scene, caption: Caption) -> tuple[Scene, Caption]:
    first, second = scene.objects[:2]
    swapped = _swap_first_two(scene, replace(first, color=second.color), replace(second, color=first.color))
    return swapped, _swap_field(caption, "color")


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
    return swapped, _swap_field(caption, "shape")


SWAPPERS: dict[str, Callable[[Scene, Caption], tuple[Scene, Caption]]] = {
    "attribute": _swap_colors,
    "relation": _swap_positions,
    "object": _swap_shapes,
}


def _is_valid_swap(scenes: tuple[Scene, Scene], captions: tuple[Caption, Caption]) -> bool:
    """Caption i must be true of image i and false of image 1 - i."""
    return _is_valid_scene(scenes[1]) and all(
        holds(scenes[i], captions[i]) and not holds(scenes[1 - i], captions[i]) for i in (0, 1)
    )


def sample_swap_pair(
    rng: random.Random, image_size: int, swap_type: str
) -> tuple[tuple[Scene, Scene], tuple[Caption, Caption]]:
    """Sample two scenes and two captions that differ only by a swap of `swap_type`.

    Args:
        rng: Source of randomness.
        image_size: Image side in pixels.
        swap_type: One of `SWAP_TYPES`: swap colours, positions or shapes of the first two objects.

    Returns:
        (scene 0, scene 1) and (caption 0, caption 1), caption i true of scene i only.
    """
    while True:
        scene = _sample_swap_scene(rng, image_size)
        if scene is None:
            continue
        caption = _swap_base_caption(rng, scene)
        swapped_scene, swapped_caption = SWAPPERS[swap_type](scene, caption)
        if _is_valid_swap((scene, swapped_scene), (caption, swapped_caption)):
            return (scene, swapped_scene), (caption, swapped_caption)


# ---------------------------------------------------------------- serialisation


def scene_to_dict(scene: Scene) -> dict[str, Any]:
    """JSON form of a scene: "width", "height" and "objects"."""
    objects = [
        {"id": obj.id, "shape": obj.shape, "color": obj.color, "size": obj.size, "bbox": list(obj.bbox)}
        for obj in scene.objects
    ]
    return {"width": scene.image_size, "height": scene.image_size, "objects": objects}


def scene_from_dict(record: dict[str, Any]) -> Scene:
    """Rebuild a scene from its JSON form (a scene-graph image record or a swap item's scene).

    Args:
        record: A dict with "width" and "objects".

    Returns:
        The scene.
    """
    objects = tuple(
        SceneObject(obj["id"], obj["shape"], obj["color"], obj["size"], tuple(obj["bbox"]))
        for obj in record["objects"]
    )
    return Scene(record["width"], objects)


def _description_to_dict(description: Description | None) -> dict[str, Any] | None:
    if description is None:
        return None
    return {"color": description.color, "shape": description.shape, "size": description.size}


def _description_from_dict(record: dict[str, Any] | None) -> Description | None:
    return None if record is None else Description(record["color"], record["shape"], record["size"])


def caption_to_dict(caption: Caption) -> dict[str, Any]:
    """JSON form of a structured caption: "template", "subject", "relation", "object", "wording"."""
    return {
        "template": caption.template,
        "subject": _description_to_dict(caption.subject),
        "relation": caption.relation,
        "object": _description_to_dict(caption.obj),
        "wording": caption.wording,
    }


def caption_from_dict(record: dict[str, Any]) -> Caption:
    """Rebuild a structured caption from its JSON form.

    Args:
        record: A dict as written by `caption_to_dict`.

    Returns:
        The caption.
    """
    return Caption(
        template=record["template"],
        subject=_description_from_dict(record["subject"]),
        relation=record["relation"],
        obj=_description_from_dict(record["object"]),
        wording=record["wording"],
    )


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    atomic_write_bytes(path, json.dumps(payload, sort_keys=True).encode("utf-8"))


def _write_png(path: Path, scene: Scene) -> None:
    buffer = io.BytesIO()
    draw_scene(scene).save(buffer, format="PNG")
    atomic_write_bytes(path, buffer.getvalue())


def _split_rng(seed: int, split: str, stream: str) -> random.Random:
    # A string seed is hashed with SHA-512, so it is stable across runs and Python processes.
    return random.Random(f"shapes:{seed}:{split}:{stream}")


def _image_file_name(image_id: int) -> str:
    return f"{image_id:012d}.png"


def _caption_id(example: ImageExample, index: int) -> int:
    return (example.image_id - 1) * len(example.captions) + index + 1


def _coco_captions(split: str, seed: int, image_size: int, examples: list[ImageExample]) -> dict[str, Any]:
    info = {
        "description": "shapes world synthetic captions",
        "version": "1.0",
        "split": split,
        "seed": seed,
        "image_size": image_size,
    }
    images = [
        {"id": ex.image_id, "file_name": _image_file_name(ex.image_id), "width": image_size,
         "height": image_size}
        for ex in examples
    ]
    annotations = [
        {"id": _caption_id(ex, index), "image_id": ex.image_id, "caption": caption.text,
         "neg_captions": [negative.text for negative in ex.negatives[index]]}
        for ex in examples
        for index, caption in enumerate(ex.captions)
    ]
    return {"info": info, "images": images, "annotations": annotations}


def _scene_graph_record(example: ImageExample) -> dict[str, Any]:
    relations = [
        {"subject": subject.id, "predicate": relation, "object": obj.id}
        for subject, relation, obj in scene_relations(example.scene)
    ]
    captions = [
        {"caption_id": _caption_id(example, index), "caption": caption.text,
         "structure": caption_to_dict(caption),
         "neg_structures": [caption_to_dict(negative) for negative in example.negatives[index]],
         "phrases": caption_phrases(example.scene, caption)}
        for index, caption in enumerate(example.captions)
    ]
    record = {"image_id": example.image_id, "file_name": _image_file_name(example.image_id)}
    return {**record, **scene_to_dict(example.scene), "relations": relations, "captions": captions}


def write_caption_split(root: Path, split: str, n_images: int, image_size: int, seed: int,
                        captions_per_image: int) -> None:
    """Write one split's images, COCO captions and scene graphs.

    Args:
        root: Dataset directory.
        split: "train" or "val".
        n_images: Number of images.
        image_size: Image side in pixels.
        seed: Base seed.
        captions_per_image: Captions per image.
    """
    rng = _split_rng(seed, split, "captions")
    image_dir = root / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    examples = []
    for image_id in range(1, n_images + 1):
        example = sample_example(rng, image_id, image_size, captions_per_image)
        _write_png(image_dir / _image_file_name(image_id), example.scene)
        examples.append(example)
    # Annotations are written after the images, so their presence means the split is complete.
    annotation_dir = root / "annotations"
    _write_json(annotation_dir / f"captions_{split}.json", _coco_captions(split, seed, image_size, examples))
    scene_graphs = {"images": [_scene_graph_record(example) for example in examples]}
    _write_json(annotation_dir / f"scene_graphs_{split}.json", scene_graphs)


def _swap_item(
    root: Path, split: str, item_id: int, swap_type: str, rng: random.Random, image_size: int
) -> dict[str, Any]:
    scenes, captions = sample_swap_pair(rng, image_size, swap_type)
    image_paths = [f"images/swap_{split}/{item_id:06d}_{index}.png" for index in (0, 1)]
    for path, scene in zip(image_paths, scenes):
        _write_png(root / path, scene)
    return {
        "id": item_id,
        "type": swap_type,
        "images": image_paths,
        "captions": [caption.text for caption in captions],
        "structures": [caption_to_dict(caption) for caption in captions],
        "scenes": [scene_to_dict(scene) for scene in scenes],
    }


def write_swap_split(root: Path, split: str, n_items: int, image_size: int, seed: int) -> None:
    """Write one split's swap benchmark: image pairs and `annotations/swap_<split>.json`.

    Args:
        root: Dataset directory.
        split: "train" or "val".
        n_items: Number of items; types go round robin so they stay balanced.
        image_size: Image side in pixels.
        seed: Base seed.
    """
    rng = _split_rng(seed, split, "swap")
    (root / "images" / f"swap_{split}").mkdir(parents=True, exist_ok=True)
    items = [
        _swap_item(root, split, item_id, SWAP_TYPES[(item_id - 1) % len(SWAP_TYPES)], rng, image_size)
        for item_id in range(1, n_items + 1)
    ]
    _write_json(root / "annotations" / f"swap_{split}.json", {"items": items})


def default_n_swap(split: str, n_train: int, n_val: int) -> int:
    """Swap items per split when not given: n_val for val, a tenth of n_train (at least 1) for train."""
    return n_val if split == "val" else max(1, n_train // 10)


def _check_arguments(
    n_train: int, n_val: int, image_size: int, captions_per_image: int, n_swap: int | None
) -> None:
    if min(n_train, n_val) < 0 or (n_swap is not None and n_swap < 0):
        raise ValueError("n_train, n_val and n_swap must be non-negative")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be at least {MIN_IMAGE_SIZE}, got {image_size}")
    if captions_per_image < 1:
        raise ValueError(f"captions_per_image must be at least 1, got {captions_per_image}")


def generate(out_dir: str | os.PathLike, n_train: int, n_val: int, image_size: int = 64, seed: int = 0,
             captions_per_image: int = 2, n_swap: int | None = None) -> dict[str, dict[str, int]]:
    """Generate the shapes world under `out_dir`; the same arguments give byte-identical files.

    Args:
        out_dir: Dataset directory (created if missing).
        n_train: Number of training images.
        n_val: Number of validation images.
        image_size: Image side in pixels (at least `MIN_IMAGE_SIZE`).
        seed: Base seed.
        captions_per_image: Different captions per image.
        n_swap: Swap items per split; default `default_n_swap`.

    Returns:
        Counts per split: {"train": {"images", "captions", "swap_items"}, "val": {...}}.

    Raises:
        ValueError: On a negative count, too small an image or fewer than one caption per image.
    """
    _check_arguments(n_train, n_val, image_size, captions_per_image, n_swap)
    root = Path(out_dir)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, n_images in zip(SPLITS, (n_train, n_val)):
        n_items = default_n_swap(split, n_train, n_val) if n_swap is None else n_swap
        write_caption_split(root, split, n_images, image_size, seed, captions_per_image)
        write_swap_split(root, split, n_items, image_size, seed)
        counts[split] = {"images": n_images, "captions": n_images * captions_per_image, "swap_items": n_items}
    return counts


def load_scene_graphs(root: str | os.PathLike, split: str) -> list[dict[str, Any]]:
    """Read `annotations/scene_graphs_<split>.json`.

    Args:
        root: Dataset directory.
        split: "train" or "val".

    Returns:
        One record per image (see the module's writer for the keys); `scene_from_dict` and
        `caption_from_dict` turn its parts back into structured data.
    """
    path = Path(root) / "annotations" / f"scene_graphs_{split}.json"
    return json.loads(path.read_text(encoding="utf-8"))["images"]


def load_swap_items(root: str | os.PathLike, split: str) -> list[dict[str, Any]]:
    """Read `annotations/swap_<split>.json` with image paths made absolute.

    Args:
        root: Dataset directory.
        split: "train" or "val".

    Returns:
        The swap items; "images" holds two absolute paths.
    """
    root = Path(root).resolve()
    items = json.loads((root / "annotations" / f"swap_{split}.json").read_text(encoding="utf-8"))["items"]
    return [{**item, "images": [str(root / path) for path in item["images"]]} for item in items]


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: generate the dataset and print the counts as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="dataset directory")
    parser.add_argument("--n-train", type=int, required=True)
    parser.add_argument("--n-val", type=int, required=True)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--captions-per-image", type=int, default=2)
    parser.add_argument("--n-swap", type=int, default=None, help="swap items per split")
    args = parser.parse_args(argv)
    counts = generate(args.out, args.n_train, args.n_val, args.image_size, args.seed,
                      args.captions_per_image, args.n_swap)
    print(json.dumps(counts, sort_keys=True))


if __name__ == "__main__":
    main()
