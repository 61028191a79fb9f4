"""VL-CheckList (Zhao et al., 2022): image-text contrast over Object, Attribute and Relation sub-types.

Official layout (`om-ai-lab/VL-CheckList`, the checkout is `root`): one YAML per (type, source) at
`corpus/v1/<Type>/<sub...>/<source>.yaml` with `ANNO_PATH` (relative to the checkout, e.g.
`data/Relation/vg/spatial.json`), `IMG_ROOT` (e.g. `vg/`, `hake/`, `swig/`) and `TYPE: TUPLE_JSON`. An annotation
file is a JSON list of `[relative_image_path, {"POS": [text, ...], "NEG": [text, ...]}]`; the image is
`IMG_ROOT/relative_image_path`. The official loader resolves a relative `IMG_ROOT` against the working directory
(the checkout); here it is resolved against the `images` option, which defaults to `root`.

Sampling follows `vl_checklist/evaluate.py` (ITC task): items whose image file is missing are dropped, then
the first `MAX_NUM / 2` = 1,000 of the rest are kept (`MAX_NUM` is 2000 in every shipped config), in file
order, with no shuffle. Which items are scored therefore depends on which images a lab has
(docs/evaluation.md#traps), so the aggregates report, per (type, source), how many items were skipped for a
missing image (`skipped_missing_image/...`) and how many had an image but fell beyond the cap (`beyond_cap/...`).

Scoring: an item is correct iff cos(image, POS[0]) > cos(image, NEG[0]), strictly (the official code also
counts a tie as incorrect). The official code compares entry [1] of a softmax over a *single* text, which the
shipped CLIP engine returns as 1.0 for every text, so every item ties (om-ai-lab/VL-CheckList#12); users
patch it to compare the raw scores, which is what is done here. Texts are stripped of leading and trailing
spaces (Object negatives such as " customers" carry a leading space): the CLIP tokenizer already ignores
them, but other scorers and the embedding cache would treat " customers" and "customers" as two texts.

Aggregation follows the authors' chart code (`vl_checklist/radar.py` over `vl_checklist/corpus.json`), which
groups the files of a sub-type by the dataset they come from: accuracy per (type, source); a dataset is the
mean of its sources (Object: `swig` = mean of swig_agent, swig_destination, swig_item, swig_tool; `vg` = mean
of vg_obj, vg_subj; `hake` alone); a sub-type is the mean of its datasets (so hake weighs 1/3 of an Object
sub-type, not 1/7). Every Attribute and Relation source is a dataset of one file (Attribute: vaw, vg;
Relation/action: hake, swig, vg; Relation/spatial: vg), so there the two levels coincide. The aggregates keep
all three levels: `<type>/<source>`, `dataset/<type>/<dataset>` and `<type>`. Above the sub-types, as in the
CLIP-compositionality papers (the chart stops at the 13 sub-types): `object` is the mean of the 6 sub-types
Location/{center, margin, mid} and Size/{large, medium, small}, `attribute` the mean of 5, `relation` the mean
of action and spatial; `average` is their mean. CE-CLIP (Table 2) averages Location and Size first:
`object_location_size`.

Every (type, source) of the taxonomy must be scored, as the chart code refuses to draw when a file has not been
evaluated: a source whose YAML or annotation file is absent, whose annotation list is empty, or none of whose
images exists is an error naming it. With `allow_partial=True` (`options.vl_checklist.allow_partial=true`) such
sources are left out with a warning, every mean is taken over what is present, and the aggregates say so:
`partial` is 1.0, `missing_sources` counts the absent sources and `missing/<type>/<source>` is 1.0 for each.
The aggregates are computed from the outcomes alone, so a source with no outcome is what counts as missing.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import yaml

from evaluation.benchmarks.annotations import DamagedBenchmarkData, read_json, read_text, require, required_text
from evaluation.benchmarks.base import ImageRef, Item, ItemBenchmark, MissingBenchmarkData, Outcome, percent
from evaluation.benchmarks.sources import DataSource, published

log = logging.getLogger(__name__)

CORPUS = "corpus/v1"
OBJECT_SOURCES = ("hake", "swig_agent", "swig_destination", "swig_item", "swig_tool", "vg_obj", "vg_subj")
LOCATIONS = tuple(f"Object/Location/{where}" for where in ("center", "margin", "mid"))
SIZES = tuple(f"Object/Size/{size}" for size in ("large", "medium", "small"))
ATTRIBUTES = tuple(f"Attribute/{kind}" for kind in ("action", "color", "material", "size", "state"))
RELATIONS = ("Relation/action", "Relation/spatial")
# The (type, sources) pairs of om-ai-lab's `configs/our_clip_{object,attribute,relation}.yaml`, plus
# Relation/spatial over vg (the CE-CLIP fork's `configs/our_clip_relation_spatial.yaml`; only vg has it).
TAXONOMY: dict[str, tuple[str, ...]] = {
    **{subtype: OBJECT_SOURCES for subtype in LOCATIONS + SIZES},
    **{subtype: ("vaw", "vg") for subtype in ATTRIBUTES},
    "Relation/action": ("hake", "swig", "vg"),
    "Relation/spatial": ("vg",),
}
CATEGORIES = {"object": LOCATIONS + SIZES, "attribute": ATTRIBUTES, "relation": RELATIONS}
MAX_ITEMS = 1000  # MAX_NUM / 2 with MAX_NUM = 2000, the ITC branch of vl_checklist/evaluate.py


def dataset_of(source: str) -> str:
    """The dataset a source belongs to in `vl_checklist/corpus.json`: swig_agent -> swig, vg_obj -> vg, hake -> hake.

    The corpus names each Object file `<dataset>_<role>` and every other source after its dataset alone, so the
    name before the first `_` is the dataset for every source of `TAXONOMY`.
    """
    return source.split("_", 1)[0]


@dataclass(frozen=True)
class Source:
    """One (type, source) YAML: where its annotations and its images are."""

    type: str
    name: str
    annotations: Path
    image_root: Path

    @property
    def key(self) -> str:
        return f"{self.type}/{self.name}"


class VLCheckList(ItemBenchmark):
    """VL-CheckList ITC accuracy.

    Args:
        root: the VL-CheckList checkout (holding `corpus/v1/` and the `data/` files the YAMLs name).
        images: the folder a relative `IMG_ROOT` (`vg/`, `hake/`, `swig/`) is resolved against; default `root`,
            as the official loader resolves it against the working directory. Absolute `IMG_ROOT`s are kept.
        max_items: items kept per (type, source), the first ones whose image exists (default 1000 =
            MAX_NUM / 2); None keeps all.
        allow_partial: score the sources that are present when some (type, source) has no YAML, no annotation
            file, no entries or no existing image (default False: that is an error naming each). The aggregates
            then carry `partial` = 1.0 and the missing sources.
    """

    name = "vl_checklist"
    headline = ("object", "attribute", "relation", "average", "object_location_size", "missing_sources")
    description = "VL-CheckList: ITC accuracy cos(img, POS) > cos(img, NEG), first 1,000 items with an image (%)"
    # Ten of the annotation files are too large for a plain file download from the repository's raw view to be
    # pinned here; a checkout at the commit is content-addressed by git itself.
    data_source = DataSource(
        home="https://github.com/om-ai-lab/VL-CheckList",
        licence="no licence file; the package declares 'free for non-commercial use'",
        size="corpus YAMLs and 61 annotation JSONs, 47 MB; images: Visual Genome, SWiG, HAKE (about 60 GB)",
        by_hand="git clone https://github.com/om-ai-lab/VL-CheckList <root> && git -C <root> checkout 6f8d6a3; "
                "images (vg/, swig/, hake/ under <root> or options.vl_checklist.images): DATASETS.md there")
    published = published({"average": 70.77}, "vl_compo")

    def __init__(self, root: str | Path, images: str | Path | None = None, max_items: int | None = MAX_ITEMS,
                 allow_partial: bool = False):
        if not isinstance(allow_partial, bool):
            raise TypeError(f"vl_checklist: allow_partial must be true or false, got {allow_partial!r}")
        self.allow_partial = allow_partial  # set first: the base constructor asks `required_files`
        super().__init__(root)
        if max_items is not None and max_items < 1:
            raise ValueError(f"vl_checklist: max_items must be positive or None, got {max_items}")
        self.images = Path(images) if images else self.root
        self.max_items = max_items
        self.missing: dict[str, str] = {}  # `<type>/<source>` -> why it cannot be scored
        self.sources = self._present_sources()
        self._require_every_source()

    def required_files(self) -> list[str]:
        if self.allow_partial:
            return [CORPUS]
        return [_yaml_path(subtype, name) for subtype, names in TAXONOMY.items() for name in names]

    def _present_sources(self) -> list[Source]:
        """Every (type, source) whose YAML and annotation file exist; the others are recorded in `missing`."""
        sources = []
        for subtype, names in TAXONOMY.items():
            for name in names:
                yaml_file = _yaml_path(subtype, name)
                if not (self.root / yaml_file).is_file():  # only with allow_partial: check_files requires them
                    self._leave_out(f"{subtype}/{name}", f"{yaml_file} is absent")
                    continue
                source = self._read_source(subtype, name)
                if source.annotations.is_file():
                    sources.append(source)
                else:
                    self._leave_out(source.key, f"annotation file {source.annotations} (named by {yaml_file}) "
                                                f"is missing")
        return sources

    def _leave_out(self, key: str, reason: str) -> None:
        self.missing[key] = reason
        if self.allow_partial:
            log.warning("vl_checklist: %s left out (%s); the aggregates are partial", key, reason)

    def _require_every_source(self) -> None:
        """Without allow_partial, one error naming every (type, source) that cannot be scored."""
        if self.missing and not self.allow_partial:
            listed = "; ".join(f"{key}: {why}" for key, why in self.missing.items())
            raise MissingBenchmarkData(f"{self.name}: {len(self.missing)} (type, source) of the taxonomy cannot "
                                       f"be scored: {listed}. {_PARTIAL_HINT}")

    def _read_source(self, subtype: str, name: str) -> Source:
        path = self.root / _yaml_path(subtype, name)
        config = _read_yaml(path)
        for key in ("ANNO_PATH", "IMG_ROOT", "TYPE"):
            require(isinstance(config, dict) and isinstance(config.get(key), str),
                    f"{path}: expected a string {key!r} (keys ANNO_PATH, IMG_ROOT, TYPE)")
        require(config["TYPE"] == "TUPLE_JSON", f"{path}: TYPE {config['TYPE']!r} is not supported (only TUPLE_JSON)")
        return Source(subtype, name, self.root / config["ANNO_PATH"], self.images / config["IMG_ROOT"])

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        files = ExistingFiles()
        items = [item for source in self.sources for item in self._source_items(source, files)]
        self._require_every_source()
        if not items:  # only reachable with allow_partial: every source was left out
            raise MissingBenchmarkData(f"{self.name}: no (type, source) under {self.root} can be scored: "
                                       + "; ".join(f"{key}: {why}" for key, why in self.missing.items()))
        return items

    def _source_items(self, source: Source, files: ExistingFiles) -> list[Item]:
        entries = _read_entries(source.annotations)
        if not entries:
            self._leave_out(source.key, f"{source.annotations} has no entries")
            return []
        paths = [str(source.image_root / entry[0]) for entry in entries]
        kept, missing, beyond = first_with_image(paths, files.exists, self.max_items)
        if not kept:
            self._leave_out(source.key, f"none of its {len(entries)} images exists under {source.image_root} "
                                        f"(e.g. {paths[0]}); point the `images` option at the folder holding "
                                        f"IMG_ROOT")
            return []
        meta = {"type": source.type, "source": source.name, "skipped_missing_image": missing, "beyond_cap": beyond}
        return [Item(id=f"{source.key}/{index}", images=[ImageRef(paths[index])],
                     texts=[entries[index][1]["POS"][0].strip(), entries[index][1]["NEG"][0].strip()], meta=meta)
                for index in kept]

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        positive, negative = float(similarity[0, 0]), float(similarity[0, 1])
        return {"id": item.id, "type": item.meta["type"], "source": item.meta["source"],
                "correct": positive > negative, "tie": positive == negative,
                "source_skipped_missing_image": item.meta["skipped_missing_image"],
                "source_beyond_cap": item.meta["beyond_cap"]}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        """Accuracy per source, dataset and sub-type, the category means, coverage and the sampling counts."""
        groups = _group_by_source(outcomes)
        result: dict[str, float] = {}
        for subtype, names in TAXONOMY.items():
            result.update(_subtype_accuracies(subtype, names, groups))
        result.update(_category_means(result))
        result.update(_coverage(groups))
        result.update(_sampling_counts(groups, outcomes))
        return result


def first_with_image(paths: Sequence[str], exists: Callable[[str], bool],
                     cap: int | None) -> tuple[list[int], int, int]:
    """The official sampling: indices of the first `cap` entries whose image exists, in file order.

    Returns:
        (kept indices, entries skipped for a missing image, entries with an image beyond the cap).
    """
    kept, missing, beyond = [], 0, 0
    for index, path in enumerate(paths):
        if not exists(path):
            missing += 1
        elif cap is None or len(kept) < cap:
            kept.append(index)
        else:
            beyond += 1
    return kept, missing, beyond


class ExistingFiles:
    """File existence from one directory listing per folder: VL-CheckList probes ~10^5 paths in a few folders."""

    def __init__(self) -> None:
        self._listings: dict[str, set[str]] = {}

    def exists(self, path: str) -> bool:
        folder, name = os.path.split(path)
        if folder not in self._listings:
            try:
                self._listings[folder] = {entry.name for entry in os.scandir(folder or ".") if entry.is_file()}
            except (FileNotFoundError, NotADirectoryError):
                self._listings[folder] = set()
        return name in self._listings[folder]


def _yaml_path(subtype: str, name: str) -> str:
    return f"{CORPUS}/{subtype}/{name}.yaml"


def _read_yaml(path: Path):
    """A source's YAML config; a file that is not YAML names itself and the line."""
    try:
        return yaml.safe_load(read_text(path))
    except yaml.YAMLError as error:
        raise DamagedBenchmarkData(f"{path}: not a YAML file ({' '.join(str(error).split())})") from None


