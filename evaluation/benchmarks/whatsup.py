"""What'sUp (Kamath et al., EMNLP 2023): spatial prepositions, one image and 2 or 4 caption options.

Six sets, each a JSON file in the authors' data folder (`amitakamath/whatsup_vlms`,
`dataset_zoo/aro_datasets.py`); the first caption option is always gold:

| registry name      | file                            | images (option `images`, default)   | options |
|--------------------|---------------------------------|-------------------------------------|---------|
| `whatsup_a`        | `controlled_images_dataset.json`| `<root>/controlled_images`           | 4       |
| `whatsup_b`        | `controlled_clevr_dataset.json` | `<root>/controlled_clevr`            | 4       |
| `whatsup_coco_one` | `coco_qa_one_obj.json`          | `<root>/val2017` (`{id:012d}.jpg`)   | 2       |
| `whatsup_coco_two` | `coco_qa_two_obj.json`          | `<root>/val2017`                     | 2       |
| `whatsup_gqa_one`  | `vg_qa_one_obj.json`            | `<root>/vg_images` (`{id}.jpg`)      | 2       |
| `whatsup_gqa_two`  | `vg_qa_two_obj.json`            | `<root>/vg_images`                   | 2       |

Controlled A/B records are `{"image_path": "data/controlled_images/<obj1>_<prep>_<obj2>.jpeg",
"caption_options": [gold, d1, d2, d3]}`; the path is re-rooted to `images / <file name>`. As in the
reference, the object pair is the first and last `_`-separated parts of the file name (multi-word objects
are hyphenated: `beer-bottle`) and the preposition is what lies between (`on`, `under`, `left_of`,
`right_of`, `in-front_of`, `behind`). COCO/GQA-spatial records are `[image_id, gold, wrong]`.

Scoring: an item is correct iff the gold option scores strictly above every other option. The reference
uses `np.argmax == 0`, which counts a tie with gold as correct, so its accuracy equals ours plus the tied
items; `ties` counts them. Controlled A/B also report, keyed by object pair (reference
`Controlled_Images.evaluate_scores`):
- `pair_accuracy`: share of (object pair, opposite-preposition pair) with both items correct, where the
  opposite pairs are left/right and on/under (A) or left/right and in-front/behind (B);
- `set_accuracy`: share of object pairs with all 4 prepositions correct.
The reference divides by N/2 and N/4 (N = items) and counts a missing preposition as wrong. We divide by
2 x and 1 x the number of object pairs, also counting a missing preposition as wrong (a preposition that
appears twice is correct only if both items are); the two agree whenever every object pair has its four
prepositions once, which the released counts (412 and 408, multiples of 4) suggest but which we could
not check against the files. `irregular_sets` counts object pairs that do not. Per-preposition accuracy is
reported for every set as `prep/<preposition>`,
with the reference's labels.

The paper's Table 1 numbers are macro averages over sets that are separate benchmarks here; they are declared
as cross-benchmark aggregates (`WHATSUP_COMBINED`: `whatsup_ab`, `whatsup_coco_spatial`, `whatsup_gqa_spatial`,
and `whatsup_six_sets`) that the results writer adds beside each set's own numbers when all their sets were run.
"""
from __future__ import annotations

from abc import abstractmethod
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from evaluation.benchmarks.annotations import require, required_text
from evaluation.benchmarks.base import ImageRef, Item, JsonListBenchmark, Outcome, beats_all, percent
from evaluation.benchmarks.sources import COCO_VAL2017, DataSource, published
from evaluation.benchmarks.combined import CombinedAggregate

PREPOSITIONS_A = ("on", "under", "left_of", "right_of")
PREPOSITIONS_B = ("left_of", "right_of", "in-front_of", "behind")
OPPOSITES_A = (("left_of", "right_of"), ("on", "under"))
OPPOSITES_B = (("left_of", "right_of"), ("in-front_of", "behind"))


def parse_controlled_name(image_path: str) -> tuple[str, str, str]:
    """(first object, preposition, second object) from `.../<obj1>_<prep>_<obj2>.jpeg`."""
    parts = Path(image_path).stem.split("_")
    if len(parts) < 3:
        return "", "", ""
    return parts[0], "_".join(parts[1:-1]), parts[-1]


def gold_beats_all(similarity: np.ndarray) -> dict[str, bool]:
    """`correct` (gold, option 0, strictly above all) and `tie` (gold equals the best other option)."""
    row = np.asarray(similarity)[0]
    return {"correct": beats_all(row, 0), "tie": bool(row[0] == np.max(row[1:]))}


