"""The real parser and the real preprocessing on a whole shapes split, against the shapes world's ground truth.

The shapes world knows the scene graph of every caption: which words name objects (the shape nouns), which
are composition words (sizes, colours, the relation wording, the template's own relation/participle verb),
and which box each object has. The token masks of CLIP-CAE and MACCO come from the parsed spans, MACCO's
patch masks from the phrase boxes, so both are scored here on every caption of a generated split: word F1
by exact character span, and the share of grounding phrases whose boxes are exactly those of the objects
they name.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

import datamodules.preprocess as preprocess
from core.config import load_config
from datamodules.cache import open_cache
from datamodules.shapes import (TEMPLATES, Caption, caption_from_dict, generate, load_scene_graphs, render_caption,
                                scene_from_dict, witness)

REPO = Path(__file__).resolve().parents[1]
N_IMAGES = 150   # 300 captions: every template about 25 times (3 of the 12 are single-object, 15% of captions)
SEED = 0
# Words of each template's own text (outside its slots) that are composition words: a verb that relates the
# two objects ("sits"), a participle that describes the subject ("placed"), the preposition of "X with Y".
# "there is", "can be seen", "an image showing", "a picture of" only say that something is in the photo.
TEMPLATE_COMPOSITION_WORDS: Dict[str, Set[str]] = {
    "plain": set(), "is": set(), "there_is": set(), "definite": set(), "sits": {"sits"}, "placed": {"placed"},
    "image_showing": set(), "can_be_seen": set(), "with_it": {"with"},
    "single": set(), "single_there_is": set(), "single_picture": set(),
}
DETERMINERS = {"a", "an", "the"}   # "to the left of": the article is no composition word

Spans = List[Tuple[int, int]]


def word_spans(text: str, start: int, end: int) -> Spans:
    return [(start + m.start(), start + m.end()) for m in re.finditer(r"\S+", text[start:end])]


def true_words(caption: Caption) -> Tuple[Spans, Spans]:
    """(object word spans, composition word spans) of a caption, from its template slots."""
    text, slots = render_caption(caption)
    objects, composition = [], []
    for slot in ("s", "o"):
        if slot in slots:
            *modifiers, shape = word_spans(text, *slots[slot])   # "large red square": size, colour, shape
            objects.append(shape)
            composition.extend(modifiers)
    if "r" in slots:
        composition.extend(s for s in word_spans(text, *slots["r"]) if text[s[0]:s[1]] not in DETERMINERS)
    slot_chars = {i for start, end in slots.values() for i in range(start, end)}
    literal = [s for s in word_spans(text, 0, len(text)) if s[0] not in slot_chars]
    composition.extend(s for s in literal if text[s[0]:s[1]] in TEMPLATE_COMPOSITION_WORDS[caption.template])
    return sorted(objects), sorted(composition)


def true_box_of_head(caption: Caption, scene_record: dict) -> Dict[Tuple[int, int], List[int]]:
    """Box of the object named by each shape noun of the caption (by the noun's character span)."""
    text, slots = render_caption(caption)
    subject, obj = witness(scene_from_dict(scene_record), caption)
    boxes = {}
    for slot, thing in (("s", subject), ("o", obj)):
        if slot in slots:
            boxes[word_spans(text, *slots[slot])[-1]] = list(thing.bbox)
    return boxes


class Score:
    """Micro-averaged span precision / recall / F1 (spans compared as multisets)."""

    def __init__(self) -> None:
        self.tp = self.predicted = self.true = 0

    def add(self, predicted: Spans, true: Spans) -> None:
        self.tp += sum((Counter(map(tuple, predicted)) & Counter(map(tuple, true))).values())
        self.predicted += len(predicted)
        self.true += len(true)

    def prf(self) -> Tuple[float, float, float]:
        p = self.tp / self.predicted if self.predicted else 0.0
        r = self.tp / self.true if self.true else 0.0
        return p, r, (2 * p * r / (p + r) if p + r else 0.0)


def phrase_boxes_exact(record: dict, box_of_head: Dict[Tuple[int, int], List[int]]) -> List[bool]:
    """Per cached phrase: are its boxes exactly those of the objects it names (a relation phrase: both, an
    attribute phrase: its one object)? A phrase naming something that is no object of the caption fails."""
    graph = record["graph"]
    exact = []
    for phrase, cached in zip(graph["phrases"], record["phrases"]):
        heads = [tuple(graph["entities"][e]["head"]) for e in phrase["entities"]]
        expected = [box_of_head.get(h) for h in heads]
        got = sorted(tuple(box[:4]) for box in cached["boxes"])
        exact.append(None not in expected and got == sorted(tuple(map(float, b)) for b in expected))
    return exact


def has_true_relation(record: dict, caption: Caption) -> bool:
    """Whether some relation phrase goes from the caption's subject to its object (the stated direction)."""
    text, slots = render_caption(caption)
    subject_head, object_head = word_spans(text, *slots["s"])[-1], word_spans(text, *slots["o"])[-1]
    entities = record["graph"]["entities"]
    return any(p["kind"] == "relation" and [tuple(entities[e]["head"]) for e in p["entities"]]
               == [subject_head, object_head] for p in record["graph"]["phrases"])


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> Tuple[list, Dict[int, dict]]:
    """A generated split's scene-graph records and the preprocessing cache of its captions, by caption id."""
    root = tmp_path_factory.mktemp("shapes")
    generate(root, n_train=0, n_val=N_IMAGES, image_size=64, seed=SEED, n_swap=0)
    cfg = load_config([REPO / "configs" / "demo" / "pretrain.yaml"], [   # the demo's preprocessing, on this split alone
        f"data.root={root}", "data.train_annotations=annotations/captions_val.json", "data.train_images=images/val",
        "data.val_annotations=", f"preprocess.cache_root={root / 'cache'}",
        "preprocess.train_scene_graphs=annotations/scene_graphs_val.json", "preprocess.val_scene_graphs="])
    manifest = preprocess.run(cfg)["train"]
    cache = open_cache(preprocess.cache_directory(cfg.preprocess.cache_root, manifest["settings"]))
    return load_scene_graphs(root, "val"), {r["caption_id"]: r for r in cache.read_all()}


def test_template_table_covers_every_template():
    assert set(TEMPLATE_COMPOSITION_WORDS) == set(TEMPLATES)


def test_parser_and_phrase_boxes_match_the_shapes_ground_truth(split):
    scene_records, cache = split
    objects, composition = Score(), Score()
    exact: List[bool] = []
    relations_found, pair_captions, templates = 0, 0, Counter()
    for scene_record in scene_records:
        for entry in scene_record["captions"]:
            caption, record = caption_from_dict(entry["structure"]), cache[entry["caption_id"]]
            templates[caption.template] += 1
            true_objects, true_composition = true_words(caption)
            objects.add(record["obj_spans"], true_objects)
            composition.add(record["comp_spans"], true_composition)
            box_of_head = true_box_of_head(caption, scene_record)
            exact.extend(phrase_boxes_exact(record, box_of_head))
            if caption.relation is not None:
                pair_captions += 1
                relations_found += has_true_relation(record, caption)
    match_rate = sum(exact) / len(exact)
    print(f"\n{sum(templates.values())} captions, {len(templates)} templates; "
          f"object words P/R/F1 = {'/'.join(f'{v:.3f}' for v in objects.prf())}; "
          f"composition words P/R/F1 = {'/'.join(f'{v:.3f}' for v in composition.prf())}; "
          f"phrases with exactly their objects' boxes: {sum(exact)}/{len(exact)} = {match_rate:.3f}; "
          f"stated relation found (right direction): {relations_found}/{pair_captions}")
    assert set(templates) == set(TEMPLATES), "the split must exercise every template"
    assert objects.prf()[2] >= 0.98
    assert composition.prf()[2] >= 0.98
    assert match_rate == 1.0
    # One known miss in this split: in "there is a small purple square right of a blue diamond" spaCy tags
    # "square" as an adjective ("square right", as in "directly right"), so the subject is lost.
    assert relations_found >= 0.99 * pair_captions