def _read_entries(path: Path) -> list:
    """The entries of an annotation file; the scored texts (POS[0], NEG[0]) of every entry, scored or not
    (missing image, beyond the cap), must be non-empty."""
    entries = read_json(path)
    require(isinstance(entries, list), f"{path}: expected a JSON list of [image_path, {{POS, NEG}}] entries")
    for index, entry in enumerate(entries):
        require(_is_tuple_entry(entry), f"{path}: entry {index} is not [image_path, {{\"POS\": [str, ...], "
                                        f"\"NEG\": [str, ...]}}]: {str(entry)[:120]}")
        for side in ("POS", "NEG"):
            required_text(entry[1][side][0], f"{path}: entry {index}", f"{side}[0]")
    return entries


def _is_tuple_entry(entry: object) -> bool:
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], dict)):
        return False
    return all(isinstance(entry[1].get(side), list) and entry[1][side] and isinstance(entry[1][side][0], str)
               for side in ("POS", "NEG"))


def _group_by_source(outcomes: Sequence[Outcome]) -> dict[tuple[str, str], list[Outcome]]:
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in outcomes:
        pair = (str(outcome["type"]), str(outcome["source"]))
        if pair[1] not in TAXONOMY.get(pair[0], ()):
            raise ValueError(f"vl_checklist: outcome {outcome.get('id')!r} has unknown (type, source) {pair}")
        groups.setdefault(pair, []).append(outcome)
    return groups


