"""The demo table: each row scored on the shapes world's test split and compared with the pretrained backbone on
the same swap items (paired bootstrap, discordant items, exact sign test), the world and backbone checked against
the study's bundle, and the committed study's headline read from its report."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from core.run_records import file_sha256
from datamodules.shapes import generate
from modeling.encoders import build_model
from modeling.export import export_model
from study.bundle import world_checksums
from study.demo import Row, compare, evaluate_export, main, markdown_table, sign_test, study_headline
from study.records import carry_backbone, write_json, write_json_gz

BUNDLE = Path(__file__).resolve().parents[1] / "results" / "study"


def export_random(folder: Path, seed: int, steps: int = 0) -> Path:
    torch.manual_seed(seed)
    built = build_model("ViT-Tiny-16-64", None, "configs/models")
    export_model(built.model, built.name, folder / "export", extra={"global_step": steps})
    return folder


def tiny_bundle(root: Path, world: Path, backbone: Path) -> Path:
    """A results bundle as `python -m study` writes it, reduced to what the demo reads: the world's checksums, a
    control run's record, the report's control, its validity gain and one comparison, the carried backbone."""
    bundle, control = root / "bundle", "negatives-with_method-clip_ft_seed-0"
    write_json(bundle / "sweep" / "sweep.json", {
        "world": world_checksums(world, ["val", "test"]),
        "runs": [{"name": control, "choices": {"method": "method-clip_ft", "negatives": "negatives-with"}}]})
    write_json_gz(bundle / "sweep" / "runs" / f"{control}.json.gz", {"config": {"trainer.max_steps": 600}})
    gain = {metric: {"mean": mean, "low": mean - 4, "high": mean + 4} for metric, mean in
            (("group", 32.9), ("acc_relation", 20.7))}
    comparison = {"method": "cae_attention", "negatives": "with", "reference": "clip_ft (with)", "split": "test",
                  "metric": "group"}
    write_json(bundle / "sweep" / "report.json", {
        "validity": {"control": {"method": "clip_ft", "negatives": "with"}, "splits": {"test": {"gain": gain}},
                     "passed": True},
        "comparisons": [{**comparison, "estimate": -2.5, "low": -3.7, "high": -1.4, "n_seeds": 3,
                         "seed_t": {"estimate": -2.5, "low": -4.0, "high": -1.0}}],
        "claims": {"read": [comparison]}})
    weights = backbone / "export" / "open_clip.pt"
    carry_backbone(bundle, "sweep", {"path": str(backbone / "export"), "sha256": file_sha256(weights)})
    return bundle


def test_the_demo_table_end_to_end_on_a_tiny_world(tmp_path, monkeypatch, capsys):
    world = tmp_path / "world"
    generate(world, n_train=4, n_val=6, image_size=64, seed=0, n_swap=6)
    export_random(tmp_path / "trained", 1, steps=5)
    tiny_bundle(tmp_path, world, export_random(tmp_path / "pretrained", 0))
    monkeypatch.chdir(tmp_path)  # relative paths, as make demo passes them
    rows = ["runs.pretrained=pretrained", "runs.clip_ft=trained", "runs.cae_attention=trained"]
    assert main(["--check", "--bundle", "bundle", "--data-root", "world", rows[0]]) == {}
    results = main(["--bundle", "bundle", "--data-root", "world", "--out", "out/results.json", *rows])
    printed = capsys.readouterr().out
    assert list(results) == ["pretrained", "clip_ft", "cae_attention"]
    assert results["pretrained"].scores["images"] == 6 and len(results["pretrained"].swap) == 6  # the test split
    assert -100.0 <= results["clip_ft"].scores["attr_gap"] <= 100.0
    table = [line for line in printed.splitlines() if line.startswith("| ")]
    assert len(table) == 4 and table[1].startswith("| pretrained | - |")
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    paired = document["clip_ft"]["paired"]["group"]
    assert paired["items"] == 6 and paired["wins"] + paired["losses"] <= 6 and 0.0 <= paired["p"] <= 1.0
    assert f"| clip_ft | 5 | {results['clip_ft'].scores['group']:.1f} | {paired['mean']:+.1f} [" in printed
    assert "The positive control `clip_ft` gains" in printed  # the bundle's control, named in words
    assert "at full budget (600 steps, 3 seeds" in printed
    assert "clip_ft (with), the positive control, over the pretrained backbones: swap group +32.9 [+28.9, " \
           "+36.9], 2-way relation +20.7 [+16.7, +24.7]" in printed
    assert "testbed validity: every check passes" in printed
    assert "cae_attention (with) - clip_ft (with), swap group: -2.5 [-3.7, -1.4] (items x seeds bootstrap; " \
           "seed-level t -2.5 [-4.0, -1.0]): a claim" in printed


def test_another_world_or_backbone_stops_the_demo_before_training(tmp_path):
    world = tmp_path / "world"
    generate(world, n_train=4, n_val=4, image_size=64, seed=0, n_swap=4)
    pretrained, other = export_random(tmp_path / "pretrained", 0), export_random(tmp_path / "other", 1)
    bundle = tiny_bundle(tmp_path, world, pretrained)
    with pytest.raises(SystemExit, match="other.*not the backbone"):
        main(["--check", "--bundle", str(bundle), "--data-root", str(world), f"runs.pretrained={other}"])
    swap = world / "annotations" / "swap_test.json"
    swap.write_text(swap.read_text() + " ")
    with pytest.raises(SystemExit, match=r"not the world of .*swap_test.json: other contents"):
        main(["--check", "--bundle", str(bundle), "--data-root", str(world), f"runs.pretrained={pretrained}"])


def outcomes(groups: str) -> dict:
    """Swap outcomes of relation items whose group flags are `groups` ('1' right): text_i0/i1 follow the group."""
    return {str(k): {"id": str(k), "type": "relation", "text_i0": int(g), "text_i1": int(g), "image_c0": int(g),
                     "image_c1": int(g), "text": int(g), "image": int(g), "group": int(g), "tie": 0}
            for k, g in enumerate(groups)}


def test_paired_counts_the_discordant_items_with_an_exact_sign_test():
    reference, row = Row({}, outcomes("0000011000")), Row({}, outcomes("1111010000"))
    paired = compare(row, reference, "group", resamples=200)
    assert (paired.wins, paired.losses, paired.items) == (4, 1, 10)
    assert paired.difference.estimate == pytest.approx(30.0)  # 50 % - 20 % of the items
    assert paired.difference.low <= 30.0 <= paired.difference.high
    assert paired.p_value == pytest.approx(sign_test(4, 1))
    relation = compare(row, reference, "acc_relation", resamples=200)
    assert relation.wins is None and relation.difference.estimate == pytest.approx(30.0)


@pytest.mark.parametrize("wins,losses", [(0, 0), (4, 1), (24, 7), (7, 24), (10, 10), (0, 12)])
def test_the_sign_test_against_counting_every_outcome_as_extreme(wins, losses):
    n = wins + losses
    extreme = sum(math.comb(n, k) for k in range(n + 1) if min(k, n - k) <= min(wins, losses))
    assert sign_test(wins, losses) == pytest.approx(min(1.0, extreme / 2 ** n))


def test_the_headline_is_the_committed_reports():
    """Every number and verdict of the headline is the committed report's, none written by hand."""
    report = json.loads((BUNDLE / "sweep" / "report.json").read_text())
    lines = study_headline(BUNDLE, ["cae_attention", "macco", "smartclip"], "test")
    assert len(lines) == 6 and lines[0].startswith("The committed study at full budget (600 steps, 3 seeds")
    gain = report["validity"]["splits"]["test"]["gain"]["group"]
    assert f"swap group {gain['mean']:+.1f} [{gain['low']:+.1f}, {gain['high']:+.1f}]" in lines[1]
    assert ("every check passes" in lines[2]) == bool(report["validity"]["passed"])
    claims = report["claims"]["read"]
    for line, method in zip(lines[3:], ["cae_attention", "macco", "smartclip"]):
        c = next(c for c in report["comparisons"] if (c["method"], c["negatives"], c["metric"], c["split"],
                                                      c["reference"]) == (method, "with", "group", "test",
                                                                          "clip_ft (with)"))
        assert line.startswith(f"  {method} (with) - clip_ft (with), swap group: {c['estimate']:+.1f} [")
        is_claim = any(all(claim[k] == c[k] for k in ("method", "negatives", "reference", "split", "metric"))
                       for claim in claims)
        assert line.endswith(": a claim" if is_claim else ": no claim")


