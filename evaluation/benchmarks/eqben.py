"""EqBen (Wang et al., ICCV 2023): 2 images x 2 captions whose images differ by a minimal visual change.

Official code: `Wangt-CN/EqBen`, commit ab6c79a: the loader `src/eqben/eqben_utils.py` (`EqBenALL`), the example
`example/eqben_eval_CLIP.py`, the score `src/eqben/eqben_acc.py` (`cal_wino_score`) and the scoring server's
script `evaluate_eqben_locally.py`. Seven sources, named by the first folder of every image path: `eqbenyoucook2`,
`eqbengebc`, `eqbenag`, `eqbenkubric_loc`, `eqbenkubric_cnt`, `eqbenkubric_attr`, `eqbensd` (45,849 / 1,814 /
195,872 / 3 x 2,000 / 1,513 items in the full set: `SUBSET_LENGTH_INFO` of that script).

Full set (default). The public annotation `ann_json_finegrained_random.json` is a JSON list of single
image-caption pairs `{"image": "<source>/...", "caption": ...}` in a shuffled order (`EqBenALL` reads `image` and
`caption`, and takes the source from the image path); a model scores every pair, in file order. The scoring server
un-shuffles with two files of the repository, `src_file/private_random_idx.json` (a permutation: entry j is
record `idx[j]` of the next file, since the server indexes the scores by `argsort(idx)`) and
`src_file/private_info.json` (per record `{"dataset", "name", "sample_cnt"}`, `name` one of `c0i0`, `c0i1`, `c1i0`,
`c1i1`: caption c with image i of item `sample_cnt`). The whole annotation the authors published later (README,
"the raw original annotation") is read as third-party loaders read it, the same pairs carrying that record inline
as `private_info` beside `image` and `caption` (its bytes could not be inspected when this loader was written);
either form is read. The four pairs of an item give its images and captions: image 0 is the image of `c0i0` and
`c1i0`, image 1 that of `c0i1` and `c1i1`, caption 0 the caption of `c0i0` and `c0i1`, caption 1 that of `c1i0` and
`c1i1` (an item whose pairs disagree is an error). Items are grouped per source by `dataset`; the server slices each
source's `sample_cnt` range out of one array, so a source's items must hold a contiguous `sample_cnt` range (checked).
The light release (README: PNGs converted to JPEG, "change the .png to .jpg" in the annotation) is read with
`png_as_jpg`.

10 % subset (`subset=True`): `eqben_subset_10percent_final.json` and its image folder (README, "Sub-Test Set": about
25K image-text pairs, "randomly sorted and not classified to each category", "format follows the winoground
style"), a JSON list of `{"image0", "image1", "caption0", "caption1"}`. Its per-source numbers are ours, by the
first folder of `image0` as third-party loaders of the file do; the authors report none on it.

Images (`EqBenALL.__getitem__` with the example's `process_img_pixel` / `process_img_npy`): `<images>/<path>`;
`eqbenyoucook2` frames are numpy arrays, read as `Image.fromarray(np.load(path)[:, :, [2, 1, 0]], "RGB")` (stored
BGR, converted to RGB: `parsers.images.read_npy_frame`), every other source with `Image.open(path).convert("RGB")`. A
youcook2 path must end in `.npy` and no other may, so that the image decoder, which goes by the suffix, takes the same
branch as the official loader, which goes by the source.

Rule (`cal_wino_score`, the same in `evaluate_eqben_locally.py`), with s[image i, caption j]:
- text:  s(c0, i0) > s(c1, i0) and s(c1, i1) > s(c0, i1);
- image: s(c0, i0) > s(c0, i1) and s(c1, i1) > s(c1, i0);
- group: text and image.
Strict, so a tie is wrong; `tie` marks an item with any tied comparison (`two_by_two.two_by_two_scores`). Each
score is correct / items of the source (`cal_score`).

Headline (`group_mean`): vl_compo's `eqben` (Oh et al., CVPRW 2024; `results.csv`), the unweighted mean of the group
score over five parts, the three Kubric sources averaged first: youcook2, gebc, ag, mean(kubric_loc, kubric_cnt,
kubric_attr), sd. Its OpenAI ViT-B/32 row (`individual_results.csv`) gives 26.49 from its per-source groups (a
test checks the arithmetic). In that row the youcook2 and ag scores are integer multiples of 1/5,000, where most
rows' are of 1/45,849 and 1/195,872: those two were scored on 5,000 items for this model (the fsc-clip paper caps
EqBen sources at 20,000 items), so a run on the full set will not reproduce them exactly.

Licence: Apache-2.0 (the repository); images from Action Genome (Charades), GEBC (Kinetics), YouCook2, Kubric
renders and Stable Diffusion generations. The annotations live off GitHub, and the repository's `src_file/` JSON
files are too large for the mirror the loader was written from, so no real sample is used: the tests run on the
stand-in (`testkit/standin/eqben.py`).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from evaluation.benchmarks.annotations import read_json, require, required_text
from evaluation.benchmarks.base import (GENERATED, OTHER, ImageOrigin, ImageRef, Item, MissingBenchmarkData, Outcome,
                                        percent)
from evaluation.benchmarks.sources import DataSource, published
from evaluation.benchmarks.two_by_two import SCORES, TwoByTwoBenchmark, overall_scores

log = logging.getLogger(__name__)

SOURCES = ("eqbenyoucook2", "eqbengebc", "eqbenag", "eqbenkubric_loc", "eqbenkubric_cnt", "eqbenkubric_attr",
           "eqbensd")
KUBRIC = ("eqbenkubric_loc", "eqbenkubric_cnt", "eqbenkubric_attr")
HEADLINE_PARTS = ("eqbenyoucook2", "eqbengebc", "eqbenag", "kubric", "eqbensd")  # vl_compo's five
GENERATED_SOURCES = (*KUBRIC, "eqbensd")  # rendered or generated for the benchmark: in no photo collection
NPY_SOURCE = "eqbenyoucook2"
# `SUBSET_LENGTH_INFO` of `evaluate_eqben_locally.py`: the full set's items per source.
OFFICIAL_COUNTS = {"eqbenag": 195872, "eqbenyoucook2": 45849, "eqbengebc": 1814, "eqbenkubric_loc": 2000,
                   "eqbenkubric_attr": 2000, "eqbenkubric_cnt": 2000, "eqbensd": 1513}
FULL_ANNOTATIONS = "ann_json_finegrained_random.json"
PRIVATE_INDEX = "src_file/private_random_idx.json"
PRIVATE_INFO = "src_file/private_info.json"
SUBSET_ANNOTATIONS = "eqben_subset_10percent_final.json"
# `name` of a pair -> (image, caption) of the item it belongs to
PAIRS = {"c0i0": (0, 0), "c0i1": (1, 0), "c1i0": (0, 1), "c1i1": (1, 1)}
COMMIT = "ab6c79a3c34656f6a882b4e49439febd6fe313f8"
BY_HAND = (
    "Full set: the annotation ann_json_finegrained_random.json (https://drive.google.com/file/d/"
    "1-CWEuZ5F0KQ4d94Y9rRtBsMIcqb8V7nm, 200 MB) into <root>, with src_file/private_random_idx.json and "
    f"src_file/private_info.json from https://raw.githubusercontent.com/Wangt-CN/EqBen/{COMMIT}/src_file/ into "
    "<root>/src_file/; or instead the "
    "whole original annotation (https://drive.google.com/file/d/1gNR4K2Cv4rbnjVRdHuBV6PuoJ5MlRXnZ) into <root>, "
    "named by the `annotations` option. Images: the full release (https://drive.google.com/file/d/"
    "1e608uhd36ak_v7SnlMVaYcekBc4gBqzn, tar.gz, about 100 GB) unpacked into <root>/image (one folder per source), "
    "or the light JPEG release (https://entuedu-my.sharepoint.com/:u:/g/personal/tan317_e_ntu_edu_sg/"
    "EcHBRcch6KREvzvGgrN67FMBUSVV4QPTQUiew0bxjcitFw, about 23 GB) with png_as_jpg=True; another folder via "
    "`images`. 10 % subset (subset=True): eqben_subset_10percent_final.json (https://drive.google.com/file/d/"
    "18BSRf1SnBtGiEc42mzRLirXaBLzYE5Tt) into <root> and its images (https://drive.google.com/file/d/"
    "13Iuirsvx34-9F_1Mjhs4Dqn59yokyUjy, tar.gz, about 10 GB) unpacked into <root>/image_subset. None of these "
    "files is pinned by hash: their bytes could not be checked when this loader was written.")
VL_COMPO = {  # ytaek-oh/vl_compo individual_results.csv, ViT-B-32 / openai, rounded to 2 decimals
    "eqbenyoucook2": (49.12, 52.68, 37.34), "eqbengebc": (11.69, 20.56, 4.52), "eqbenag": (14.70, 8.70, 3.04),
    "eqbenkubric_loc": (6.35, 5.20, 1.00), "eqbenkubric_cnt": (20.10, 16.15, 6.10),
    "eqbenkubric_attr": (39.85, 40.65, 22.20), "eqbensd": (89.16, 85.39, 77.79)}


def read_list(path: Path) -> list:
    records = read_json(path)
    require(isinstance(records, list), f"{path}: expected a JSON list, found {type(records).__name__}")
    return records


def source_of(image: str, where: str) -> str:
    """The source an image path names by its first folder (how `EqBenALL` tells YouCook2 frames apart)."""
    source = image.split("/")[0]
    require(source in SOURCES, f"{where}: image {image!r} is not under a known source ({', '.join(SOURCES)})")
    return source


def _mean_or_nan(values: Sequence[float]) -> float:
    """The unweighted mean; NaN when a part is (a source without items is not 0 %)."""
    return float(np.mean(values)) if not any(np.isnan(v) for v in values) else float("nan")


def five_part_mean(per_source: Mapping[str, float]) -> float:
    """vl_compo's EqBen mean from one score per source: youcook2, gebc, ag, the mean of the three Kubric
    sources, and sd, with equal weight."""
    kubric = _mean_or_nan([per_source[source] for source in KUBRIC])
    return _mean_or_nan([kubric if part == "kubric" else per_source[part] for part in HEADLINE_PARTS])


class EqBen(TwoByTwoBenchmark):
    """EqBen: Winoground-style text / image / group scores per source, from the official annotation files.

    Args:
        root: the folder holding the annotation (and `src_file/` for the full set's shuffled annotation).
        subset: read the official 10 % subset instead of the full set.
        annotations: the annotation file under root; default `ann_json_finegrained_random.json` (full set) or
            `eqben_subset_10percent_final.json` (subset). The whole original annotation, whose pairs carry
            `private_info`, is read from any name given here.
        images: the image folder (one folder per source); default `<root>/image` (full) or `<root>/image_subset`.
        png_as_jpg: read `.png` paths as `.jpg` (the light release, whose PNGs were converted to JPEG).

    Aggregates (percent): `<source>/text`, `<source>/image`, `<source>/group` and `<source>/n` per source;
    `kubric/<score>` (mean of the three Kubric sources); `<score>_mean` (mean over youcook2, gebc, ag, kubric, sd;
    `group_mean` is vl_compo's `eqben`; NaN unless all five have items); `text`, `image`, `group` over all items;
    `ties`, `n`.
    """

    name = "eqben"
    headline = ("group_mean", *(f"{part}/group" for part in HEADLINE_PARTS))
    description = "EqBen: group score per source and vl_compo's mean over five parts (%)"
    outcome_fields = ("source",)
    data_source = DataSource(
        home="https://github.com/Wangt-CN/EqBen",
        licence="Apache-2.0 (repository); images from Action Genome / Charades, GEBC / Kinetics, YouCook2, Kubric "
                "renders and Stable Diffusion generations",
        size="full set: 251,048 items, annotation about 200 MB, images about 100 GB (PNG) or 23 GB (JPEG); 10 % "
             "subset: about 25K pairs, images about 10 GB",
        by_hand=BY_HAND)
    published = published({**{f"{source}/{score}": value for source, values in VL_COMPO.items()
                               for score, value in zip(SCORES, values)}, "group_mean": 26.49}, "vl_compo")

    def __init__(self, root: str | Path, subset: bool = False, annotations: str | None = None,
                 images: str | Path | None = None, png_as_jpg: bool = False):
        self.subset = subset
        self.annotations = annotations or (SUBSET_ANNOTATIONS if subset else FULL_ANNOTATIONS)
        super().__init__(root)
        self.images = Path(images) if images else self.root / ("image_subset" if subset else "image")
        self.png_as_jpg = png_as_jpg

    def required_files(self) -> list[str]:
        return [self.annotations]

    # ---------------------------------------------------------------- reading

    def read_items(self) -> list[Item]:
        path = self.root / self.annotations
        return self._subset_items(path) if self.subset else self._full_items(path)

    def _subset_items(self, path: Path) -> list[Item]:
        items = []
        for index, record in enumerate(read_list(path)):
            where = f"{path}: record {index}"
            require(isinstance(record, dict) and all(isinstance(record.get(key), str) for key in
                                                     ("image0", "image1", "caption0", "caption1")),
                    f"{where} lacks one of image0, image1, caption0, caption1 (strings)")
            source = source_of(record["image0"], where)
            items.append(self._item(f"{source}/{index}", source, (record["image0"], record["image1"]),
                                    (record["caption0"], record["caption1"]), where))
        return items

    def _full_items(self, path: Path) -> list[Item]:
        entries = read_list(path)
        infos = self._pair_infos(path, entries)
        groups: dict[int, dict[str, tuple[str, str]]] = defaultdict(dict)
        sources: dict[int, str] = {}
        for index, (entry, info) in enumerate(zip(entries, infos)):
            where = f"{path}: pair {index}"
            require(isinstance(entry, dict) and isinstance(entry.get("image"), str)
                    and isinstance(entry.get("caption"), str), f"{where} lacks image or caption (strings)")
            required_text(entry["caption"], where)
            count = self._check_info(info, where)
            require(sources.setdefault(count, info["dataset"]) == info["dataset"],
                    f"{where}: item {count} has pairs in {sources[count]} and {info['dataset']}")
            require(info["name"] not in groups[count], f"{where}: item {count} has two {info['name']} pairs")
            groups[count][info["name"]] = (entry["image"], entry["caption"])
        self._check_ranges(path, sources)
        items = [self._full_item(path, count, sources[count], groups[count]) for count in sorted(groups)]
        self._compare_counts(path, items)
        return items

    def _pair_infos(self, path: Path, entries: list) -> list:
        """Each pair's `{"dataset", "name", "sample_cnt"}`: inline (`private_info`), or from the key files."""
        inline = [isinstance(entry, dict) and "private_info" in entry for entry in entries]
        if all(inline):
            return [entry["private_info"] for entry in entries]
        require(not any(inline), f"{path}: some pairs carry private_info and some do not")
        missing = [name for name in (PRIVATE_INDEX, PRIVATE_INFO) if not (self.root / name).is_file()]
        if missing:
            raise MissingBenchmarkData(f"{self.name}: {path} is the shuffled annotation, whose pairs are identified "
                                       f"by {PRIVATE_INDEX} and {PRIVATE_INFO}; {self.root} lacks {', '.join(missing)}")
        index, info = read_list(self.root / PRIVATE_INDEX), read_list(self.root / PRIVATE_INFO)
        require(len(index) == len(entries) == len(info),
                f"{path}: {len(entries)} pairs, but {PRIVATE_INDEX} has {len(index)} and {PRIVATE_INFO} {len(info)}")
        require(all(isinstance(k, int) and not isinstance(k, bool) for k in index)
                and sorted(index) == list(range(len(index))), f"{self.root / PRIVATE_INDEX}: not a permutation")
        # The server reorders the scores by argsort(index): record k of the info is pair argsort(index)[k], so
        # pair j is record index[j].
        return [info[k] for k in index]

    @staticmethod
    def _check_info(info, where: str) -> int:
        require(isinstance(info, dict) and info.get("dataset") in SOURCES and info.get("name") in PAIRS
                and isinstance(info.get("sample_cnt"), int) and not isinstance(info.get("sample_cnt"), bool),
                f"{where}: private info {info!r} is not {{dataset: a source, name: c<j>i<i>, sample_cnt: int}}")
        return info["sample_cnt"]

    @staticmethod
    def _check_ranges(path: Path, sources: dict[int, str]) -> None:
        """Each source's items hold one contiguous `sample_cnt` range (the server slices it out of one array)."""
        counts: dict[str, list[int]] = defaultdict(list)
        for count, source in sources.items():
            counts[source].append(count)
        for source, values in counts.items():
            require(max(values) - min(values) + 1 == len(values),
                    f"{path}: the items of {source} do not hold a contiguous sample_cnt range")

    def _full_item(self, path: Path, count: int, source: str, pairs: dict[str, tuple[str, str]]) -> Item:
        where = f"{path}: item {count} ({source})"
        require(set(pairs) == set(PAIRS), f"{where} has pairs {sorted(pairs)}, not {sorted(PAIRS)}")
        images, captions = [None, None], [None, None]
        for name, (image_index, caption_index) in PAIRS.items():
            image, caption = pairs[name]
            require(images[image_index] in (None, image), f"{where}: the pairs disagree on image {image_index}")
            require(captions[caption_index] in (None, caption), f"{where}: the pairs disagree on caption "
                                                                f"{caption_index}")
            images[image_index], captions[caption_index] = image, caption
        return self._item(f"{source}/{count}", source, tuple(images), tuple(captions), where)

    def _item(self, item_id: str, source: str, images: tuple[str, str], captions: tuple[str, str],
              where: str) -> Item:
        for image in images:
            require(image.endswith(".npy") == (source == NPY_SOURCE),
                    f"{where}: {image!r}: {NPY_SOURCE} frames are .npy files and no other image is")
        texts = [required_text(caption, where, f"caption{k}") for k, caption in enumerate(captions)]
        return Item(id=item_id, images=[ImageRef(self._image_path(image)) for image in images], texts=texts,
                    meta={"source": source})

    def _image_path(self, image: str) -> str:
        if self.png_as_jpg and image.endswith(".png"):
            image = image[:-len(".png")] + ".jpg"
        return str(self.images / image)

    def _compare_counts(self, path: Path, items: list[Item]) -> None:
        counts = {source: 0 for source in SOURCES}
        for item in items:
            counts[item.meta["source"]] += 1
        differ = {source: count for source, count in counts.items() if count != OFFICIAL_COUNTS[source]}
        if differ:
            log.warning("%s: items per source %s differ from the official full set's %s", path, differ,
                        {source: OFFICIAL_COUNTS[source] for source in differ})

    # ---------------------------------------------------------------- images and aggregates

    @cached_property
    def _origins(self) -> dict[str, str]:
        return {ref.path: item.meta["source"] for item in self.items() for ref in item.images}

    def image_origin(self, ref: ImageRef) -> ImageOrigin:
        # Frames of videos (AG, GEBC, YouCook2) and renders: none is a COCO or Visual Genome image.
        return ImageOrigin(GENERATED if self._origins.get(ref.path) in GENERATED_SOURCES else OTHER)

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        result = overall_scores(outcomes, {score: score for score in SCORES})
        by_source: dict[str, list[Outcome]] = {source: [] for source in SOURCES}
        for outcome in outcomes:
            by_source[str(outcome["source"])].append(outcome)
        for source, members in by_source.items():
            for score in SCORES:
                result[f"{source}/{score}"] = percent([bool(o[score]) for o in members])
            result[f"{source}/n"] = float(len(members))
        for score in SCORES:
            per_source = {source: result[f"{source}/{score}"] for source in SOURCES}
            result[f"kubric/{score}"] = _mean_or_nan([per_source[source] for source in KUBRIC])
            result[f"{score}_mean"] = five_part_mean(per_source)
        return result


EQBEN_BENCHMARKS = (EqBen,)
