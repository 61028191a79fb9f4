"""The study's results bundle: the study kept as data, from which its report is made again with no run folder.

`python -m study --sweep DIR --bundle DIR` writes it (`update_bundle`) after scoring; `python -m study.page
--bundle DIR` makes the report page from it alone (`load_bundle`); `slurm.sweep` skips the runs it holds. The
file layout is `study/records.py`'s (standard library only), the part the sweep reads `core/run_records.py`'s;
the format as a reader sees it is `BUNDLE_README`, written to `<bundle>/README.md`.

What a sitting adds is merged into what the bundle held: a run with a complete export here is scored and its
record written (refused when the bundle holds a record of another config digest or backbone for it); a run
without one keeps its record. The frozen rows and validity backbones are scored when their exports are here
(refused when their weights differ from the bundle's). The world must be the one the bundle was made on
(its annotation files' sha256).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from core.files import atomic_write_text
from core.run_records import (BACKBONE, BACKBONE_NUMERICS, BACKBONE_PATH, BACKBONE_SHA256, CONFIG, CONFIG_DIGEST,
                              RUNS_DIR, backbone_weights, config_differences, export_numerics, export_weights,
                              file_sha256, run_record_path, world_checksum)
from slurm.runs import SWEEP_FILE, export_complete
from study import validity as study_validity
from study.analysis import FLAT_MULTIPLE, Curves, Evaluations, Findings, Selection, Stored, claims, json_safe
from study.records import (FORMAT, FROZEN_DIR, README, REPORT_DOCUMENT, SWEEP_DOCUMENT, carry_backbone,
                           frozen_record_path, read_records, sweep_folder, weights_sha256, write_json, write_json_gz)
from study.settings import SplitEval, Study, StudyError, grid_run, study_of
from study.stats import DEFAULT_LEVEL

WORLD_FILES = ("captions_{split}.json", "swap_{split}.json", "scene_graphs_{split}.json")


# ----- records ------------------------------------------------------------------------------------------------
def stored_splits(scores: Mapping[str, SplitEval]) -> Dict[str, SplitEval]:
    """A run's scores as the bundle keeps them: without the cache's fingerprint of the local world files
    (the bundle's `world` checksums stand for it), NaN as null."""
    return json_safe({split: {key: value for key, value in split_scores.items() if key != "data"}
                      for split, split_scores in scores.items()})


def run_config(run_dir: Path) -> dict:
    """The resolved config a run ran with (its config.yaml), as plain containers."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise StudyError(f"{path} does not exist: a run folder without its config cannot enter a bundle")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def backbone_of(config: Mapping[str, object], where: str) -> Optional[dict]:
    """{"path", "sha256"} of the weights the run started from (`model.pretrained`), with the `numerics` its export
    records (what its exact bits depend on: study/records.py); None without local weights. The sweep checks these
    fields (core/run_records.py)."""
    pretrained = config["model"]["pretrained"]
    weights = backbone_weights(pretrained)
    if weights is None:
        return None
    if not weights.is_file():
        raise StudyError(f"{where}: its backbone {weights} is not here, so its checksum cannot be recorded (train "
                         "the backbones first)")
    numerics = export_numerics(weights)
    return {BACKBONE_PATH: pretrained, BACKBONE_SHA256: file_sha256(weights),
            **({BACKBONE_NUMERICS: numerics} if numerics else {})}


def run_record(run_dir: Path, name: str, choices: Mapping[str, str], scores: Mapping[str, SplitEval],
               curves: Curves, errors: Sequence[str]) -> dict:
    """One run's record: what ran (config digest and keys, backbone and export checksums) and what it scored."""
    from lightning_modules.resume import config_digest, result_keys

    config = run_config(run_dir)
    return {"format": FORMAT, "name": name, "choices": dict(choices), CONFIG_DIGEST: config_digest(config),
            CONFIG: json_safe(result_keys(config)), BACKBONE: backbone_of(config, name),
            "export_sha256": weights_sha256(Path(run_dir) / "export"),
            "numerics": export_numerics(export_weights(Path(run_dir) / "export")),
            "curves": {metric: [list(steps), list(values)] for metric, (steps, values) in sorted(curves.items())},
            "splits": stored_splits(scores), "errors": list(errors)}


def frozen_record(name: str, export: Path, scorer: str, scores: Mapping[str, SplitEval],
                  errors: Sequence[str]) -> dict:
    return {"format": FORMAT, "name": name, "scorer": scorer,
            "export": {"path": str(export), "sha256": weights_sha256(export)},
            "splits": stored_splits(scores), "errors": list(errors)}


def same_run(stored: Mapping[str, object], record: Mapping[str, object]) -> List[str]:
    """What differs between a bundle's record and the one made from the run folder here ([]: the same run)."""
    problems = []
    if stored.get(CONFIG_DIGEST) != record.get(CONFIG_DIGEST):
        problems.append("config: " + "; ".join(config_differences(stored.get(CONFIG) or {}, record.get(CONFIG) or {})))
    if stored.get(BACKBONE) != record.get(BACKBONE):
        problems.append(f"backbone: {stored.get(BACKBONE)} (bundle) -> {record.get(BACKBONE)} (here)")
    return problems


# ----- the world ----------------------------------------------------------------------------------------------
def world_checksums(data: Path, splits: Sequence[str]) -> dict:
    """sha256 of the world's annotation files the scores depend on (captions, swap set, scene graphs of each
    scored split, the held-out combinations): two worlds with the same checksums are the same world."""
    names = [pattern.format(split=split) for split in splits for pattern in WORLD_FILES] + ["heldout.json"]
    files = {f"annotations/{name}": file_sha256(Path(data) / "annotations" / name) for name in names
             if (Path(data) / "annotations" / name).is_file()}
    return {"root": str(data), "files": files}


def check_world(stored: Optional[Mapping[str, object]], world: Mapping[str, object]) -> None:
    if stored and stored.get("files") != world["files"]:
        changed = sorted(name for name in set(stored["files"]) | set(world["files"])
                         if stored["files"].get(name) != world["files"].get(name))
        raise StudyError(f"the world {world['root']} is not the one the bundle was made on ({stored['root']}; world "
                         f"checksums {world_checksum(world['files'])} here, {world_checksum(stored['files'])} in the "
                         f"bundle): these files differ: {changed}. Generate the world with the bundle's seed, or "
                         "start a new bundle (make study STUDY_SEED=N writes results/study-world-N)")


# ----- reading ------------------------------------------------------------------------------------------------
def read_sweep_document(bundle: Path, sweep_name: str) -> Optional[dict]:
    path = sweep_folder(bundle, sweep_name) / SWEEP_DOCUMENT
    return json.loads(path.read_text()) if path.is_file() else None


def stored_of(bundle: Path, sweep_names: Sequence[str]) -> Tuple[Stored, Dict[str, dict], Dict[str, dict]]:
    """The scores a bundle holds for these sweeps (a study and its checks): as `Stored`, and the raw run and
    frozen records by name."""
    runs: Dict[str, dict] = {}
    frozen: Dict[str, dict] = {}
    for name in sweep_names:
        runs.update(read_records(sweep_folder(bundle, name) / RUNS_DIR))
        frozen.update(read_records(sweep_folder(bundle, name) / FROZEN_DIR))
    stored = Stored(runs={name: record["splits"] for name, record in runs.items()},
                    frozen={name: record["splits"] for name, record in frozen.items()},
                    curves={name: {metric: (list(points[0]), list(points[1]))
                                   for metric, points in record.get("curves", {}).items()}
                            for name, record in runs.items()},
                    errors={name: list(record.get("errors") or []) for name, record in {**runs, **frozen}.items()})
    return stored, runs, frozen


def bundled_study(bundle: Path) -> str:
    """The name of the study in a bundle: its one folder with a report.json (a checks sweep has none)."""
    found = sorted(path.parent.name for path in Path(bundle).glob(f"*/{REPORT_DOCUMENT}"))
    if len(found) != 1:
        raise StudyError(f"{bundle} holds {len(found)} studies ({found}); a bundle holds one, written by python -m "
                         "study --sweep DIR --bundle DIR")
    return found[0]


def load_bundle(bundle: Path, sweep_name: Optional[str] = None) -> Tuple[Study, Evaluations]:
    """The study (the bundle's one, or `sweep_name`) and its scores from the bundle alone (no run folder, no world
    is read): every grid and check run with a record, every frozen row; runs without a record are missing."""
    sweep_name = sweep_name or bundled_study(bundle)
    document = read_sweep_document(bundle, sweep_name)
    if document is None:
        raise StudyError(f"{sweep_folder(bundle, sweep_name) / SWEEP_DOCUMENT} does not exist: write the bundle with "
                         "python -m study --sweep DIR --bundle DIR first")
    checks = read_sweep_document(bundle, document["checks"]) if document.get("checks") else None
    study = study_of(Path(document["runs_root"]), document, checks, world=False)
    stored, _, _ = stored_of(bundle, [sweep_name] + ([document["checks"]] if checks else []))
    evaluations = Evaluations()
    for run in study.runs + study.checks:
        if run.name in stored.runs:
            evaluations.scores[run.name] = stored.runs[run.name]
            evaluations.curves[run.name] = stored.curves.get(run.name, {})
        else:
            evaluations.missing[run.name] = "no record in the bundle (not run, or not finished when it was written)"
    evaluations.scores.update(stored.frozen)
    evaluations.errors = {name: problems for name, problems in stored.errors.items() if problems}
    return study, evaluations


# ----- writing ------------------------------------------------------------------------------------------------
def bundle_study_block(study: Study) -> dict:
    """The sweep's study block with the backbones as the export folders they resolved to here, so that the
    settings read back from the bundle name the same folders on a machine without them."""
    block = json.loads(json.dumps(study_block(study)))
    if study.settings.frozen and block.get("frozen"):
        block["frozen"]["backbone"] = str(study.settings.frozen.export)
    if study.settings.validity and block.get("validity"):
        block["validity"]["backbones"] = [str(path) for path in study.settings.validity.backbones]
    return block


def study_block(study: Study) -> dict:
    document = json.loads((study.directory / SWEEP_FILE).read_text())
    return document.get("study") or {}


def grid_document(directory: Path) -> dict:
    document = json.loads((Path(directory) / SWEEP_FILE).read_text())
    return {"name": document["name"], "runs_root": document["runs_root"], "runs": document["runs"]}


def bundled_sweeps(study: Study, bundle: Optional[Path] = None) -> List[str]:
    """The names (sweep.json's) under which the study and its checks sweep are kept in a bundle."""
    main, checks = sweep_documents(study, world=False, bundle=bundle)
    return [main["name"]] + ([checks["name"]] if checks else [])


def read_stored(bundle: Path, study: Study) -> Stored:
    """What the bundle holds for the study and its checks."""
    return stored_of(bundle, bundled_sweeps(study, bundle))[0]


def sweep_documents(study: Study, world: bool = True, bundle: Optional[Path] = None) -> Tuple[dict, Optional[dict]]:
    """(the study's sweep.json in the bundle, its checks sweep's) with the world's checksums; the checks sweep's
    from the `bundle` when its own sweep.json is not here (a sitting that has not run it again)."""
    main = {"format": FORMAT, **grid_document(study.directory), "study": bundle_study_block(study)}
    if world:
        main["world"] = world_checksums(study.settings.data, [study.settings.selection_split, *study.settings.splits])
    checks = None
    if study.settings.checks is not None and (study.settings.checks / SWEEP_FILE).is_file():
        checks = {"format": FORMAT, **grid_document(study.settings.checks)}
    elif study.settings.checks is not None and bundle is not None:
        checks = read_sweep_document(bundle, study.settings.checks.name)
    if checks is not None:
        main["checks"] = checks["name"]
    return main, checks


def with_bundled_checks(study: Study, bundle: Path) -> Study:
    """The study with its check runs from the bundle when its checks sweep has not been written here."""
    if study.settings.checks is None or study.checks:
        return study
    document = read_sweep_document(bundle, study.settings.checks.name)
    if document is None:
        return study
    return replace(study, checks=[grid_run(entry, study.settings.checks) for entry in document["runs"]])


def fresh_records(study: Study, evaluations: Evaluations, grid_runs: Sequence, choices: Mapping[str, dict]
                  ) -> Dict[str, dict]:
    """A record for every run scored from its folder here (complete export, scores)."""
    records = {}
    for run in grid_runs:
        if export_complete(run.directory) and run.name in evaluations.scores:
            records[run.name] = run_record(run.directory, run.name, choices.get(run.name, {}),
                                           evaluations.scores[run.name], evaluations.curves.get(run.name, {}),
                                           evaluations.errors.get(run.name, []))
    return records


def fresh_frozen_records(study: Study, evaluations: Evaluations, stored: Collection[str] = ()) -> Dict[str, dict]:
    """A record for every frozen row and validity backbone whose export is here and which was scored in this
    sitting (not one of the `stored` rows, which are never scored again: study.analysis.frozen_targets)."""
    settings, rows = study.settings, []
    if settings.frozen:
        rows += [(label, settings.frozen.export, scorer) for label, scorer in settings.frozen.rows.items()]
    if settings.validity:
        rows += [(name, export, "clip") for name, export in zip(settings.validity.names(), settings.validity.backbones)]
    return {name: frozen_record(name, export, scorer, evaluations.scores[name], evaluations.errors.get(name, []))
            for name, export, scorer in rows
            if (export / "model.json").is_file() and name in evaluations.scores and name not in stored}


def merged(stored: Mapping[str, dict], fresh: Mapping[str, dict], kind: str) -> Dict[str, dict]:
    """The bundle's records with the fresh ones in their place; a fresh record of another run than the stored
    one under its name is a StudyError naming what differs."""
    problems = []
    for name, record in fresh.items():
        if name not in stored:
            continue
        differs = (same_run(stored[name], record) if kind == RUNS_DIR else
                   [f"export sha256 {stored[name]['export']['sha256']} (bundle) -> {record['export']['sha256']} (here)"]
                   if stored[name]["export"]["sha256"] != record["export"]["sha256"] else [])
        problems += [f"{name}: {problem}" for problem in differs]
    if problems:
        raise StudyError("the bundle holds other results under these names (nothing was written):\n  - "
                         + "\n  - ".join(problems) + "\nThe bundle belongs to another study: start a new one, or "
                         "rerun these with the configs and backbones it was made with.")
    return {**stored, **fresh}


def update_bundle(bundle: Path, study: Study, evaluations: Evaluations,
                  selections: Mapping[Tuple[str, str], Selection], findings: Findings,
                  validity: Optional[study_validity.Validity]) -> Path:
    """Merge this sitting's records into the bundle and write its documents; returns the study's folder."""
    main, checks = sweep_documents(study, bundle=bundle)
    check_world((read_sweep_document(bundle, main["name"]) or {}).get("world"), main["world"])
    names = [main["name"]] + ([checks["name"]] if checks else [])
    _, stored_runs, stored_frozen = stored_of(bundle, names)
    choices = {entry["name"]: entry.get("choices") or {} for document in (main, checks) if document
               for entry in document["runs"]}
    runs = merged(stored_runs, fresh_records(study, evaluations, study.runs + study.checks, choices), RUNS_DIR)
    frozen = merged(stored_frozen, fresh_frozen_records(study, evaluations, stored_frozen), FROZEN_DIR)
    check_names = {run.name for run in study.checks}
    for document in (main, checks):
        if document is None:
            continue
        write_json(sweep_folder(bundle, document["name"]) / SWEEP_DOCUMENT, document)
        for name, record in runs.items():
            if (name in check_names) == (document is checks):
                write_json_gz(run_record_path(bundle, document["name"], name), record)
    for name, record in frozen.items():
        write_json_gz(frozen_record_path(bundle, main["name"], name), record)
    for record in runs.values():
        carry_backbone(bundle, main["name"], record[BACKBONE])
    write_json(sweep_folder(bundle, main["name"]) / REPORT_DOCUMENT,
               report_document(study, evaluations, selections, findings, validity))
    atomic_write_text(Path(bundle) / README, BUNDLE_README)
    return sweep_folder(bundle, main["name"])


# ----- report.json ----------------------------------------------------------------------------------------------
def interval_fields(interval) -> dict:
    return {"estimate": interval.estimate, "low": interval.low, "high": interval.high}


def flags_fields(flags) -> Optional[dict]:
    if flags is None:
        return None
    return {"edge": flags.edge, "bracketed": flags.bracketed, "flat": flags.flat, "spread": flags.spread,
            "noise": flags.noise}


def report_document(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection],
                    findings: Findings, validity: Optional[study_validity.Validity]) -> dict:
    """The numbers the report shows, as data: selection (with its flags), summaries, comparisons (bootstrap and
    seed-level t), the claims they support, each row's activity, trade-off, checks, validity."""
    settings = study.settings

    def comparison(c) -> dict:
        return {"method": c.method, "negatives": c.condition, "reference": c.reference, "split": c.split,
                "metric": c.metric, **interval_fields(c.interval), "n_seeds": c.n_seeds, "n_items": c.n_items,
                "seed_t": c.seed.as_dict() if c.seed else None}

    provisional = validity is not None and not validity.passed
    return json_safe({
        "format": FORMAT,
        "bootstrap": {"resamples": settings.resamples, "seed": settings.bootstrap_seed, "level": DEFAULT_LEVEL},
        "selection_flags": {"flat_multiple": FLAT_MULTIPLE,
                            "edge": "the chosen setting is the smallest or largest of its grid (not bracketed)",
                            "flat": "best - worst validation mean < flat_multiple x sqrt(se_best^2 + se_worst^2), "
                                    "se = seed-level sd / sqrt(seeds) (null: a setting with fewer than 2 seeds)"},
        "selection": [{"method": method, "negatives": condition, "chosen": selection.chosen,
                       "validation": {setting: {"mean": mean, "n_seeds": count,
                                                "values": list(selection.values.get(setting, ()))}
                                      for setting, (mean, count) in selection.validation.items()},
                       "flags": flags_fields(findings.flags.get((method, condition)))}
                      for (method, condition), selection in selections.items()],
        "summaries": [{"method": s.method, "negatives": s.condition, "split": s.split, "metric": s.metric,
                       "setting": s.setting, **interval_fields(s.interval), "n_seeds": s.n_seeds}
                      for s in findings.summaries],
        "comparisons": [comparison(c) for c in findings.differences],
        "claims": {"rule": "bootstrap and seed-level t intervals (95%) both exclude 0 on the same side; inactive "
                           "rows left out; no multiplicity correction",
                   "provisional": provisional,
                   "read": [{"method": c.method, "negatives": c.condition, "reference": c.reference,
                             "split": c.split, "metric": c.metric}
                            for c in claims(findings.differences, findings.inactive)]},
        "activity": [{"method": a.method, "negatives": a.condition, "reference": a.reference, "pairs": a.pairs,
                      "decisions": a.outcomes, "differing": a.differing, "active": a.active}
                     for a in findings.activity],
        "tradeoffs": [comparison(c) for c in findings.tradeoffs],
        "checks": [{"check": r.check.name, "reference": r.reference, "row_setting_chosen": r.chosen,
                    "metric": r.metric, "value": r.value, "reference_value": r.reference_value,
                    **interval_fields(r.interval), "n_items": r.n_items} for r in findings.checks],
        "validity": study_validity.as_json(validity) if validity else None,
        "missing": dict(sorted(evaluations.missing.items())),
    })


