"""The leakage guard sees COCO images under other names: BiVLC's embedded photos (by their recorded file names),
Visual Genome images (through VG's id map), identical files (by content); and it reports what it cannot see."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from evaluation import leakage
from evaluation.benchmarks import build_benchmark
from testkit.standin.aro import write_aro_vg_relation
from testkit.standin.two_by_two import write_bivlc
from testkit.standin.valse import write_valse
from testkit.standin.vlchecklist import write_vl_checklist
from testkit.standin.whatsup import write_whatsup_gqa_one

def coco_captions(path: Path, image_ids, names=None) -> Path:
    """A COCO captions file of `image_ids`, their files named `names` (default: COCO 2017 names)."""
    names = names or [f"{i:012d}.jpg" for i in image_ids]
    images = [{"id": i, "file_name": name} for i, name in zip(image_ids, names)]
    annotations = [{"id": n, "image_id": i, "caption": "a photo"} for n, i in enumerate(image_ids)]
    path.write_text(json.dumps({"images": images, "annotations": annotations}))
    return path


def run_guard(tmp_path: Path, train: Path, names: str, *extra: str) -> dict:
    """The guard's command line on benchmarks under `tmp_path / "bench"`, with the options their stand-ins
    returned (`tmp_path / "bench" / "<name>.options.json"`)."""
    options = []
    for name in names.split(","):
        written = tmp_path / "bench" / f"{name}.options.json"
        for key, value in (json.loads(written.read_text()) if written.is_file() else {}).items():
            options += [f"options.{name}.{key}={json.dumps(value)}"]
    return leakage.main(["--train", str(train), "--benchmarks", names, "--data-root", str(tmp_path / "bench"),
                         *options, *extra])


def write_standin(tmp_path: Path, name: str, write, **kwargs) -> dict:
    """A stand-in under `tmp_path / "bench" / name`; its options are kept for `run_guard`."""
    options = write(tmp_path / "bench" / name, **kwargs)
    (tmp_path / "bench" / f"{name}.options.json").write_text(json.dumps(options, default=str))
    return options


# ----- BiVLC ------------------------------------------------------------------------------------------------
def test_bivlc_coco_photos_are_found_by_their_embedded_file_names(tmp_path, capsys):
    """BiVLC's `image` column holds COCO val2017 photos inside parquet files; the file name recorded with each
    (`000000000005.jpg`) is its COCO id. The generated negatives are counted, never read as COCO."""
    write_bivlc(tmp_path / "bench" / "bivlc", n_items=12)
    benchmark = build_benchmark("bivlc", tmp_path / "bench" / "bivlc")
    assert benchmark.coco_image_ids() == set(range(12))
    train = coco_captions(tmp_path / "train.json", [2, 5, 11, 500])
    exclusions = tmp_path / "out" / "exclude_image_ids.json"
    report = run_guard(tmp_path, train, "bivlc", "--out", str(tmp_path / "out"))["bivlc"]
    assert report["overlap"] == 3 and report["examples"] == [2, 5, 11] and report["coco_images"] == 12
    assert report["generated_images"] == 12 and report["unchecked"] == 0
    assert json.loads(exclusions.read_text()) == list(range(12))
    with pytest.raises(SystemExit) as exit_info:
        run_guard(tmp_path, train, "bivlc", "--fail-on-overlap")
    assert exit_info.value.code == 1
    assert "| bivlc | 12 | 3 |" in capsys.readouterr().out


# ----- Visual Genome ----------------------------------------------------------------------------------------
VG_BENCHMARKS = {"aro_vg_relation": write_aro_vg_relation, "whatsup_gqa_one": write_whatsup_gqa_one,
                 "valse": write_valse, "vl_checklist": write_vl_checklist}


@pytest.fixture()
def vg_benchmarks(tmp_path) -> dict:
    """Stand-ins of every benchmark with Visual Genome images, and each one's VG ids as the guard reads them."""
    built = {}
    for name, write in VG_BENCHMARKS.items():
        options = write_standin(tmp_path, name, write, n_items=8)
        built[name] = build_benchmark(name, tmp_path / "bench" / name, **options)
    return built


def vg_ids(benchmark) -> set:
    return set(leakage.image_census(benchmark).visual_genome)


def test_every_visual_genome_naming_is_recognised(vg_benchmarks):
    """ARO's `images/<id>.jpg`, GQA's `vg_images/<id>.jpg`, Visual7W's `v7w_<id>.jpg`, VG's `VG_100K*/<id>.jpg`."""
    assert vg_ids(vg_benchmarks["aro_vg_relation"]) == {2315375, 2315376, 2315377}
    assert vg_ids(vg_benchmarks["whatsup_gqa_one"]) == {100000, 100001, 100002, 100003}
    assert len(vg_ids(vg_benchmarks["valse"])) == 7  # existence and counting pieces
    assert {2361911, 2361912} <= vg_ids(vg_benchmarks["vl_checklist"])