def _subtype_accuracies(subtype: str, names: Sequence[str], groups: dict[tuple[str, str], list[Outcome]]
                        ) -> dict[str, float]:
    """`<type>/<source>`, `dataset/<type>/<dataset>` (mean of its sources) and `<type>` (mean of its datasets)."""
    sources = {name: percent([bool(o["correct"]) for o in groups[(subtype, name)]])
               for name in names if (subtype, name) in groups}
    by_dataset: dict[str, list[float]] = {}
    for name, accuracy in sources.items():
        by_dataset.setdefault(dataset_of(name), []).append(accuracy)
    datasets = {dataset: _mean_of_present(accuracies) for dataset, accuracies in by_dataset.items()}
    return {**{f"{subtype}/{name}": accuracy for name, accuracy in sources.items()},
            **{f"dataset/{subtype}/{dataset}": accuracy for dataset, accuracy in datasets.items()},
            subtype: _mean_of_present(datasets.values())}


def _category_means(subtypes: dict[str, float]) -> dict[str, float]:
    """Object / Attribute / Relation over their sub-types, their average, and CE-CLIP's Location-and-Size mean."""
    result = {"Object/Location": _mean_of_present(subtypes[t] for t in LOCATIONS),
              "Object/Size": _mean_of_present(subtypes[t] for t in SIZES)}
    for category, members in CATEGORIES.items():
        result[category] = _mean_of_present(subtypes[t] for t in members)
    result["average"] = _mean_of_present(result[c] for c in CATEGORIES)
    result["object_location_size"] = _mean_of_present([result["Object/Location"], result["Object/Size"]])
    return result


