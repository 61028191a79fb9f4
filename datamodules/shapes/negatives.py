"""Hard negatives: three captions false of a scene per true caption (attribute swap, relation flip, object swap)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from datamodules.shapes.heldout import ANY_SCENE, SplitRule
from datamodules.shapes.world import COLORS, OPPOSITE_RELATION, RELATIONS, SHAPES, SIZES, Caption, Scene, holds


# Each generator yields candidate negatives, hardest first, and ends with one that names a colour or
# shape absent from the scene, which cannot be true; `_first_false` keeps the first false candidate that the
# split allows. An in-distribution split allows no negative that names a held-out combination or colour pair
# (`datamodules.shapes.heldout`): there the next false candidate is taken, and after a generator's own
# candidates come `_absent_attributes`, which cannot be true either.


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


def _half_swaps(caption: Caption, field: str) -> Iterator[Caption]:
    """The subject takes the object's `field`, then the object the subject's: a binding error still, in the words
    of the true caption, for when the full swap is true or names a held-out combination."""
    yield _with_subject(caption, **{field: getattr(caption.obj, field)})
    yield replace(caption, obj=replace(caption.obj, **{field: getattr(caption.subject, field)}))


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
    yield from _half_swaps(caption, "color")
    yield from _absent_colors(rng, scene, caption)


def _relation_flips(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    yield replace(caption, subject=caption.obj, obj=caption.subject)
    yield replace(caption, relation=OPPOSITE_RELATION[caption.relation])
    yield from _absent_colors(rng, scene, caption)


def _object_swaps(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    yield swap_field(caption, "shape")
    yield from _half_swaps(caption, "shape")
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


def _absent_attributes(rng: random.Random, scene: Scene, caption: Caption) -> Iterator[Caption]:
    """Last resort: the subject, then the object, with each colour and each shape that no object has."""
    colors = _absent(COLORS, {obj.color for obj in scene.objects})
    shapes = _absent(SHAPES, {obj.shape for obj in scene.objects})
    for role in ("subject",) if caption.relation is None else ("subject", "obj"):
        for field, values in (("color", colors), ("shape", shapes)):
            for value in rng.sample(values, len(values)):
                yield replace(caption, **{role: replace(getattr(caption, role), **{field: value})})


def _first_false(scene: Scene, candidates: Iterator[Caption], taken: set[str], rule: SplitRule,
                 relations: tuple[str, ...]) -> Caption:
    """The first candidate that is false of the scene, new among the negatives taken, allowed by `rule` and stating
    one of `relations` (a relation that no true caption states would make its negatives false by their wording)."""
    for candidate in candidates:
        stated = candidate.relation is None or candidate.relation in relations
        if stated and candidate.text not in taken and not holds(scene, candidate) and rule.allows_negative(candidate):
            return candidate
    raise RuntimeError(f"no allowed false candidate left for a negative in {scene}")


def hard_negatives(rng: random.Random, scene: Scene, caption: Caption, rule: SplitRule = ANY_SCENE,
                   relations: tuple[str, ...] = RELATIONS) -> tuple[Caption, ...]:
    """Three captions false of `scene`: attribute swap, relation flip, object swap of `caption`.

    Args:
        rng: Source of randomness.
        scene: The scene `caption` is true of.
        caption: A true structured caption.
        rule: The split's rule; a candidate it does not allow is passed over for the next false one.
        relations: The relations the world's captions state; a candidate stating another is passed over too.

    Returns:
        Three different negatives, each checked to be false of the scene.
    """
    kinds = PAIR_NEGATIVE_KINDS if caption.relation else SINGLE_NEGATIVE_KINDS
    negatives: list[Caption] = []
    for kind in kinds:
        taken = {negative.text for negative in negatives}
        candidates = itertools.chain(kind(rng, scene, caption), _absent_attributes(rng, scene, caption))
        negatives.append(_first_false(scene, candidates, taken, rule, relations))
    return tuple(negatives)
