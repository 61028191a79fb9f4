"""Held-out combinations for systematic generalisation, and the rule each split follows about them.

From the world seed alone, `choose_heldout` picks
- one colour-shape combination per shape, the colours all different (a Latin-square-like choice: 4 of the 24
  combinations; every shape keeps 5 of its 6 colours and every colour at least 3 of its 4 shapes), and
- `HELDOUT_COLOR_PAIRS` disjoint unordered colour pairs: two objects of these colours never share an image.

`train`, `val` and `test` never show a held-out combination or pair: not in an image, a caption, a hard negative
or a swap item (both images). Every image and every caption of `test_unseen`, and one caption at least of
every `test_unseen` swap item, names one (a held-out combination, or a relation between objects of a held-out
pair); its hard negatives are free.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from datamodules.shapes.world import COLORS, HELDOUT_COLOR_PAIRS, SHAPES, SPLITS, UNSEEN_SPLIT, Caption, Scene


@dataclass(frozen=True)
class HeldOut:
    """Colour-shape combinations `combos` (colour, shape) and unordered colour `pairs` kept out of training."""

    combos: frozenset[tuple[str, str]]
    pairs: frozenset[frozenset[str]]

    def shown_in(self, scene: Scene) -> bool:
        """Whether an object of `scene` has a held-out combination, or two objects a held-out colour pair."""
        combo = any((obj.color, obj.shape) in self.combos for obj in scene.objects)
        pairs = itertools.combinations(scene.objects, 2)
        return combo or any(frozenset((a.color, b.color)) in self.pairs for a, b in pairs)

    def named_in(self, caption: Caption) -> bool:
        """Whether `caption` names a held-out combination, or relates two objects of a held-out colour pair."""
        descriptions = (caption.subject,) if caption.relation is None else (caption.subject, caption.obj)
        combo = any((description.color, description.shape) in self.combos for description in descriptions)
        pair = caption.relation is not None and frozenset((caption.subject.color, caption.obj.color)) in self.pairs
        return combo or pair


    def __str__(self) -> str:
        """E.g. "combinations blue square, orange triangle; colour pairs green+yellow, purple+red"."""
        combos = ", ".join(f"{color} {shape}" for color, shape in sorted(self.combos))
        pairs = ", ".join(sorted("+".join(sorted(pair)) for pair in self.pairs))
        return f"combinations {combos}; colour pairs {pairs}"


NOTHING_HELD_OUT = HeldOut(frozenset(), frozenset())


def choose_heldout(seed: int) -> HeldOut:
    """The held-out combinations and colour pairs of the world drawn with `seed` (see the module docstring).

    Args:
        seed: The world's base seed.

    Returns:
        The held-out sets; a different seed usually gives different ones.
    """
    # A string seed is hashed with SHA-512, so it is stable across runs and Python processes.
    rng = random.Random(f"shapes:{seed}:heldout")
    combo_colors = rng.sample(list(COLORS), len(SHAPES))
    pair_colors = rng.sample(list(COLORS), 2 * HELDOUT_COLOR_PAIRS)
    return HeldOut(
        combos=frozenset(zip(combo_colors, SHAPES)),
        pairs=frozenset(frozenset(pair_colors[i:i + 2]) for i in range(0, len(pair_colors), 2)),
    )


def heldout_to_dict(heldout: HeldOut) -> dict[str, list]:
    """JSON form, sorted: {"combos": [{"color", "shape"}, ...], "pairs": [[colour, colour], ...]}."""
    return {
        "combos": [{"color": color, "shape": shape} for color, shape in sorted(heldout.combos)],
        "pairs": sorted(sorted(pair) for pair in heldout.pairs),
    }


def heldout_from_dict(record: dict[str, Sequence]) -> HeldOut:
    """Rebuild the held-out sets from their JSON form (`heldout_to_dict`)."""
    return HeldOut(
        combos=frozenset((combo["color"], combo["shape"]) for combo in record["combos"]),
        pairs=frozenset(frozenset(pair) for pair in record["pairs"]),
    )


@dataclass(frozen=True)
class SplitRule:
    """What a split may show and say about the held-out sets.

    In-distribution splits (`unseen` False) never show or name a held-out combination or pair; the unseen split
    shows one in every image and names one in every caption and in every swap item.
    """

    heldout: HeldOut
    unseen: bool = False

    def allows_scene(self, scene: Scene) -> bool:
        """Whether an image of this split may show `scene`."""
        return self.heldout.shown_in(scene) == self.unseen

    def allows_caption(self, caption: Caption) -> bool:
        """Whether a true caption of this split may say `caption`."""
        return self.heldout.named_in(caption) == self.unseen

    def allows_negative(self, negative: Caption) -> bool:
        """Whether a hard negative of this split may say `negative` (the unseen split's are free)."""
        return self.unseen or not self.heldout.named_in(negative)

    def allows_swap(self, scenes: tuple[Scene, Scene], captions: tuple[Caption, Caption]) -> bool:
        """Whether a swap item of this split may hold these two images and captions."""
        if self.unseen:
            return any(self.heldout.named_in(caption) for caption in captions)
        return not any(self.heldout.shown_in(scene) for scene in scenes)


ANY_SCENE = SplitRule(NOTHING_HELD_OUT)


def split_rule(seed: int, split: str) -> SplitRule:
    """The rule of `split` in the world drawn with `seed`.

    Args:
        seed: The world's base seed.
        split: One of `SPLITS`.

    Returns:
        The split's rule.

    Raises:
        ValueError: On an unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; the splits are {', '.join(SPLITS)}")
    return SplitRule(choose_heldout(seed), unseen=split == UNSEEN_SPLIT)
