"""`python -m datamodules.preprocess --config FILE [--shard i/n] [key=value ...]`: parse and ground, offline.

Every caption of the configured train/val annotation files is parsed into a scene graph (spaCy), and every
grounding phrase is grounded in its image (GroundingDINO, ground-truth boxes, or nothing). Results go to a
sharded cache (datamodules/cache.py) keyed by the annotation file's content, the parser settings (with the
spaCy and model versions) and the grounder settings; the DataModule reads it and never parses or grounds at
training time, and finds it from the settings stored with it, so training needs no spaCy
(`find_cache_directory`).

Rerunning skips finished shards, so an interrupted job resumes; `--shard i/n` processes the shards whose
index is i modulo n, so a SLURM array (or one process per GPU) splits the work without coordination.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

from tqdm import tqdm

from core.cli import add_key_values
from datamodules.annotations import CaptionRecord, existing_path, image_path_candidates, read_annotation_file
from datamodules.cache import (COUNT_KEYS, CacheError, ShardedCache, add_shard_argument, cache_key, file_sha256,
                              fill_shards, keyed_caches, open_cache, resolve_device, shard_count)
from datamodules.inputs import InputError, check_preprocess_inputs
from parsers.grounding_inputs import GrounderInputError
from parsers.scene_graph import Phrase, SceneGraph, SceneGraphParser

if TYPE_CHECKING:
    from parsers.grounding import GroundingRequest

log = logging.getLogger("datamodules.preprocess")

SPLITS = ("train", "val")
# Images per grounder call for grounders without a batch size: how often the progress bar moves.
GROUNDING_CHUNK = 64
# The parser settings that are the installed spaCy's and model's versions (`SceneGraphParser.settings()`).
PARSER_VERSIONS = ("model_version", "spacy_version")


@dataclass
class SplitSource:
    """Where one split's captions and images are."""

    split: str
    annotations: Path
    images: Path
    karpathy_splits: Tuple[str, ...]
    scene_graphs: Optional[Path] = None
    # The caption key of a COCO-style JSON (`data.caption_field`): the masks must describe the captions trained on.
    caption_field: str = "caption"

    def records(self) -> List[CaptionRecord]:
        return read_annotation_file(str(self.annotations), self.karpathy_splits, self.caption_field)


def split_sources(data, prep) -> List[SplitSource]:
    """The configured splits that have an annotation file (`data` and `preprocess` config sections)."""
    root = Path(data.root)
    sources = []
    for split in SPLITS:
        annotations = data[f"{split}_annotations"]
        if not annotations:
            continue
        scene_graphs = prep[f"{split}_scene_graphs"]
        sources.append(SplitSource(split, root / annotations, root / data[f"{split}_images"],
                                   tuple(data[f"{split}_karpathy_splits"]),
                                   root / scene_graphs if scene_graphs else None, data.caption_field))
    return sources


def mask_records(data, prep, split: str) -> Dict[int, dict]:
    """The finished cache of one split, by caption id (what the DataModule reads with data.masks=true)."""
    source = next(s for s in split_sources(data, prep) if s.split == split)
    cache = open_cache(find_cache_directory(prep.cache_root, source, build_parser(prep), make_grounder(data, prep)))
    return {record["caption_id"]: record for record in cache.read_all()}


def build_parser(prep) -> SceneGraphParser:
    return SceneGraphParser(model=prep.parser_model, batch_size=prep.parser_batch_size)


def grounder_options(data, prep) -> Tuple[str, dict]:
    """The grounder's registry name and constructor options from the `preprocess` config section."""
    if prep.grounder == "groundingdino":
        return "groundingdino", dict(
            config_file=prep.groundingdino_config, checkpoint=prep.groundingdino_checkpoint,
            text_encoder=prep.text_encoder, box_threshold=prep.box_threshold,
            text_threshold=prep.text_threshold, image_size=prep.grounding_image_size,
            batch_size=prep.grounding_batch_size, device=resolve_device(prep.device),
            allow_random_weights=prep.allow_random_detector, prompt=prep.grounding_prompt)
    if prep.grounder == "annotations":
        instances = str(Path(data.root) / prep.instances) if prep.instances else None
        return "annotations", dict(instances_json=instances)
    return "none", {}


def make_grounder(data, prep):
    # parsers.grounding imports torch (seconds): imported once the inputs are checked, so a bad start is quick.
    from parsers.grounding import build_grounder

    name, options = grounder_options(data, prep)
    return build_grounder(name, **options)


