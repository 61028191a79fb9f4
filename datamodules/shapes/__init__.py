"""The shapes world: a deterministic CLEVR-like synthetic dataset in COCO captions format.

Every image holds 2-3 non-overlapping objects (shape x colour x size) on a plain background. Captions are
drawn from varied templates as structured data (`Caption`) and rendered to text; a semantic checker
(`holds`) decides whether a structured caption is true of a scene, which guarantees that every caption is
true and every hard negative is false. A Winoground-style swap benchmark pairs two images that differ only
in attribute binding, relation direction or object identity.

Same arguments give byte-identical files: every random choice comes from a `random.Random` seeded by
(seed, split, stream), and no file holds a timestamp.

Modules, each one job (the imports point down this list, never up):
    world      every constant of the world; objects and captions as data (`SceneObject`, `Scene`,
               `Description`, `Caption`); the semantics (`relation_holds`, `witness`, `holds`); caption text
               (`render_caption`).
    render     a scene drawn as pixels (`draw_scene`); a true caption's phrases with their spans and boxes.
    negatives  three hard negatives per true caption (`hard_negatives`).
    scenes     object placement, scene sampling, true captions, one image's example (`sample_example`).
    swap       the swap benchmark's image and caption pairs (`sample_swap_pair`).
    records    JSON forms of scenes and captions (`scene_to_dict`, `caption_from_dict`, ...).
    files      the files of a split, `generate`, and the readers (`load_scene_graphs`, `load_swap_items`).
    __main__   the command line.

Usage:
    python -m datamodules.shapes --out data/shapes --n-train 4000 --n-val 500 --image-size 64 --seed 0
"""

from datamodules.shapes.files import (
    default_n_swap,
    generate,
    load_scene_graphs,
    load_swap_items,
    write_caption_split,
    write_swap_split,
)
from datamodules.shapes.negatives import PAIR_NEGATIVE_KINDS, SINGLE_NEGATIVE_KINDS, NegativeKind, hard_negatives
from datamodules.shapes.records import caption_from_dict, caption_to_dict, scene_from_dict, scene_to_dict
from datamodules.shapes.render import caption_phrases, draw_scene
from datamodules.shapes.scenes import object_side, sample_caption, sample_captions, sample_example, sample_scene
from datamodules.shapes.swap import SWAPPERS, sample_swap_pair
from datamodules.shapes.world import (
    ATTRIBUTE_TRIPLES,
    BACKGROUND,
    CAPTION_ATTEMPTS,
    COLORS,
    DISTRACTOR_RATE,
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
    "ATTRIBUTE_TRIPLES", "BACKGROUND", "CAPTION_ATTEMPTS", "COLORS", "DISTRACTOR_RATE", "MIN_IMAGE_SIZE",
    "OBJECT_GAP", "OPPOSITE_RELATION", "OPTIONAL_SIZE_RATE", "PAIR_NEGATIVE_KINDS", "PAIR_TEMPLATES",
    "PLACEMENT_ATTEMPTS", "RELATION_MARGIN", "RELATION_WORDINGS", "RELATIONS", "SHAPES", "SINGLE_CAPTION_RATE",
    "SINGLE_NEGATIVE_KINDS", "SINGLE_TEMPLATES", "SIZES", "SPLITS", "SWAPPERS", "SWAP_TYPES", "TEMPLATES",
    "Caption", "Description", "ImageExample", "NegativeKind", "Scene", "SceneObject",
    "caption_from_dict", "caption_phrases", "caption_to_dict", "default_n_swap", "draw_scene", "generate",
    "hard_negatives", "holds", "load_scene_graphs", "load_swap_items", "object_side", "relation_holds",
    "render_caption", "sample_caption", "sample_captions", "sample_example", "sample_scene", "sample_swap_pair",
    "scene_from_dict", "scene_relations", "scene_to_dict", "witness", "write_caption_split", "write_swap_split",
]