def test_a_row_scored_with_sgi_and_the_run_syntax(tmp_path):
    from study.demo import parse_args, parse_run

    args = parse_args(["runs.sgi=runs/x@sgi", "--data-root", "world", "runs.ft=runs/y"])
    assert [parse_run(label, target) for label, target in args.runs.items()] == [
        ("sgi", Path("runs/x"), "sgi"), ("ft", Path("runs/y"), "clip")]
    with pytest.raises(SystemExit, match="unknown scorer"):
        parse_run("a", "runs/z@nope")
    generate(tmp_path / "shapes", n_train=4, n_val=4, image_size=64, seed=0, n_swap=4)
    export_random(tmp_path, 0)
    result = evaluate_export(tmp_path / "export", tmp_path / "shapes", scorer_name="sgi")
    assert "group" in result.scores and "i2t_r1" in result.scores and "attr_gap" not in result.scores
    table = markdown_table({"sgi": result}, {}, "sgi")
    assert "| sgi | - | " in table and table.rstrip().endswith(" - |")  # the gap is CLIP's only


def test_the_demo_trains_every_fine_tuning_method_from_the_studys_backbone_at_one_budget():
    """configs/sweeps/demo.yaml: the study's recipes and hard negatives, its carried backbone and world, one budget
    and learning rate for every row; the Makefile's table scores every run against that backbone."""
    from core.config import REPO_ROOT, load_config
    from slurm.sweep import load_sweep

    runs = load_sweep(REPO_ROOT / "configs" / "sweeps" / "demo.yaml").runs
    configs = {run.name: load_config(run.configs, run.overrides) for run in runs}
    assert {cfg.method.name for cfg in configs.values()} == {"clip_ft", "clip_cae", "macco", "smartclip"}
    assert {(cfg.trainer.max_steps, cfg.data.batch_size, cfg.optim.lr, cfg.optim.min_lr_ratio, cfg.model.pretrained,
             cfg.data.root, cfg.method.hard_negatives.captions) for cfg in configs.values()} == {
        (150, 64, 3e-4, 1.0, "runs/study/backbones/seed-0/export", "data/study", 3)}
    recipe = (REPO_ROOT / "Makefile").read_text().split("\ndemo:")[1].split("\n\n")[0]
    assert "runs.pretrained=runs/study/backbones/seed-0 " in recipe
    assert all(f"runs/demo/{name} " in recipe or recipe.endswith(f"runs/demo/{name}") for name in configs)