def cache_settings(source: SplitSource, parser_settings: dict, grounder) -> dict:
    """Everything that changes the cached records of one split (the cache key hashes this), with the parser's
    `SceneGraphParser.settings()` (or, to find a cache, its `rule_settings()`)."""
    settings = {"annotations_sha256": file_sha256(source.annotations), "parser": parser_settings,
                "grounder": grounder.settings()}
    if source.annotations.suffix == ".json":
        settings["karpathy_splits"] = list(source.karpathy_splits)
    if source.caption_field != "caption":  # keyed only when set, so existing caches stay valid
        settings["caption_field"] = source.caption_field
    if source.scene_graphs is not None:
        settings["scene_graphs_sha256"] = file_sha256(source.scene_graphs)
    return settings


def cache_directory(cache_root: str, settings: dict) -> Path:
    return Path(cache_root) / cache_key(settings)


def find_cache_directory(cache_root: str, source: SplitSource, parser: SceneGraphParser, grounder) -> Path:
    """The cache of `source` under these parser and grounder settings, found without importing spaCy.

    The key hashes the spaCy and model versions the job parsed with; a reader (fit, evaluation, the study) need
    not have spaCy at all. It reads the key back: the caches whose stored settings equal this config's except
    for those versions. Of several (parsed under different spaCy installs) it takes the one of the installed
    versions. A cache made under other versions is used when it is the only one: its records are what was parsed.
    """
    wanted = normalised(cache_settings(source, parser.rule_settings(), grounder))
    found = [(directory, stored) for directory, stored in keyed_caches(cache_root)
             if without_parser_versions(stored) == wanted]
    installed = parser.installed_versions()
    exact = [directory for directory, stored in found
             if installed and all(stored["parser"].get(key) == value for key, value in installed.items())]
    if exact:
        return exact[0]  # one at most: equal settings, equal key
    if len(found) == 1:
        directory, stored = found[0]
        log.info("%s: preprocessing cache %s, parsed with spaCy %s (model %s); installed here: %s", source.split,
                 directory, stored["parser"].get("spacy_version"), stored["parser"].get("model_version"),
                 installed or "no spaCy")
        return directory
    if not found:
        raise CacheError(f"no preprocessing cache of {source.annotations} under {cache_root} for this config's "
                         f"parser and grounder settings: run python -m datamodules.preprocess --config <the same "
                         f"config files and overrides>")
    made_with = ", ".join(f"{d.name} (spaCy {s['parser'].get('spacy_version')}, model "
                          f"{s['parser'].get('model_version')})" for d, s in found)
    raise CacheError(f"{len(found)} preprocessing caches of {source.annotations} under {cache_root} fit this config, "
                     f"parsed under other spaCy installs than this one ({installed or 'no spaCy'}): {made_with}; "
                     f"remove all but one")


def without_parser_versions(settings: dict) -> dict:
    """Stored cache settings without the spaCy and model versions of the job that parsed."""
    parser = {key: value for key, value in settings["parser"].items() if key not in PARSER_VERSIONS}
    return {**settings, "parser": parser}


def normalised(settings: dict) -> dict:
    """`settings` as settings.json stores it (tuples as lists, other values as the key hashes them)."""
    return json.loads(json.dumps(settings, default=str))


# ----- one shard --------------------------------------------------------------------------------------
def gt_phrases_by_caption(scene_graphs: Optional[Path]) -> Dict[int, List[dict]]:
    """Ground-truth phrases (text + boxes) per caption id, from a shapes-world scene-graph file."""
    if scene_graphs is None:
        return {}
    document = json.loads(Path(scene_graphs).read_text())
    return {caption["caption_id"]: caption["phrases"] for image in document["images"]
            for caption in image["captions"]}


RequestKey = Tuple[int, Optional[int]]


def request_key(record: CaptionRecord, gt_phrases: Dict[int, List[dict]]) -> RequestKey:
    """(image id, caption id) for a caption with ground-truth phrases, which has a request of its own:
    its phrases are matched to them by character position, and positions hold within one caption only.
    (image id, None) for the other captions, which share their image's request."""
    return record.image_id, (record.caption_id if gt_phrases.get(record.caption_id) else None)


def phrase_mentions(graph: SceneGraph, phrase: Phrase) -> List[Tuple[int, int]]:
    """Character spans of the head nouns of the objects a phrase names (one, or a relation's two)."""
    return [(graph.entities[e].head.start, graph.entities[e].head.end) for e in phrase.entities]


def image_requests(records: Sequence[CaptionRecord], graphs: Sequence[SceneGraph], images: Path,
                   gt_phrases: Dict[int, List[dict]]) -> List[GroundingRequest]:
    """One request per image, with the unique phrases of its captions (each image is read once), except
    that a caption with ground-truth phrases gets its own, with every phrase and the objects it names."""
    from parsers.grounding import GroundingRequest

    requests: Dict[RequestKey, GroundingRequest] = {}
    for record, graph in zip(records, graphs):
        key = request_key(record, gt_phrases)
        if key[1] is not None:
            requests[key] = GroundingRequest(
                image_path=_image_path(images, record.file_name), phrases=[p.text for p in graph.phrases],
                image_id=record.image_id, caption_id=record.caption_id, gt_phrases=gt_phrases[record.caption_id],
                phrase_mentions=[phrase_mentions(graph, p) for p in graph.phrases],
                annotated_size=record.annotated_size)
            continue
        shared = requests.setdefault(key, GroundingRequest(_image_path(images, record.file_name), [], record.image_id,
                                                           annotated_size=record.annotated_size))
        shared.phrases.extend(p.text for p in graph.phrases if p.text not in shared.phrases)
    return list(requests.values())


