"""The world itself: its constants, its objects and captions as data, what makes a caption true, and caption text.

Every constant of the world (colours, shapes, sizes, relations and their margin, templates, sampling rates) is
defined here and only here.
"""

from __future__ import annotations

import itertools
import string
from dataclasses import dataclass

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
# Which relations captions state. "both": a pair is stated either way, "X left of Y" or its converse "Y right of
# X" (the world as it always was, and the default). "one-way": only "left of" and "above", so a
# relation word always means the same thing about its two slots. Measured with `study.relation_text_probe`: with
# the converse, which slot is on the left depends on the slot *and* the relation word (an exclusive-or), and a text
# tower trained contrastively against a perfect image side stays at chance on relation direction for 1,500 steps;
# one-way, the same tower is at 69, 73, 78% after 100, 200, 300 steps
# (docs/study-history.md#what-makes-relation-direction-learnable).
CAPTION_RELATIONS: dict[str, tuple[str, ...]] = {
    "both": RELATIONS,
    "one-way": ("left of", "above"),
}
DEFAULT_CAPTION_RELATIONS = "both"
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
# "val" serves all selection; "test" and "test_unseen" serve reporting only. "test_unseen" is the one split whose
# images show held-out colour-shape combinations and colour pairs (see `datamodules.shapes.heldout`).
SPLITS: tuple[str, ...] = ("train", "val", "test", "test_unseen")
UNSEEN_SPLIT = "test_unseen"
# Held-out unordered colour pairs: two objects of these colours never share an image outside `UNSEEN_SPLIT`.
HELDOUT_COLOR_PAIRS = 2

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


# ---------------------------------------------------------------- caption text


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
