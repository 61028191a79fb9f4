"""Writes `tasks.json`: ELEVATER's 21 zero-shot tasks, read from the toolkit's own files at one commit.

Usage (from the repository root; `TOOLKIT` is a clone, bare or not, of Computer-Vision-in-the-Wild/Elevater_Toolkit_IC):

    python -m evaluation.benchmarks.data.elevater.extract TOOLKIT [--commit 00d0af7]

For each task (the file name of its dataset config `vision_benchmark/resources/datasets/<task>.yaml`), it records:
- from that config: the dataset name (`DATASET.DATASET`), the metric (`TEST.METRIC`) and `DATASET.CENTER_CROP`
  (default True, `vision_benchmark/config/default.py`);
- from `vision_benchmark/resources/datasets/vision_datasets.json` (the registry the toolkit hands to
  `vision_datasets.DatasetHub`): the dataset type, the index format (`format`, default "iris"), `root_folder`,
  the test split's index file, its image archives and image count, the label map file (which the toolkit does
  not read for zero-shot scoring) and `num_classes`;
- from `vision_benchmark/datasets/prompts.py`: the class names (`class_map[dataset]`; where an entry is a list of
  synonyms, the toolkit's `extract_text_features` keeps its first name, and so is it kept here) and the templates
  (`template_map.get(dataset, ['a photo of a {}'])`, the toolkit's fallback).

prompts.py is parsed with `ast` (its lists are literals), never executed. Nothing is rewritten: names and templates
are stored exactly as the toolkit formats them (`template.format(name)`).
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
from pathlib import Path
from typing import Sequence

import yaml

from core.cli import add_output

REPOSITORY = "Computer-Vision-in-the-Wild/Elevater_Toolkit_IC"
DATASET_CONFIGS = "vision_benchmark/resources/datasets"
REGISTRY = f"{DATASET_CONFIGS}/vision_datasets.json"
PROMPTS = "vision_benchmark/datasets/prompts.py"
DEFAULT_TEMPLATES = ["a photo of a {}"]  # feature.py: template_map.get(dataset, ['a photo of a {}'])
# The 21 tasks, named as vl_compo's result tables name them (= the toolkit's dataset config file names).
TASKS = ("caltech101", "cifar10", "cifar100", "country211", "dtd", "eurosat-clip", "fer2013", "fgvc-aircraft-2013b",
         "flower102", "food101", "gtsrb", "hateful-memes", "imagenet-1k", "kitti-distance", "mnist",
         "oxford-iiit-pets", "patchcamelyon", "rendered-sst2", "resisc45-clip", "stanfordcar",
         "voc2007classification")


def git_show(repo: Path, commit: str, path: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], check=True, capture_output=True,
                          text=True, encoding="utf-8").stdout


def prompt_tables(source: str) -> tuple[dict, dict]:
    """`class_map` and `template_map` of prompts.py, each dataset name resolved to its literal list."""
    lists, maps = {}, {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if isinstance(node.value, ast.List):
            lists[name] = ast.literal_eval(node.value)
        elif isinstance(node.value, ast.Dict):
            maps[name] = {ast.literal_eval(key): value.id for key, value in zip(node.value.keys, node.value.values)}
    resolve = {table: {dataset: lists[variable] for dataset, variable in maps[table].items()}
               for table in ("class_map", "template_map")}
    return resolve["class_map"], resolve["template_map"]


def task_record(config: dict, registry: dict, class_map: dict, template_map: dict) -> dict:
    dataset = config["DATASET"]["DATASET"]
    info = registry[dataset]
    names = [name[0] if isinstance(name, list) else name for name in class_map[dataset]]
    synonyms = {name[0]: name[1:] for name in class_map[dataset] if isinstance(name, list) and len(name) > 1}
    templates = list(template_map.get(dataset, DEFAULT_TEMPLATES))
    if info.get("num_classes") is not None and info["num_classes"] != len(names):
        raise ValueError(f"{dataset}: {len(names)} class names but num_classes {info['num_classes']}")
    if any(template.count("{}") != 1 for template in templates):
        raise ValueError(f"{dataset}: a template without exactly one '{{}}': {templates}")
    test = info["test"]
    return {"dataset": dataset, "metric": config["TEST"]["METRIC"], "type": info["type"],
            "format": info.get("format", "iris"), "root_folder": info["root_folder"], "index": test["index_path"],
            "archives": list(test.get("files_for_local_usage", [])), "num_images": test["num_images"],
            "labelmap": info.get("labelmap"),
            "center_crop": bool(config["DATASET"].get("CENTER_CROP", True)), "classes": names,
            "synonyms_unused": synonyms, "templates": templates}


def extract(repo: Path, commit: str) -> dict:
    full = subprocess.run(["git", "-C", str(repo), "rev-parse", f"{commit}^{{commit}}"], check=True,
                          capture_output=True, text=True).stdout.strip()
    registry = {entry["name"]: entry for entry in json.loads(git_show(repo, full, REGISTRY))}
    class_map, template_map = prompt_tables(git_show(repo, full, PROMPTS))
    tasks = {task: task_record(yaml.safe_load(git_show(repo, full, f"{DATASET_CONFIGS}/{task}.yaml")), registry,
                               class_map, template_map) for task in TASKS}
    return {"repository": REPOSITORY, "commit": full,
            "files": [PROMPTS, REGISTRY] + [f"{DATASET_CONFIGS}/{task}.yaml" for task in TASKS], "tasks": tasks}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("toolkit", type=Path, help="a clone of the ELEVATER toolkit (bare or not)")
    parser.add_argument("--commit", default="00d0af7", help="the toolkit commit to read (default 00d0af7)")
    add_output(parser, "file", help="the tasks file to write (default: tasks.json beside this script)",
               default=Path(__file__).with_name("tasks.json"))
    args = parser.parse_args(argv)
    args.out.write_text(json.dumps(extract(args.toolkit, args.commit), indent=1, ensure_ascii=False) + "\n",
                        encoding="utf-8")


if __name__ == "__main__":
    main()