@pytest.mark.parametrize("form", ["image_data", "mapping"])
def test_visual_genome_images_planted_in_training_are_found_with_the_id_map(tmp_path, vg_benchmarks, form, capsys):
    """Each benchmark's first VG image is a COCO image (coco_id 900000 + k) that the training set holds; its
    second is a COCO image that it does not hold; the others are VG images that are not COCO images. Without the
    map none is seen and the report says why; with it (VG's image_data.json, or a plain mapping) each is found."""
    coco_of = {}
    for k, benchmark in enumerate(vg_benchmarks.values()):
        first, second = sorted(vg_ids(benchmark))[:2]
        coco_of[first], coco_of[second] = 900000 + k, 950000 + k
    every_vg = set().union(*map(vg_ids, vg_benchmarks.values()))
    if form == "image_data":  # VG's own file: every VG image, coco_id null for most
        document = [{"image_id": vg, "url": f"https://cs.stanford.edu/VG_100K/{vg}.jpg", "width": 800,
                     "height": 600, "coco_id": coco_of.get(vg), "flickr_id": None} for vg in sorted(every_vg)]
    else:
        document = {str(vg): coco_of.get(vg) for vg in every_vg}
    vg_map = tmp_path / "image_data.json"
    vg_map.write_text(json.dumps(document))
    train = coco_captions(tmp_path / "train.json", [900000 + k for k in range(len(VG_BENCHMARKS))] + [999999])
    names = ",".join(VG_BENCHMARKS)

    blind = run_guard(tmp_path, train, names)
    assert all(row["overlap"] == 0 for row in blind.values())
    for name, row in blind.items():
        assert row["visual_genome_unmapped"] == len(vg_ids(vg_benchmarks[name])) > 0
    out = capsys.readouterr().out
    assert "not checked" in out and "--vg-image-data" in out
    for name in VG_BENCHMARKS:
        assert f"- {name}: {blind[name]['visual_genome_unmapped']} Visual Genome images" in out

    exclusions = tmp_path / "out" / "exclude_image_ids.json"
    seen = run_guard(tmp_path, train, names, "--vg-image-data", str(vg_map), "--out", str(tmp_path / "out"))
    for k, name in enumerate(VG_BENCHMARKS):
        assert seen[name]["overlap"] == 1 and seen[name]["examples"] == [900000 + k]
        assert seen[name]["visual_genome_coco"] == 2 and seen[name]["visual_genome_unmapped"] == 0
    assert {900000 + k for k in range(4)} | {950000 + k for k in range(4)} <= set(json.loads(exclusions.read_text()))
    assert "Visual Genome images" not in capsys.readouterr().out  # all mapped: nothing VG left unchecked


def test_a_partial_id_map_reports_the_images_it_lacks(tmp_path, vg_benchmarks, capsys):
    vg_map = tmp_path / "partial.json"
    vg_map.write_text(json.dumps({"2315375": 4}))
    train = coco_captions(tmp_path / "train.json", [4])
    row = run_guard(tmp_path, train, "aro_vg_relation", "--vg-image-data", str(vg_map))["aro_vg_relation"]
    assert row["overlap"] == 1 and row["visual_genome_unmapped"] == 2 and row["unchecked"] == 2
    assert f"2 Visual Genome images, absent from {vg_map}" in capsys.readouterr().out


@pytest.mark.parametrize("content", ['{"images": []}x', '[{"url": "a"}]', '"a string"'])
def test_a_malformed_id_map_is_refused_in_one_line_before_any_work(tmp_path, content):
    vg_map = tmp_path / "bad.json"
    vg_map.write_text(content)
    with pytest.raises(SystemExit, match=r"--vg-image-data .*bad\.json.*image_data\.json") as error:
        leakage.main(["--train", str(tmp_path / "absent.json"), "--benchmarks", "sugarcrepe",
                      "--vg-image-data", str(vg_map)])
    assert "\n" not in str(error.value)


# ----- what it cannot see --------------------------------------------------------------------------------------
def test_the_report_lists_what_it_could_not_check(tmp_path, vg_benchmarks, capsys):
    """VALSE's SWiG and VisDial-2018 images are named by neither COCO nor VG: listed as not checked, with
    examples; a benchmark of COCO images only has no such line."""
    from testkit.standin.sugarcrepe import write_sugarcrepe

    write_sugarcrepe(tmp_path / "bench" / "sugarcrepe", n_items=7)
    train = coco_captions(tmp_path / "train.json", [1])
    report = run_guard(tmp_path, train, "valse,sugarcrepe", "--out", str(tmp_path))
    out = capsys.readouterr().out
    assert report["valse"]["other_images"] == 14 and report["valse"]["unchecked"] == 14 + 7
    assert "- valse: 14 images named by neither COCO nor Visual Genome, not compared (--hash-images" in out
    assert "/swig/" in out  # an example: the action pieces' SWiG images
    assert "- sugarcrepe" not in out and report["sugarcrepe"]["unchecked"] == 0
    stored = json.loads((tmp_path / "overlap_report.json").read_text())
    assert stored["valse"]["other_examples"] == report["valse"]["other_examples"]
    others = stored["valse"]["other_examples"]
    assert all("/swig/" in example or "VisualDialog_val2018" in example for example in others)
    assert all("v7w_" in example for example in stored["valse"]["visual_genome_unmapped_examples"])