def _accuracy_and_ties(outcomes: Sequence[Outcome]) -> dict[str, float]:
    return {"accuracy": percent([bool(o["correct"]) for o in outcomes]),
            "ties": float(sum(bool(o["tie"]) for o in outcomes)), "n": float(len(outcomes))}


def _per_preposition(outcomes: Sequence[Outcome]) -> dict[str, float]:
    groups: dict[str, list[bool]] = defaultdict(list)
    for outcome in outcomes:
        groups[str(outcome["preposition"])].append(bool(outcome["correct"]))
    return {f"prep/{prep}": percent(hits) for prep, hits in sorted(groups.items())}


WHATSUP_HOME = "https://github.com/amitakamath/whatsup_vlms"


def _whatsup_source(annotation: str, drive_id: str, images: str) -> DataSource:
    """A What'sUp set's files: the annotation the authors' loader downloads from Google Drive, and `images`
    (where the set's images come from and where they go)."""
    return DataSource(home=WHATSUP_HOME, licence="MIT (code and annotations); images: see by_hand",
                      size="annotation under 1 MB; images: see by_hand",
                      by_hand=f"gdown --id {drive_id} -O <root>/{annotation}; images: {images}")


# The image archives of the authors' loader (Google Drive ids), unzipped into the set's root.
CONTROLLED_A_IMAGES = "the authors' photos: gdown --id 19KGYVQjrV3syb00GgcavB2nZTW5NXX0H, unzip (controlled_images/)"
CONTROLLED_B_IMAGES = "the authors' photos: gdown --id 13jdBpg8t3NqW3jrL6FK8HO93vwsUjDxG, unzip (controlled_clevr/)"
COCO_SPATIAL_IMAGES = f"COCO val2017 (Flickr terms) into <root>/val2017: {COCO_VAL2017}"
GQA_SPATIAL_IMAGES = "Visual Genome (CC BY 4.0): gdown --id 1idW7Buoz7fQm4-670n-oERw9U-2JLJvE, unzip (vg_images/)"


class _WhatsUpSet(JsonListBenchmark):
    """One What'sUp JSON file; the first caption option of every record is gold.

    Args:
        root: the authors' data folder holding the JSON file.
        images: the image folder; default `<root>/<image_folder>`, the authors' layout.
    """

    image_folder: str = ""


class _WhatsUpControlled(_WhatsUpSet):
    """Controlled A or B (4 options, object pair and preposition read from the image file name)."""

    prepositions: tuple[str, ...] = ()
    headline = ("accuracy", "pair_accuracy", "set_accuracy")

    def _item(self, path: Path, index: int, record: object) -> Item:
        require(isinstance(record, dict) and isinstance(record.get("image_path"), str),
                f"{path}: record {index} lacks a string 'image_path'")
        options = record.get("caption_options")
        require(isinstance(options, list) and len(options) == 4 and all(isinstance(o, str) for o in options),
                f"{path}: record {index} 'caption_options' must be a list of 4 strings")
        first, preposition, second = parse_controlled_name(record["image_path"])
        require(preposition in self.prepositions,
                f"{path}: record {index} 'image_path' {record['image_path']!r} is not "
                f"<obj1>_<preposition>_<obj2> with a preposition in {self.prepositions}")
        name = Path(record["image_path"]).name
        texts = [required_text(option, f"{path}: record {index}", f"caption_options[{k}]")
                 for k, option in enumerate(options)]
        return Item(id=str(index), images=[ImageRef(str(self.images / name))], texts=texts,
                    meta={"object_pair": [first, second], "preposition": preposition, "image": name})

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        return {"id": item.id, "image": item.meta["image"], "object_pair": item.meta["object_pair"],
                "preposition": item.meta["preposition"], **gold_beats_all(similarity)}