BUNDLE_README = """\
# The method study's results bundle

Written by `python -m study --sweep runs/study/sweep --bundle results/study` (study/bundle.py); the report page
`docs/study_results.md` and its plots are made from this folder alone by
`python -m study.page --bundle results/study --out docs/study_results.md`. Everything here reads with the
Python standard library (`gzip`, `json`); recomputing an interval needs numpy as well.

## Layout

- `<sweep>/sweep.json`: the grid (`runs`: each run's `name`, config files, overrides and `choices`, one label per
  axis), the study settings (`study`, as in `configs/sweeps/study.yaml`), the world's checksums (`world`: sha256 of
  its annotation files) and, for the study, the name of its checks sweep (`checks`). `sweep/` is the study,
  `checks/` its one-seed checks (each a grid run with one option changed, axis `check`). The world's one
  checksum is the sha256 of `world.files` as canonical JSON (sorted keys, no spaces); `python -m study.restore`
  and a sweep with this bundle refuse a world with another one, naming both.
- `<sweep>/runs/<run>.json.gz`: one record per finished run (gzip JSON; `python -c "import gzip, json;
  print(json.load(gzip.open('results/study/sweep/runs/<run>.json.gz'))['splits'].keys())"`).
- `sweep/frozen/<row>.json.gz`: the rows scored from a backbone without training (`frozen_cosine`: the global
  cosine of the backbone every run starts from; `sgi`) and the validity backbones (`validity_<i>`: pretraining
  seed i).
- `sweep/backbones/<sha256[:16]>/`: the backbone every run started from, carried so a later sitting can continue
  (below).
- `sweep/report.json`: the numbers the page shows: `selection` (each setting's per-seed `values` and mean, the
  chosen one and its `flags`), `summaries`, `comparisons` (paired differences, each with its `seed_t`), `claims`,
  `activity`, `tradeoffs`, `checks`, `validity`, `missing`, and the `bootstrap` and `selection_flags` settings.
  `python -m study.page --bundle results/study --out docs/study_results.md --refresh-report` writes it again from
  this folder alone (after a change of the report's code; no run is read).

## A run record

- `config_digest`: sha256 of the run's resolved config without the keys that cannot change its result (loader
  workers, device and node counts, logging, evaluation, monitor and resume settings, the per-device batches:
  `lightning_modules.resume.result_keys`), as canonical JSON (sorted keys, no spaces); `config`: those keys.
- `backbone`: `{"path", "sha256"}` of the weights it started from (`model.pretrained`; `sha256sum
  runs/study/backbones/seed-0/export/open_clip.pt`) and, where that export records them, the `numerics` it was
  trained with (device, CPU instruction set and generation, threads, processes, precision, torch version);
  `export_sha256`: its own exported weights; `numerics`: what its own training ran with (as for the backbone).
- `curves`: `{metric: [steps, values]}`, its validation curves (`eval/shapes_swap/<metric>` in TensorBoard).
- `splits`: per split (`val` for every run; `test` and `test_unseen` for the study's runs) its aggregates and
  per-item outcomes, and `mechanisms` (the method's mechanism metrics, where measured; null elsewhere):
  - `swap_outcomes`: one per swap item, `{"id", "type" (attribute / relation / object), "text_i0", "text_i1",
    "image_c0", "image_c1", "text", "image", "group", "tie"}` (0/1; the Winoground rule, a tie is wrong);
    `swap`: its aggregates.
  - `retrieval_outcomes`: one per query, `[direction ("i2t" / "t2i"), rank, ties]` in the split's file order
    (rank: wrong candidates scoring at least as high as the best correct one; R@1 is rank 0); `retrieval`.
  - `zeroshot_outcomes`: one per object and attribute, `[id ("shape:<image>:<object>" or "color:..."), gold
    label, rank, ties]` (top-1 is rank 0); `zeroshot`: `shape_top1`, `color_top1`, `top1`.
- `errors`: what went wrong while scoring or measuring it.

A sweep with `bundle: results/study` (`python -m slurm.sweep ...`) skips every run whose record holds its config
digest and its backbone's sha256, and stops, naming the runs and the keys, when a record differs: a later sitting
must start from the very backbone recorded here, which proves it continued the same study. A backbone trained
again has these bits only where it is trained as this one was: the same config and world, but also the same device,
CPU generation, thread count and torch version (one thread against two, or one CPU generation against another,
gives other weights after a few hundred steps). So the bundle carries it: `sweep/backbones/<sha256[:16]>/` holds
the export's files as they were (`model.json`, `model_configs/`), its weights gzipped (`open_clip.pt.gz`) and
`source.json` (`path`, `weights`, `sha256`); `python -m study.restore --bundle results/study` (the first step of
`make study`) writes it back to `path`, checked against `sha256`. The runs of a later sitting on another machine
then differ from this sitting's only in the last bits of their own training, which each record names (`numerics`).
The frozen rows and validity backbones are scored once and kept: a validity backbone trained again elsewhere does
not replace the scores of the first.

## The numbers and their intervals

Per run and split, a metric is the mean of its per-item values (x100): `group` / `text` / `image`: the item's
flag; `acc_<type>`: the mean of `text_i0` and `text_i1` over the items of that type; `zeroshot_top1`: rank 0
over both attributes' outcomes (`shape_top1`, `color_top1`: one attribute's); `retrieval_r1`: rank 0 over the
queries of both directions (item id `<direction>:<index in the stored order>`).

- Row: the runs of a method and condition at the setting chosen on `val` (`report.json` `selection`: the best
  mean `group` over seeds, the first in grid order on a tie). Mean and Student-t 95% interval over its seeds
  (n - 1 degrees of freedom).
- Selection `flags`: `edge` when the chosen setting is the smallest or largest of its grid (`bracketed` false: a
  setting beyond the grid may score better); `flat` when the best and worst settings' means differ (`spread`) by
  less than `noise` = `selection_flags.flat_multiple` (2) x sqrt(se_best^2 + se_worst^2), se the setting's
  sample standard deviation over seeds / sqrt(seeds); null with fewer than 2 seeds.
- Paired difference (`comparisons`, `tradeoffs`, `checks`): a method's row minus its reference's on the same
  items, with a paired bootstrap over items x seeds:
  1. items: the ids common to both, sorted as strings; seeds: the method's seed labels in grid order that the
     reference also has (a frozen reference, scored once, stands beside every seed; a check has one seed);
  2. `D` = method values - reference values, a `[seeds, items]` array;
  3. `rng = numpy.random.default_rng(seed)` with the `bootstrap.seed` of report.json (0), then for each of
     `bootstrap.resamples` replicates (10,000): `rows = rng.integers(S, size=S)`, then
     `columns = rng.integers(N, size=N)`, replicate = `D[numpy.ix_(rows, columns)].mean()`;
  4. estimate `D.mean()`, interval `numpy.quantile(replicates, [0.025, 0.975])` (numpy's default, linear).
  The resampling unit is the item and the seed at once: both the test set's sampling and training noise enter.
- Seed-level paired t (`seed_t` of each comparison and trade-off): the per-seed differences `d = D.mean(axis=1)`
  (one per paired seed), mean with Student-t 95% interval on `df` = seeds - 1 degrees of freedom and the
  two-sided `p` of a zero mean (null with one seed; d without spread: a point and p 1 when 0, else 0).
- `claims.read`: the comparisons whose bootstrap and seed-level t intervals both exclude 0 on the same side, of
  active rows, each read at 95% with no multiplicity correction; `claims.provisional` when the validity checks
  do not all pass.
- `activity`: each method compared with the baseline (`reference`), its runs (each setting and seed) against the
  baseline's of the same condition, setting and seed: `decisions` compared on every split both hold (a swap
  item's flags; whether a retrieval query, a zero-shot object, ranks its answer first) and how many `differing`;
  `active` false (inactive) when none differs: the row is the baseline's runs, not a result of the method.
- Validity gains: difference of the two means (the control's seeds, the backbones' pretraining seeds) with
  Welch's t-interval. `validity.checks`: (a)-(c) on the backbones' mean and the control, (d)-(f) per backbone
  (zero-shot shape and colour top-1 at least `criteria.recognition_floor`; 2-way relation within
  `criteria.chance_margin` of 50; object words above composition words in the text attribution, `passed` null
  when not measured); `validity.passed` only when every check passed.

Recomputing one interval (the first comparison of report.json):

```python
import gzip, json
import numpy as np

root = "results/study/sweep"
report = json.load(open(f"{root}/report.json"))
grid = json.load(open(f"{root}/sweep.json"))
c = report["comparisons"][0]
chosen = {(s["method"], s["negatives"]): s["chosen"] for s in report["selection"]}

def values(outcomes, metric):  # per swap item, x100
    if metric == "group":
        return {o["id"]: 100.0 * o["group"] for o in outcomes}
    kind = metric[len("acc_"):]
    return {o["id"]: 50.0 * (o["text_i0"] + o["text_i1"]) for o in outcomes if o["type"] == kind}

def runs(method, negatives):  # seed label -> that run's per-item values on the split
    found = {}
    for entry in grid["runs"]:
        labels = {axis: label.split("-", 1)[1] for axis, label in entry["choices"].items()}
        setting = ", ".join(f"{a}={v}" for a, v in labels.items() if a not in ("method", "negatives", "seed", "check"))
        if (labels["method"], labels.get("negatives", "-")) == (method, negatives) and \\
                setting == chosen[(method, negatives)]:
            record = json.load(gzip.open(f"{root}/runs/{entry['name']}.json.gz"))
            found[labels["seed"]] = values(record["splits"][c["split"]]["swap_outcomes"], c["metric"])
    return found

reference_method, _, rest = c["reference"].partition(" (")
mine, theirs = runs(c["method"], c["negatives"]), runs(reference_method, rest.rstrip(")") or "-")
seeds = [s for s in mine if s in theirs]
items = sorted(mine[seeds[0]])
D = np.array([[mine[s][i] - theirs[s][i] for i in items] for s in seeds])
rng = np.random.default_rng(report["bootstrap"]["seed"])
draws = []
for _ in range(report["bootstrap"]["resamples"]):
    rows = rng.integers(len(seeds), size=len(seeds))
    columns = rng.integers(len(items), size=len(items))
    draws.append(D[np.ix_(rows, columns)].mean())
print(D.mean(), np.quantile(draws, [0.025, 0.975]), (c["estimate"], c["low"], c["high"]))
```

(A comparison with a frozen reference, e.g. `tflocal` against `frozen_cosine`, reads the reference's outcomes from
`frozen/<reference>.json.gz`, once, for every seed.)
"""
