"""SugarCrepe++ (Dumpala et al., NeurIPS 2024 Datasets and Benchmarks): an image, two positives, one hard negative.

Official files (`Sri-Harsha/scpp`, commit c083bbf, `data/`; `VLMs/data/` holds the same blobs, and the Hugging
Face dataset `Aman-J/SugarCrepe_pp` lists files of the same names and sizes under `data/`, bytes not compared):
five JSON lists, `<root>/data/<subset>.json` for the subsets
`swap_obj`, `swap_att`, `replace_obj`, `replace_att`, `replace_rel` (245 / 666 / 1,652 / 788 / 1,406 items, 4,757
in all, over 1,542 COCO val2017 images). Each record is `{"id", "filename", "caption", "caption2",
"negative_caption"}`: P1 = `caption`, P2 = `caption2` (a rewording of P1 with the same meaning), N =
`negative_caption`. P1 and N come from SugarCrepe, edited during validation: for 1,278 of the 4,757 items
(image, P1, N) is not a triple of SugarCrepe's files, so Image-P1-Neg below is not SugarCrepe's accuracy. Ids
are unique per file (0 .. n-1 in the release). Images are `<images>/<filename>`; the default `<root>/images` is
the authors' layout (`VLMs/download_coco_images.sh` unzips val2017 and moves its JPEGs into `images/` beside
`data/`). Every record is scored: the authors filter nothing.

Rule (`VLMs/test_Variants_CLIP.py`, which produced the paper's CLIP numbers, and the other `VLMs/test_*.py` alike;
cosines of L2-normalised embeddings, batch of one), each comparison strict:
- Image-P1-Neg (`image_p1_neg`): s(I, P1) > s(I, N);
- Image-P2-Neg (`image_p2_neg`): s(I, P2) > s(I, N);
- ITT, the image-text task the paper reports (`itt`): both of the above;
- TOT, the text-only task (`tot`): s(P1, P2) > s(P1, N) and s(P1, P2) > s(P2, N), text embeddings only
  (`scorer.text_similarity`); `evaluate_ulms.py` (`sugarcrepe_plus_plus_evaluation`) applies the same rule to
  sentence embedders.
Every accuracy is correct / total per file, the file being the unit the authors print; neither script averages
over subsets, so `<metric>_macro` (mean of the five subsets) and `<metric>_micro` (pooled over the 4,757 items)
are ours. A tie is wrong under `>`, and `ties` counts the items with any tied comparison (`ties_itt`,
`ties_tot` per task). Ties are not hypothetical here: two swap_obj records (ids 2 and 8) have a negative equal to
P1, so ITT and TOT are wrong for any model; replace_att id 14 has P2 equal to P1, and replace_rel id 369 differs
only by a double space, which CLIP's tokenizer removes.

A scorer without a text embedding (`text_similarity` raising NotImplementedError) still gets ITT and its parts;
its TOT fields are null, `tot_unscored` counts those items, and the TOT aggregates are NaN, with a logged warning.

Published numbers: the repository holds no result files and its README no table, so `published` stays empty
until the paper's own table (OpenAI CLIP ViT-B/32, ITT and TOT per subset) is transcribed.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Optional

import numpy as np

from evaluation.benchmarks.annotations import load_json_list, require, required_text
from evaluation.benchmarks.base import ImageRef, Item, ItemBenchmark, Outcome, Scorer, percent, unique
from evaluation.benchmarks.sources import DataSource, Download, published

log = logging.getLogger(__name__)

COMMIT = "c083bbf039a5ca215acaf25e7ee736d2ea6f3864"
# The column order of the authors' results table (`evaluate_ulms.summarize_results`).
SUBSETS = ("swap_obj", "swap_att", "replace_obj", "replace_att", "replace_rel")
METRICS = ("itt", "tot", "image_p1_neg", "image_p2_neg")
FIELDS = ("filename", "caption", "caption2", "negative_caption")
# sha256 and size of each file at COMMIT (`git show <commit>:data/<subset>.json`).
FILES = {
    "swap_obj": ("5f33cae824de431a7ecd3c5de6301f689815f9497aa36d96b154bbaf117b201b", 74611),
    "swap_att": ("450d0fd9fcad3e6f44950dc634e7f901ab1c6d9c60a569ade5ae8ffb3d203ad8", 198206),
    "replace_obj": ("5c6dc499ec8f511a8aa4ec1b7b5eb0eca90317488abe36ec39573355e2d361ab", 456601),
    "replace_att": ("6826413592894754eeca02aeebbcbbc8b95a7456998abcc714e71c033ce6fe87", 226275),
    "replace_rel": ("040fb95d3f0619bf515db60879e99709a87a5e9b4f524ec3403b127243480fd4", 392738),
}


def annotation_file(subset: str) -> str:
    """The path of a subset's file under root, as the authors publish it."""
    return f"data/{subset}.json"