def test_help_says_what_the_guard_cannot_see(capsys):
    with pytest.raises(SystemExit) as exit_info:
        leakage.parse_args(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse re-wraps the option help
    for words in ("What it cannot see", "--vg-image-data", "VALSE existence and counting (Visual7W)",
                  "What'sUp GQA-spatial", "VL-CheckList's vg and vaw sources", "ARO VG-Relation and VG-Attribution",
                  "--hash-images", "identical files only", "BiVLC"):
        assert words in out, words


def test_fit_guard_warns_about_visual_genome_images_it_cannot_check(vg_benchmarks, caplog):
    with caplog.at_level(logging.INFO, logger="evaluation.leakage"):
        leakage.check_training_overlap({1}, {"aro_vg_relation": vg_benchmarks["aro_vg_relation"]}, False, "train")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("aro_vg_relation has 3 Visual Genome images" in message for message in warnings)
    vg_to_coco = {2315375: 1, 2315376: None, 2315377: None}
    with pytest.raises(leakage.TrainingOverlapError, match="^1 training images"):
        leakage.check_training_overlap({1}, {"aro_vg_relation": vg_benchmarks["aro_vg_relation"]}, False, "train",
                                       vg_to_coco)


# ----- image contents ----------------------------------------------------------------------------------------
def test_identical_files_under_other_names_are_found_by_content_and_cached(tmp_path, capsys):
    """A Flickr30k-named benchmark image whose bytes are a training file's is found with --hash-images, and the
    training image's id goes to the exclusions; a second run reads every digest from the cache."""
    from testkit.standin.aro import write_aro_flickr_order

    options = write_standin(tmp_path, "aro_flickr_order", write_aro_flickr_order, n_items=10)
    benchmark = build_benchmark("aro_flickr_order", tmp_path / "bench" / "aro_flickr_order", **options)
    files = sorted({ref.path for ref in benchmark.image_refs()})
    images = tmp_path / "coco"
    (images / "train2014").mkdir(parents=True)
    shutil.copyfile(files[1], images / "train2014" / "COCO_train2014_000000000042.jpg")  # the same bytes
    (images / "train2014" / "COCO_train2014_000000000043.jpg").write_bytes(b"another image")
    train = coco_captions(tmp_path / "train.json", [42, 43, 44], [f"train2014/COCO_train2014_{i:012d}.jpg"
                                                                  for i in (42, 43, 44)])  # 44 is not on disk
    names = "aro_flickr_order"
    assert run_guard(tmp_path, train, names)[names]["unchecked"] == len(files)
    assert "content_overlap" not in run_guard(tmp_path, train, names)[names]
    with pytest.raises(SystemExit, match="--train-images"):
        run_guard(tmp_path, train, names, "--hash-images")

    cache, exclusions = tmp_path / "hashes.json", tmp_path / "out" / "exclude_image_ids.json"
    argv = ["--hash-images", "--train-images", str(images), "--hash-cache", str(cache)]
    report = run_guard(tmp_path, train, names, *argv, "--out", str(tmp_path / "out"))[names]
    assert report["overlap"] == 0 and report["content_overlap"] == 1 and report["content_examples"] == [files[1]]
    assert report["content_training_ids"] == [42] and json.loads(exclusions.read_text()) == [42]
    assert report["content_hashed"] == len(files) and report["content_missing"] == 0
    captured = capsys.readouterr()
    assert "1 training image files are not on disk" in captured.err and "compared by bytes only" in captured.out
    with pytest.raises(SystemExit):
        run_guard(tmp_path, train, names, *argv, "--fail-on-overlap")

    hashes = leakage.ContentHashes(cache)
    contents = leakage.training_contents(leakage.TrainingSet(
        leakage.read_annotation_file(str(train)), images), hashes, progress=False)
    leakage.leakage_report(set(), {names: benchmark}, contents=contents, hashes=hashes)
    assert hashes.hashed == 0 and contents.hashed == 2 and len(contents.missing) == 1  # all from the cache


def test_a_changed_file_is_hashed_again(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(b"one")
    hashes = leakage.ContentHashes(tmp_path / "cache.json")
    first = hashes.of_file(str(path))
    hashes.save()
    path.write_bytes(b"three")
    again = leakage.ContentHashes(tmp_path / "cache.json")
    assert again.of_file(str(path)) != first and again.hashed == 1
    assert again.of_file(str(tmp_path / "absent.jpg")) is None