def caption_rows(records: Sequence[CaptionRecord], graphs: Sequence[SceneGraph], requests: Sequence[GroundingRequest],
                 boxes: Sequence[list], gt_phrases: Dict[int, List[dict]]) -> List[dict]:
    """The cache record of every caption, with the boxes its request got for each of its phrases."""
    by_key = {}
    for request, per_phrase in zip(requests, boxes):
        caption = request.caption_id if request.phrase_mentions is not None else None
        by_key[(request.image_id, caption)] = (request, per_phrase)
    rows = []
    for record, graph in zip(records, graphs):
        request, per_phrase = by_key[request_key(record, gt_phrases)]
        if request.phrase_mentions is not None:   # the caption's own request: its phrases, in order
            phrase_boxes = list(per_phrase)
        else:
            boxes_of = dict(zip(request.phrases, per_phrase))
            phrase_boxes = [boxes_of.get(p.text, []) for p in graph.phrases]
        rows.append(caption_record(record, graph, phrase_boxes))
    return rows


def _image_path(images: Path, file_name: str) -> str:
    candidates = image_path_candidates(str(images), file_name)
    return existing_path(candidates) or candidates[0]


def caption_record(record: CaptionRecord, graph: SceneGraph, phrase_boxes: Sequence[list]) -> dict:
    """What the DataModule needs of one caption: spans for token masks, phrases with boxes (one list of
    boxes per phrase of the graph, in order)."""
    return {
        "caption_id": record.caption_id, "image_id": record.image_id, "caption": record.caption,
        "obj_spans": [[s.start, s.end] for s in graph.object_spans()],
        "comp_spans": [[s.start, s.end] for s in graph.composition_spans()],
        "phrases": [{"text": p.text, "kind": p.kind, "boxes": [list(b) for b in boxes]}
                    for p, boxes in zip(graph.phrases, phrase_boxes)],
        "graph": graph.to_dict(),
    }


def shard_counts(rows: List[dict], unreadable_images: int) -> Dict[str, int]:
    phrases = [p for row in rows for p in row["phrases"]]
    grounded = sum(1 for p in phrases if p["boxes"])
    counts = {"captions": len(rows), "parsed": sum(1 for row in rows if row["graph"]["entities"]),
              "no_object": sum(1 for row in rows if not row["obj_spans"]),
              "no_composition": sum(1 for row in rows if not row["comp_spans"]),
              "phrases": len(phrases), "grounded": grounded, "phrases_without_boxes": len(phrases) - grounded,
              "unreadable_images": unreadable_images}
    assert set(counts) == set(COUNT_KEYS)
    return counts


@dataclass
class SplitProgress:
    """A split's two progress bars: captions parsed and images grounded (a shard takes minutes)."""

    captions: Optional[tqdm] = None
    images: Optional[tqdm] = None


@contextmanager
def split_progress(split: str, chunks: Sequence[Sequence[CaptionRecord]]) -> Iterator[SplitProgress]:
    """The bars of the shards `chunks`: their captions, and their images (counted per shard, as grounded)."""
    images = sum(len({record.image_id for record in chunk}) for chunk in chunks)
    with tqdm(total=sum(map(len, chunks)), unit="caption", desc=f"parse {split}", mininterval=2.0) as captions:
        with tqdm(total=images, unit="image", desc=f"ground {split}", mininterval=2.0) as grounded:
            yield SplitProgress(captions, grounded)


def _advance(bar: Optional[tqdm], count: int) -> None:
    if bar is not None:
        bar.update(count)


def parse_captions(parser: SceneGraphParser, captions: Sequence[str], bar: Optional[tqdm] = None) -> List[SceneGraph]:
    """`parser.parse` one parser batch at a time (the same batches it makes itself), advancing `bar`."""
    graphs: List[SceneGraph] = []
    for start in range(0, len(captions), parser.batch_size):
        batch = list(captions[start:start + parser.batch_size])
        graphs.extend(parser.parse(batch))
        _advance(bar, len(batch))
    return graphs