def triplet_scores(image_text: np.ndarray, text_text: Optional[Sequence[float]]) -> Outcome:
    """The per-item comparisons from s(I, [P1, P2, N]) and, when the scorer has text embeddings,
    (s(P1, P2), s(P1, N), s(P2, N)); TOT fields are None without them."""
    p1, p2, negative = (float(value) for value in np.asarray(image_text, dtype=np.float64).reshape(3))
    scores: Outcome = {"itt": p1 > negative and p2 > negative, "image_p1_neg": p1 > negative,
                       "image_p2_neg": p2 > negative, "tie_itt": p1 == negative or p2 == negative,
                       "tot": None, "tie_tot": None}
    if text_text is not None:
        p1_p2, p1_negative, p2_negative = (float(value) for value in text_text)
        scores["tot"] = p1_p2 > p1_negative and p1_p2 > p2_negative
        scores["tie_tot"] = p1_p2 == p1_negative or p1_p2 == p2_negative
    scores["tie"] = bool(scores["tie_itt"] or scores["tie_tot"])
    return scores


class SugarCrepePP(ItemBenchmark):
    """SugarCrepe++: ITT, TOT and the two image comparisons per subset, from the five official JSON files.

    Args:
        root: the folder holding `data/<subset>.json` (the repository, its `VLMs/` folder, or the Hugging Face
            dataset).
        images: the COCO val2017 images; default `<root>/images` (the authors' layout).

    Aggregates (percent): `<metric>/<subset>` for metric in `itt`, `tot`, `image_p1_neg`, `image_p2_neg`;
    `<metric>_macro` (mean of the five subsets) and `<metric>_micro` (pooled items), both ours; `n/<subset>`,
    `n`, `ties`, `ties_itt`, `ties_tot` and `tot_unscored` (items without a text-only score).
    """

    name = "sugarcrepe_pp"
    headline = tuple(f"{metric}/{subset}" for metric in ("itt", "tot") for subset in SUBSETS)
    description = "SugarCrepe++: image-text (ITT) and text-only (TOT) 3-way accuracy per subset (%)"
    data_source = DataSource(
        home="https://github.com/Sri-Harsha/scpp",
        licence="MIT (repository LICENSE); the README licenses the dataset CC BY 4.0; images: COCO val2017 "
                "(Flickr terms of use)",
        size="5 JSON files, 1.3 MB (4,757 items); COCO val2017 images, 788 MB zip (1,542 of its 5,000 used)",
        downloads=tuple(Download(url=f"https://raw.githubusercontent.com/Sri-Harsha/scpp/{COMMIT}/data/{subset}.json",
                                 target=annotation_file(subset), sha256=sha256, size=size)
                        for subset, (sha256, size) in FILES.items()),
        by_hand="COCO val2017 images: download http://images.cocodataset.org/zips/val2017.zip (788 MB), unzip it "
                "and move the JPEGs of val2017/ into <root>/images/ (the authors' VLMs/download_coco_images.sh "
                "does exactly this), or point the `images` option at an existing val2017 folder.",
    )
    published = published({}, "sugarcrepe_pp")

    def __init__(self, root: str | Path, images: str | Path | None = None):
        super().__init__(root)
        self.images = Path(images) if images else self.root / "images"

    def required_files(self) -> list[str]:
        return [annotation_file(subset) for subset in SUBSETS]

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        return [item for subset in SUBSETS for item in self._subset_items(subset)]

    def _subset_items(self, subset: str) -> list[Item]:
        path = self.root / annotation_file(subset)
        items, seen = [], set()
        for index, record in enumerate(load_json_list(path)):
            where = f"{path}: record {index}"
            require(isinstance(record, dict), f"{where} is not a JSON object")
            require(isinstance(record.get("id"), int) and not isinstance(record["id"], bool),
                    f"{where} lacks an integer 'id'")
            for field in FIELDS:
                require(isinstance(record.get(field), str), f"{where} (id {record['id']}) lacks a string {field!r}")
            for field in FIELDS[1:]:  # the three texts
                required_text(record[field], f"{where} (id {record['id']})", field)
            require(record["id"] not in seen, f"{where}: id {record['id']} repeats")
            seen.add(record["id"])
            items.append(Item(id=f"{subset}/{record['id']}", images=[ImageRef(str(self.images / record["filename"]))],
                              texts=[record["caption"], record["caption2"], record["negative_caption"]],
                              meta={"subset": subset, "image": record["filename"]}))
        return items

    def outcomes(self, scorer: Scorer, progress: bool = False) -> list[Outcome]:
        items = self.checked_items()
        scorer.prepare(unique(ref for item in items for ref in item.images),
                       unique(text for item in items for text in item.texts), progress=progress)
        text_text = self.text_only_similarities(scorer, items)
        return [self.outcome(item, scorer.score(item.images, item.texts),
                             None if text_text is None else text_text[index])
                for index, item in enumerate(items)]

    def text_only_similarities(self, scorer: Scorer, items: Sequence[Item]) -> Optional[np.ndarray]:
        """[len(items), 3]: s(P1, P2), s(P1, N), s(P2, N) per item, in one call (equal texts then give
        bit-identical similarities, so a tie is exact); None for a scorer without text embeddings."""
        p1, p2, negative = ([item.texts[k] for item in items] for k in range(3))
        try:
            similarity = scorer.text_similarity(p1 + p1 + p2, p2 + negative + negative)
        except NotImplementedError as error:
            log.warning("%s: TOT (text-only) not scored for %d items: %s", self.name, len(items), error)
            return None
        return np.asarray(similarity, dtype=np.float64).reshape(3, len(items)).T

    def outcome(self, item: Item, similarity: np.ndarray, text_similarity: Optional[Sequence[float]] = None
                ) -> Outcome:
        """The item's comparisons from s(I, [P1, P2, N]) [1, 3] and (s(P1,P2), s(P1,N), s(P2,N)) if known."""
        return {"id": item.id, "subset": item.meta["subset"], "image": item.meta["image"],
                **triplet_scores(similarity, text_similarity)}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        result: dict[str, float] = {}
        for metric in METRICS:
            per_subset = {subset: _accuracy([o for o in outcomes if o["subset"] == subset], metric)
                          for subset in SUBSETS}
            result.update({f"{metric}/{subset}": value for subset, value in per_subset.items()})
            # NaN when a subset has no items: a mean over fewer subsets is not the benchmark's.
            result[f"{metric}_macro"] = float(np.mean(list(per_subset.values())))
            result[f"{metric}_micro"] = _accuracy(outcomes, metric)
        result.update({f"n/{subset}": float(sum(o["subset"] == subset for o in outcomes)) for subset in SUBSETS})
        result["n"] = float(len(outcomes))
        result["ties"] = float(sum(bool(o["tie"]) for o in outcomes))
        result["ties_itt"] = float(sum(bool(o["tie_itt"]) for o in outcomes))
        result["ties_tot"] = float(sum(bool(o["tie_tot"]) for o in outcomes))
        result["tot_unscored"] = float(sum(o["tot"] is None for o in outcomes))
        return result


def _accuracy(outcomes: Sequence[Outcome], metric: str) -> float:
    """Percent of the outcomes scored on `metric` that are right (TOT may be unscored: None)."""
    return percent([bool(o[metric]) for o in outcomes if o[metric] is not None])
