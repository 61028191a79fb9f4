"""Hard negatives: three captions false of a scene per true caption (attribute swap, relation flip, object swap)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from datamodules.shapes.world import COLORS, OPPOSITE_RELATION, SHAPES, SIZES, Caption, Scene, holds


# Each generator yields candidate negatives, hardest first, and ends with one that names a colour or
# shape absent from the scene, which cannot be true; `_first_false` keeps the first false candidate.


def _with_subject(caption: Caption, **changes: str | None) -> Caption:
    return replace(caption, subject=replace(caption.subject, **changes))


def swap_field(caption: Caption, field: str) -> Caption:
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
    yield swap_field(caption, "color")
    if caption.subject.size and caption.obj.size:
        yield swap_field(caption, "size")
    yield from _absent_colors(rng, scene, caption)


def _relation_flips(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    yield replace(caption, subject=caption.obj, obj=caption.subject)
    yield replace(caption, relation=OPPOSITE_RELATION[caption.relation])
    yield from _absent_colors(rng, scene, caption)


def _object_swaps(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    yield swap_field(caption, "shape")
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