def ground_requests(grounder, requests: Sequence[GroundingRequest], bar: Optional[tqdm] = None) -> list:
    """`grounder.ground` in chunks of its own batch size, so the images of each forward pass are unchanged."""
    step = getattr(grounder, "batch_size", None) or GROUNDING_CHUNK
    boxes: list = []
    for start in range(0, len(requests), step):
        chunk = requests[start:start + step]
        boxes.extend(grounder.ground(chunk))  # every grounder decodes each image and records the unreadable ones
        _advance(bar, _images_finished(requests, start, start + len(chunk)))
    return boxes


def _images_finished(requests: Sequence[GroundingRequest], start: int, stop: int) -> int:
    """Images whose last request is among requests[start:stop]: an image's requests are consecutive, and a
    caption with ground-truth phrases has one of its own (see `image_requests`)."""
    last = len(requests) - 1
    return sum(1 for j in range(start, stop) if j == last or requests[j + 1].image_id != requests[j].image_id)


def process_shard(records: Sequence[CaptionRecord], parser: SceneGraphParser, grounder, source: SplitSource,
                  gt_phrases: Dict[int, List[dict]], progress: Optional[SplitProgress] = None
                  ) -> Tuple[List[dict], Dict[str, int]]:
    progress = progress or SplitProgress()
    graphs = parse_captions(parser, [record.caption for record in records], progress.captions)
    requests = image_requests(records, graphs, source.images, gt_phrases)
    unreadable_before = len(grounder.unreadable_images)
    boxes = ground_requests(grounder, requests, progress.images)
    unreadable = grounder.unreadable_images[unreadable_before:]
    rows = caption_rows(records, graphs, requests, boxes, gt_phrases)
    return rows, shard_counts(rows, len(set(unreadable)))  # an image with several requests is counted once


# ----- one split --------------------------------------------------------------------------------------
def preprocess_split(cfg, source: SplitSource, parser: SceneGraphParser, grounder,
                     shard: Tuple[int, int] = (0, 1)) -> dict:
    """Process this worker's unfinished shards of one split; return the (re)written manifest."""
    # Captions of one image side by side, so that each image is read and grounded once (COCO lists captions
    # in no particular order); the DataModule looks records up by caption id, so the order is free.
    records = sorted(source.records(), key=lambda record: (record.image_id, record.caption_id))
    size = cfg.preprocess.shard_size
    settings = cache_settings(source, parser.settings(), grounder)
    cache = ShardedCache(cache_directory(cfg.preprocess.cache_root, settings), shard_count(len(records), size))
    todo = cache.unfinished(shard)
    log.info("%s: %d captions, %d shards, %d to do here, cache %s", source.split, len(records), cache.num_shards,
             len(todo), cache.directory)
    if todo:
        prepare_grounder(grounder)
    gt_phrases = gt_phrases_by_caption(source.scene_graphs) if todo else {}
    chunks = {index: records[index * size:(index + 1) * size] for index in todo}
    with split_progress(source.split, list(chunks.values())) as progress:
        return fill_shards(cache, settings, todo, lambda index: process_shard(
            chunks[index], parser, grounder, source, gt_phrases, progress))


def prepare_grounder(grounder) -> None:
    """Load the grounder's model before the first shard: a detector checkpoint that does not fit is refused
    (InputError) before any caption is parsed or any cache file written."""
    try:
        grounder.prepare()
    except GrounderInputError as err:
        raise InputError(f"preprocessing cannot start:\n  - {err}") from err


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[], help="experiment YAML(s), as for fit")
    add_shard_argument(parser)
    add_key_values(parser, help="config overrides, e.g. preprocess.grounder=none")
    # Options and overrides may interleave (`--config a.yaml k=v --config b.yaml k2=v2`); every --config file
    # still merges before every override, each in the order given.
    return parser.parse_intermixed_args(argv)


def run(cfg, shard: Tuple[int, int] = (0, 1)) -> Dict[str, dict]:
    """Preprocess every configured split; return the manifest of each.

    Raises:
        InputError: a missing input or a refused option (before anything is built or written), or a detector
            checkpoint that does not fit its model (refused once the model is built, before any shard's work).
    """
    check_preprocess_inputs(cfg)
    parser = build_parser(cfg.preprocess)
    grounder = make_grounder(cfg.data, cfg.preprocess)
    manifests = {}
    for source in split_sources(cfg.data, cfg.preprocess):
        start = time.perf_counter()
        manifest = manifests[source.split] = preprocess_split(cfg, source, parser, grounder, shard)
        log.info("%s done in %.1f s, %d damaged shards rebuilt: %s", source.split, time.perf_counter() - start,
                 manifest["rebuilt_shards"], manifest["counts"])
    return manifests


def main(argv: Optional[Sequence[str]] = None) -> None:
    # The experiment config schema lives with the training code; only this entry point needs it.
    from core.config import load_config_or_exit

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides)
    try:
        run(cfg, args.shard)
    except InputError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
