"""The shapes world: a deterministic CLEVR-like synthetic dataset in COCO captions format.

Every image holds 2-3 non-overlapping objects (shape x colour x size) on a plain background. Captions are
drawn from varied templates as structured data (`Caption`) and rendered to text; a semantic checker
(`holds`) decides whether a structured caption is true of a scene, which guarantees that every caption is
true and every hard negative is false. A Winoground-style swap benchmark pairs two images that differ only
in attribute binding, relation direction or object identity.

Splits (`SPLITS`): `train`; `val`, the split for all selection (checkpoints, learning rates, loss weights);
`test` and `test_unseen`, for reporting only. Each has its images, COCO captions, scene graphs and a swap set
balanced over the three swap types. `test_unseen` measures systematic generalisation: the world seed chooses
held-out colour-shape combinations (one per shape, all colours different: 4 of 24, so every colour and every
shape still occurs in training) and `HELDOUT_COLOR_PAIRS` disjoint colour pairs (two objects of a pair's colours
never share an image). `train`, `val` and `test` never show or name one, in an image, caption, hard negative
or either image of a swap item (a negative that would name one gives way to the next false candidate). Every
`test_unseen` image and caption, and every `test_unseen` swap item, names one: a held-out combination, or a
relation between two objects of a held-out pair. `annotations/heldout.json` records them; the Makefile's world
(seed 0) holds out: combinations blue square, orange triangle, purple circle, yellow diamond; colour pairs
green+yellow, purple+red.

Captions state a relation either way ("X left of Y" or "Y right of X", `--relations both`, the default) or one
way only (`--relations one-way`: "left of" and "above"; `CAPTION_RELATIONS` says why the choice matters).

Same arguments give byte-identical files: every random choice comes from a `random.Random` seeded by
(seed, split, stream), and no file holds a timestamp.

Modules, each one job (each imports only modules above it in this list):
    world      every constant of the world; objects and captions as data (`SceneObject`, `Scene`,
               `Description`, `Caption`); the semantics (`relation_holds`, `witness`, `holds`); caption text
               (`render_caption`).
    heldout    the held-out combinations and colour pairs (`choose_heldout`) and each split's rule about them.
    negatives  three hard negatives per true caption (`hard_negatives`).
    scenes     object placement, scene sampling, true captions, one image's example (`sample_example`).
    swap       the swap benchmark's image and caption pairs (`sample_swap_pair`).
    records    JSON forms of scenes and captions (`scene_to_dict`, `caption_from_dict`, ...).
    render     a scene drawn as pixels (`draw_scene`); a true caption's phrases with their spans and boxes.
    files      the files of a split, `generate`, and the readers (`load_scene_graphs`, `load_swap_items`,
               `load_heldout`).
    zeroshot   single-object zero-shot classification sets of a generated world (its own command line).
    __main__   the command line.

Usage:
    python -m datamodules.shapes --out data/shapes --n-train 4000 --n-val 500 --image-size 64 --seed 0 \
        [--n-test N] [--n-test-unseen N]   # both default to --n-val
        [--relations one-way]              # captions state "left of" and "above" only (default: both ways)
"""

from datamodules.shapes.files import (
    default_n_swap,
    generate,
    load_heldout,
    load_scene_graphs,
    load_swap_items,
    write_caption_split,
    write_swap_split,
)
from datamodules.shapes.heldout import ANY_SCENE, HeldOut, SplitRule, choose_heldout, split_rule
from datamodules.shapes.negatives import PAIR_NEGATIVE_KINDS, SINGLE_NEGATIVE_KINDS, NegativeKind, hard_negatives
from datamodules.shapes.records import caption_from_dict, caption_to_dict, scene_from_dict, scene_to_dict
from datamodules.shapes.render import caption_phrases, draw_scene
from datamodules.shapes.scenes import object_side, sample_caption, sample_captions, sample_example, sample_scene
from datamodules.shapes.swap import SWAPPERS, sample_swap_pair
from datamodules.shapes.world import (
    ATTRIBUTE_TRIPLES,
    BACKGROUND,
    CAPTION_ATTEMPTS,
    CAPTION_RELATIONS,
    COLORS,
    DEFAULT_CAPTION_RELATIONS,
    DISTRACTOR_RATE,
    HELDOUT_COLOR_PAIRS,
    MIN_IMAGE_SIZE,
    OBJECT_GAP,
    OPPOSITE_RELATION,
    OPTIONAL_SIZE_RATE,
    PAIR_TEMPLATES,
    PLACEMENT_ATTEMPTS,
    RELATION_MARGIN,
    RELATION_WORDINGS,
    RELATIONS,
    SHAPES,
    SINGLE_CAPTION_RATE,
    SINGLE_TEMPLATES,
    SIZES,
    SPLITS,
    SWAP_TYPES,
    TEMPLATES,
    UNSEEN_SPLIT,
    Caption,
    Description,
    ImageExample,
    Scene,
    SceneObject,
    holds,
    relation_holds,
    render_caption,
    scene_relations,
    witness,
)

__all__ = [
    "ANY_SCENE", "ATTRIBUTE_TRIPLES", "BACKGROUND", "CAPTION_ATTEMPTS", "CAPTION_RELATIONS", "COLORS",
    "DEFAULT_CAPTION_RELATIONS", "DISTRACTOR_RATE",
    "HELDOUT_COLOR_PAIRS", "MIN_IMAGE_SIZE", "OBJECT_GAP", "OPPOSITE_RELATION", "OPTIONAL_SIZE_RATE",
    "PAIR_NEGATIVE_KINDS", "PAIR_TEMPLATES", "PLACEMENT_ATTEMPTS", "RELATION_MARGIN", "RELATION_WORDINGS",
    "RELATIONS", "SHAPES", "SINGLE_CAPTION_RATE", "SINGLE_NEGATIVE_KINDS", "SINGLE_TEMPLATES", "SIZES", "SPLITS",
    "SWAPPERS", "SWAP_TYPES", "TEMPLATES", "UNSEEN_SPLIT", "Caption", "Description", "HeldOut", "ImageExample",
    "NegativeKind", "Scene", "SceneObject", "SplitRule", "caption_from_dict", "caption_phrases", "caption_to_dict",
    "choose_heldout", "default_n_swap", "draw_scene", "generate", "hard_negatives", "holds", "load_heldout",
    "load_scene_graphs", "load_swap_items", "object_side", "relation_holds", "render_caption", "sample_caption",
    "sample_captions", "sample_example", "sample_scene", "sample_swap_pair", "scene_from_dict", "scene_relations",
    "scene_to_dict", "split_rule", "witness", "write_caption_split", "write_swap_split",
]