def controlled_aggregate(outcomes: Sequence[Outcome], prepositions: tuple[str, ...],
                         opposites: tuple[tuple[str, str], ...]) -> dict[str, float]:
    """Accuracy, per-preposition accuracy, and pair / set accuracy keyed by object pair (module docstring)."""
    slots: dict[tuple[str, str], dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for outcome in outcomes:
        slots[tuple(outcome["object_pair"])][str(outcome["preposition"])].append(bool(outcome["correct"]))
    # A preposition slot is right only if it holds items and all of them are right (missing = wrong).
    right = {pair: {prep: bool(hits.get(prep)) and all(hits[prep]) for prep in prepositions}
             for pair, hits in slots.items()}
    pair_hits = [right[pair][a] and right[pair][b] for pair in right for a, b in opposites]
    set_hits = [all(by_prep.values()) for by_prep in right.values()]
    irregular = sum(Counter({p: len(h) for p, h in hits.items()}) != Counter(prepositions)
                    for hits in slots.values())
    return {**_accuracy_and_ties(outcomes), **_per_preposition(outcomes), "pair_accuracy": percent(pair_hits),
            "set_accuracy": percent(set_hits), "object_pairs": float(len(right)),
            "irregular_sets": float(irregular)}


class WhatsUpA(_WhatsUpControlled):
    name = "whatsup_a"
    description = "What'sUp Controlled A (on / under / left / right): 4-way accuracy, pair and set accuracy (%)"
    data_source = _whatsup_source("controlled_images_dataset.json", "1ap8mmmpQjLIjPGuplkpBgc1hoEHCj4hm",
                                  CONTROLLED_A_IMAGES)
    published = published({"accuracy": 30.58}, "vl_compo")
    annotation_file = "controlled_images_dataset.json"
    image_folder = "controlled_images"
    prepositions = PREPOSITIONS_A

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        return controlled_aggregate(outcomes, PREPOSITIONS_A, OPPOSITES_A)


class WhatsUpB(_WhatsUpControlled):
    name = "whatsup_b"
    description = "What'sUp Controlled B (left / right / front / behind): 4-way accuracy, pair and set accuracy (%)"
    data_source = _whatsup_source("controlled_clevr_dataset.json", "1unNNosLbdy9NDjgj4l8fsQP3WiAAGA6z",
                                  CONTROLLED_B_IMAGES)
    published = published({"accuracy": 30.88}, "vl_compo")
    annotation_file = "controlled_clevr_dataset.json"
    image_folder = "controlled_clevr"
    prepositions = PREPOSITIONS_B

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        return controlled_aggregate(outcomes, PREPOSITIONS_B, OPPOSITES_B)


def one_object_preposition(gold: str) -> str:
    """The reference's label for one-object captions: the last word ("A dog on the left" -> "left")."""
    return gold.split()[-1] if gold.split() else ""


def coco_two_object_preposition(gold: str) -> str:
    """The reference's label for COCO two-object captions (anything else is "below")."""
    for phrase, label in (("left of", "left"), ("right of", "right"), ("above", "above")):
        if phrase in gold:
            return label
    return "below"


def gqa_two_object_preposition(gold: str) -> str:
    """The reference's label for GQA two-object captions (anything else is "top")."""
    for phrase, label in (("left of", "left"), ("right of", "right"), ("front of", "front"), ("behind", "behind")):
        if phrase in gold:
            return label
    return "top"


class _WhatsUpSpatial(_WhatsUpSet):
    """COCO- or GQA-spatial (2 options; records `[image_id, gold, wrong]`)."""

    headline = ("accuracy",)

    @abstractmethod
    def image_name(self, image_id: object) -> str:
        """The image file name of an annotation's image id."""

    def valid_image_id(self, image_id: object) -> bool:
        """Whether `image_id` can name an image file (an int, or a non-empty string without a slash)."""
        return isinstance(image_id, int) or (isinstance(image_id, str) and bool(image_id) and "/" not in image_id)

    @abstractmethod
    def preposition(self, gold: str) -> str:
        """The per-preposition label of a gold caption."""

    def _item(self, path: Path, index: int, record: object) -> Item:
        require(isinstance(record, list) and len(record) == 3 and all(isinstance(t, str) for t in record[1:])
                and self.valid_image_id(record[0]),
                f"{path}: record {index} must be [image_id, gold_caption, wrong_caption], got {str(record)[:120]}")
        image_id, gold, wrong = (record[0], *(required_text(text, f"{path}: record {index}", field)
                                              for text, field in zip(record[1:], ("gold caption", "wrong caption"))))
        return Item(id=str(index), images=[ImageRef(str(self.images / self.image_name(image_id)))],
                    texts=[gold, wrong], meta={"image_id": image_id, "preposition": self.preposition(gold)})

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        return {"id": item.id, "image_id": item.meta["image_id"], "preposition": item.meta["preposition"],
                **gold_beats_all(similarity)}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        return {**_accuracy_and_ties(outcomes), **_per_preposition(outcomes)}


class _CocoSpatial(_WhatsUpSpatial):
    image_folder = "val2017"

    def image_name(self, image_id: object) -> str:
        return f"{int(image_id):012d}.jpg"

    def valid_image_id(self, image_id: object) -> bool:
        return isinstance(image_id, int) or (isinstance(image_id, str) and image_id.isdigit())


class _GqaSpatial(_WhatsUpSpatial):
    image_folder = "vg_images"
    vg_images_by_id = True  # GQA names its Visual Genome images by their VG ids

    def image_name(self, image_id: object) -> str:
        return f"{image_id}.jpg"


class WhatsUpCocoOne(_CocoSpatial):
    name = "whatsup_coco_one"
    description = "What'sUp COCO-spatial, one object: 2-way accuracy (%)"
    data_source = _whatsup_source("coco_qa_one_obj.json", "1RsMdpE9mmwnK4zzMPpC1-wTU_hNis-dq", COCO_SPATIAL_IMAGES)
    published = published({"accuracy": 43.26}, "vl_compo")
    annotation_file = "coco_qa_one_obj.json"

    def preposition(self, gold: str) -> str:
        return one_object_preposition(gold)


class WhatsUpCocoTwo(_CocoSpatial):
    name = "whatsup_coco_two"
    description = "What'sUp COCO-spatial, two objects: 2-way accuracy (%)"
    data_source = _whatsup_source("coco_qa_two_obj.json", "1TCEoM0mgFmz8T4cF7PQ3XJmO6JjtiQ-s", COCO_SPATIAL_IMAGES)
    published = published({"accuracy": 50.68}, "vl_compo")
    annotation_file = "coco_qa_two_obj.json"

    def preposition(self, gold: str) -> str:
        return coco_two_object_preposition(gold)


class WhatsUpGqaOne(_GqaSpatial):
    name = "whatsup_gqa_one"
    description = "What'sUp GQA-spatial, one object: 2-way accuracy (%)"
    data_source = _whatsup_source("vg_qa_one_obj.json", "1ARMRzRdohs9QTr1gpIfzyUzvW20wYp_p", GQA_SPATIAL_IMAGES)
    published = published({"accuracy": 46.29}, "vl_compo")
    annotation_file = "vg_qa_one_obj.json"

    def preposition(self, gold: str) -> str:
        return one_object_preposition(gold)


class WhatsUpGqaTwo(_GqaSpatial):
    name = "whatsup_gqa_two"
    description = "What'sUp GQA-spatial, two objects: 2-way accuracy (%)"
    data_source = _whatsup_source("vg_qa_two_obj.json", "1sjVG5O3QMY8s118k7kQM8zzDZH12i_95", GQA_SPATIAL_IMAGES)
    published = published({"accuracy": 47.08}, "vl_compo")
    annotation_file = "vg_qa_two_obj.json"

    def preposition(self, gold: str) -> str:
        return gqa_two_object_preposition(gold)


WHATSUP_BENCHMARKS = (WhatsUpA, WhatsUpB, WhatsUpCocoOne, WhatsUpCocoTwo, WhatsUpGqaOne, WhatsUpGqaTwo)

# Table 1 of the paper "reports macro-averages of subsets of each dataset: Controlled-A and Controlled-B, COCO/GQA
# one- and two-object" (whatsup_vlms README): What'sUp's individual, pair and set accuracy are means of A and B;
# COCO- and GQA-spatial accuracy are means of their one- and two-object sets. The per-set numbers are the
# paper's Table 3. `whatsup_six_sets` is the mean accuracy of the 6 sets, the "What'sUp" number of vl_compo's
# results (docs/evaluation.md#whatsup).
WHATSUP_COMBINED = (
    CombinedAggregate("whatsup_ab", "What'sUp (Table 1): mean of subsets A and B, individual / pair / set accuracy "
                      "(%)", ("whatsup_a", "whatsup_b"), ("accuracy", "pair_accuracy", "set_accuracy")),
    CombinedAggregate("whatsup_coco_spatial", "COCO-spatial (Table 1): mean accuracy of one- and two-object (%)",
                      ("whatsup_coco_one", "whatsup_coco_two"), ("accuracy",)),
    CombinedAggregate("whatsup_gqa_spatial", "GQA-spatial (Table 1): mean accuracy of one- and two-object (%)",
                      ("whatsup_gqa_one", "whatsup_gqa_two"), ("accuracy",)),
    CombinedAggregate("whatsup_six_sets", "What'sUp, all six sets: unweighted mean accuracy (%)",
                      tuple(cls.name for cls in WHATSUP_BENCHMARKS), ("accuracy",),
                      published({"accuracy": 41.46}, "vl_compo")),
)