def _coverage(groups: dict[tuple[str, str], list[Outcome]]) -> dict[str, float]:
    """`partial` (1.0 when some (type, source) of the taxonomy has no outcome), their count and their names."""
    missing = [f"{t}/{s}" for t, names in TAXONOMY.items() for s in names if (t, s) not in groups]
    return {"partial": float(bool(missing)), "missing_sources": len(missing),
            **{f"missing/{key}": 1.0 for key in missing}}


def _sampling_counts(groups: dict[tuple[str, str], list[Outcome]], outcomes: Sequence[Outcome]) -> dict[str, int]:
    """Item, tie and sampling counts; every outcome of a source carries that source's counts."""
    counts = {"items": len(outcomes), "ties": sum(bool(o["tie"]) for o in outcomes)}
    for field in ("skipped_missing_image", "beyond_cap"):
        per_source = {f"{field}/{t}/{s}": int(rows[0][f"source_{field}"]) for (t, s), rows in groups.items()}
        counts[field] = sum(per_source.values())
        counts.update(per_source)
    return counts


def _mean_of_present(values: Iterable[float]) -> float:
    """Unweighted mean of the defined values; NaN when none is. An undefined part (a sub-type none of whose
    sources has outcomes) can only come from a partial run, which `partial` and `missing/...` announce."""
    present = [value for value in values if not math.isnan(value)]
    return float(np.mean(present)) if present else float("nan")


_PARTIAL_HINT = ("Every (type, source) of the taxonomy is needed for the published aggregates; "
                 "options.vl_checklist.allow_partial=true scores the sources that are present")
