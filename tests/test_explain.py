"""The explain CLI end to end on a tiny random model: PNG + JSON whose numbers match the attribution library."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import transforms

from modeling.encoders import CLIPEncoders, build_model
from modeling.export import export_model, load_export
from testkit.standin.images import write_image
from evaluation.figures import LAYOUT
from evaluation.explain import (display_image, explain, main, model_input, prepare_inputs,
                                                   token_pieces)
from modeling.attribution import (AttributionOptions, TextAttributionInputs, text_attribution,
                                                   word_end_table)

REPO = Path(__file__).resolve().parents[1]
MODEL = "ViT-Tiny-16-64"
# "zyxwvut" is split into several BPE pieces: only the last one carries the end-of-word mark.
CAPTION = "a red square left of a zyxwvut circle"
CAPTION_PIECES = ["a", "red", "square", "left", "of", "a", "zy", "x", "wv", "ut", "circle"]
SECOND_CAPTION = "a blue circle"
DPI = 100
DPI_PIXELS_WIDE, ROW_PIXELS_HIGH = 560, 480  # a panel of 5.6 x 4.8 inches per row (evaluation/figures.py)
PATCH = 16  # ViT-Tiny-16-64: 64 px input, a 4 x 4 patch grid
OPENAI_MEAN, OPENAI_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    built = build_model(MODEL, None, "configs/models")
    export_model(built.model, built.name, run / "export")
    return run


@pytest.fixture(scope="module")
def image_path(tmp_path_factory) -> Path:
    # not square: the validation transform's resize + centre crop are part of what is shown
    return write_image(tmp_path_factory.mktemp("images") / "scene.png", seed=0, size=(48, 40))


def reference_input(built, image: Image.Image, resize: str = "aspect") -> torch.Tensor:
    """The pixels the model explains: the validation transform ("square"), or Grad-ECLIP's input ("aspect", for
    images with sides up to 640): each side resized to the nearest multiple of the patch side (16), bicubic."""
    if resize == "square":
        return built.preprocess_val(image)
    width, height = image.size
    size = (int(height / PATCH + 0.5) * PATCH, int(width / PATCH + 0.5) * PATCH)
    return transforms.Compose([transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC),
                               transforms.ToTensor(), transforms.Normalize(OPENAI_MEAN, OPENAI_STD)])(image)


def official_centre_crop(image: Image.Image, size: int = 64) -> torch.Tensor:
    """The official Grad-ECLIP text explanation's image: CLIP's preprocessing (shorter side resized to the input
    size, bicubic; the centre square cropped; OpenAI's normalisation)."""
    return transforms.Compose([transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC),
                               transforms.CenterCrop(size), transforms.ToTensor(),
                               transforms.Normalize(OPENAI_MEAN, OPENAI_STD)])(image)


def reference_rows(export_dir: Path, image_path: Path, captions, method: str, options: AttributionOptions,
                   resize: str = "aspect", text_image: str = "centre_crop"):
    """Similarity and content-token attributions computed directly with the attribution library, of the image's
    official centre crop (`text_image="centre_crop"`) or of the image map's input (`"whole"`)."""
    built = load_export(export_dir)
    encoders = CLIPEncoders(built.model.eval())
    image_file = Image.open(image_path).convert("RGB")
    pixels = reference_input(built, image_file, resize) if text_image == "whole" else official_centre_crop(image_file)
    pixels = pixels.unsqueeze(0).repeat(len(captions), 1, 1, 1)
    ids = built.tokenizer(list(captions))
    image = F.normalize(encoders.encode_image(pixels, resize_positions=True).pooled.detach(), dim=-1)
    inputs = TextAttributionInputs(encoders, ids, image, encoders.encode_text(ids, attn=True),
                                   word_end_table(built.tokenizer, built.model.vocab_size))
    attribution, similarity = text_attribution(method, inputs, options).detach(), inputs.target.detach()
    eos = ids.argmax(dim=-1)
    return [(float(similarity[b]), attribution[b, 1: int(eos[b])].tolist()) for b in range(len(captions))]


def check_outputs(out: Path, rows: int, expected, stdout: str) -> dict:
    report = json.loads(out.with_suffix(".json").read_text())
    # a caption of more tokens than the narrowest panel holds widens the panels (tests/test_figures.py)
    wide = round(DPI * LAYOUT.width(max(len(row["tokens"]) for row in report["rows"])))
    with Image.open(out) as png:
        png.load()
        assert png.format == "PNG" and png.size == (max(DPI_PIXELS_WIDE, wide), ROW_PIXELS_HIGH * rows)
    assert len(report["rows"]) == rows
    for row, (similarity, attributions) in zip(report["rows"], expected):
        # a cosine: float32 rounding ~1e-7 of |a| |b| = 1 whatever its size, hence atol = rtol
        assert row["similarity"] == pytest.approx(similarity, rel=1e-5, abs=1e-5)
        # renormalised attributions (~1e-6 relative rounding); entries near 0 round like the largest one
        assert row["attributions"] == pytest.approx(attributions, rel=1e-5, abs=1e-5 * max(map(abs, attributions)))
        assert sum(row["attributions"]) == pytest.approx(1.0, rel=1e-5)
        assert len(row["tokens"]) == len(row["attributions"]) == len(row["token_ids"])
        assert f'"{row["text"]}"  S(I,T) = {row["similarity"]:.4f}' in stdout
    return report


@pytest.mark.parametrize("method, flags, options", [
    ("grad_eclip", ["--heads", "single", "--eclip-layers", "2"], AttributionOptions(heads="single", eclip_layers=2)),
    ("gradcam", ["--start-layer", "0"], AttributionOptions(start_layer=0)),
])
def test_run_end_to_end(run_dir, image_path, tmp_path, capsys, method, flags, options):
    out = tmp_path / "figures" / "pair.png"
    main(["--run", str(run_dir), "--image", str(image_path), "--text", CAPTION, "--text", SECOND_CAPTION,
          "--attribution", method, *flags, "--out", str(out)])
    expected = reference_rows(run_dir / "export", image_path, [CAPTION, SECOND_CAPTION], method, options)
    report = check_outputs(out, 2, expected, capsys.readouterr().out)
    assert report["rows"][0]["tokens"] == CAPTION_PIECES
    assert report["rows"][1]["tokens"] == ["a", "blue", "circle"]
    assert report["attribution"] == method and report["options"]["renormalise"] is True


def test_model_end_to_end_with_attention_options(run_dir, image_path, tmp_path, capsys):
    out = tmp_path / "attention.png"
    weights = run_dir / "export" / "open_clip.pt"
    main(["--model", MODEL, "--pretrained", str(weights), "--image", str(image_path), "--text", CAPTION,
          "--attribution", "attention", "--layers", "1", "--head-reduce", "max", "--out", str(out)])
    options = AttributionOptions(layers=[1], head_reduce="max")
    expected = reference_rows(run_dir / "export", image_path, [CAPTION], "attention", options)
    report = check_outputs(out, 1, expected, capsys.readouterr().out)
    assert report["rows"][0]["tokens"] == CAPTION_PIECES
    # the model's own layer-0 attention differs: the flags reached the attribution
    other = reference_rows(run_dir / "export", image_path, [CAPTION], "attention", AttributionOptions(layers=[0]))
    assert report["rows"][0]["attributions"] != pytest.approx(other[0][1], rel=1e-3, abs=1e-4)  # beyond rounding


@pytest.mark.parametrize("width, height, shape", [
    (96, 64, (64, 96)),  # already multiples of the patch
    (48, 40, (48, 48)),  # 2.5 patches round up
    (70, 20, (16, 64)),  # 1.25 and 4.375 patches round down
    (5, 30, (32, 16)),  # under half a patch: one patch
    (1000, 700, (640, 912)),  # shorter side over 640: 914 x 640 first, then 57 patches of 16 across
])
def test_aspect_input_keeps_the_image_and_rounds_its_sides_to_the_patch(width, height, shape):
    built = build_model(MODEL, None, "configs/models")
    image = Image.effect_mandelbrot((width, height), (-2, -1, 1, 1), 30).convert("RGB")
    pixels = model_input(built, image, "aspect")
    assert pixels.shape == (3, *shape)
    if max(width, height) <= 640:  # no shrink first: one bicubic resize straight to the rounded size
        expected = transforms.Compose([transforms.Resize(shape, interpolation=transforms.InterpolationMode.BICUBIC),
                                       transforms.ToTensor(), transforms.Normalize(OPENAI_MEAN, OPENAI_STD)])(image)
        assert torch.equal(pixels, expected)
    assert torch.equal(model_input(built, image, "square"), built.preprocess_val(image))


def test_non_square_image_is_explained_on_its_own_patch_grid(run_dir, tmp_path, capsys):
    wide = write_image(tmp_path / "wide.png", seed=1, size=(96, 64))
    out = tmp_path / "wide_map.png"
    main(["--run", str(run_dir), "--image", str(wide), "--text", CAPTION, "--heads", "single", "--out", str(out)])
    options = AttributionOptions(heads="single")
    expected = reference_rows(run_dir / "export", wide, [CAPTION], "grad_eclip", options)
    report = check_outputs(out, 1, expected, capsys.readouterr().out)
    assert report["resize"] == "aspect"
    # the map covers the whole 64 x 96 input (a 4 x 6 patch grid), not a square crop of it
    built = load_export(run_dir / "export")
    pixels, ids = prepare_inputs(built, Image.open(wide).convert("RGB"), [CAPTION], torch.device("cpu"))
    assert pixels.shape == (1, 3, 64, 96)
    (row,) = explain(built, pixels, ids, [CAPTION], "grad_eclip", options)
    assert row.heat_map.shape == (64, 96) and row.heat_map.min() >= 0 and row.heat_map.max() <= 1
    # --resize square: the validation transform's 64 x 64 centre crop, as before
    main(["--run", str(run_dir), "--image", str(wide), "--text", CAPTION, "--heads", "single", "--resize", "square",
          "--out", str(out)])
    square = reference_rows(run_dir / "export", wide, [CAPTION], "grad_eclip", options, resize="square")
    assert check_outputs(out, 1, square, capsys.readouterr().out)["resize"] == "square"
    # the text map's image is the centre crop whatever the heat map's input
    assert square[0][0] == pytest.approx(expected[0][0], rel=1e-5, abs=1e-5)
    main(["--run", str(run_dir), "--image", str(wide), "--text", CAPTION, "--heads", "single", "--text-image",
          "whole", "--out", str(out)])
    whole = reference_rows(run_dir / "export", wide, [CAPTION], "grad_eclip", options, text_image="whole")
    assert check_outputs(out, 1, whole, capsys.readouterr().out)["text_image"] == "whole"
    assert whole[0][0] != pytest.approx(expected[0][0], rel=1e-4, abs=1e-4)  # another input, another cosine


def test_the_text_map_explains_the_centre_crop_as_the_official_code_and_the_whole_image_on_request(run_dir, tmp_path,
                                                                                                    capsys):
    """Grad-ECLIP's text explanation scores the image through CLIP's preprocessing (the centre square); the image map
    sees the whole image. `--text-image whole` [ours] explains the similarity with the image map's input instead."""
    from evaluation.explain import centre_crop_input

    wide = write_image(tmp_path / "wide.png", seed=1, size=(96, 64))
    built = load_export(run_dir / "export")
    assert torch.equal(centre_crop_input(built, Image.open(wide).convert("RGB")),
                       official_centre_crop(Image.open(wide).convert("RGB")))
    reports = {}
    for text_image in ("centre_crop", "whole"):
        out = tmp_path / f"{text_image}.png"
        flags = [] if text_image == "centre_crop" else ["--text-image", text_image]  # centre_crop: the default
        main(["--run", str(run_dir), "--image", str(wide), "--text", CAPTION, "--eclip-layers", "2", *flags,
              "--out", str(out)])
        expected = reference_rows(run_dir / "export", wide, [CAPTION], "grad_eclip", AttributionOptions(eclip_layers=2),
                                  text_image=text_image)
        reports[text_image] = check_outputs(out, 1, expected, capsys.readouterr().out)
        assert reports[text_image]["text_image"] == text_image and reports[text_image]["resize"] == "aspect"
    crop, whole = (reports[key]["rows"][0] for key in ("centre_crop", "whole"))
    assert crop["similarity"] != pytest.approx(whole["similarity"], rel=1e-4, abs=1e-4)
    assert crop["attributions"] != pytest.approx(whole["attributions"], rel=1e-3, abs=1e-4)  # beyond rounding


def test_token_pieces_decode_bytes_and_strip_word_ends():
    tokenizer = build_model(MODEL, None, "configs/models").tokenizer
    assert token_pieces(tokenizer, tokenizer.encode("café zyxwvut")) == ["café", "zy", "x", "wv", "ut"]


def test_display_image_undoes_the_normalisation(image_path):
    built = build_model(MODEL, None, "configs/models")
    image = Image.open(image_path).convert("RGB")
    unnormalised = transforms.Compose([t for t in built.preprocess_val.transforms
                                       if not isinstance(t, transforms.Normalize)])(image)
    shown = display_image(built.preprocess_val(image), built.preprocess_val)
    assert shown.shape == (64, 64, 3)
    # pixels in [0, 1] (0 among them) through x * std + mean: ~1e-7 of 1
    assert torch.from_numpy(shown).permute(2, 0, 1) == pytest.approx(unnormalised, rel=1e-5, abs=1e-6)


def test_missing_image_exits(run_dir, tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        main(["--run", str(run_dir), "--image", str(tmp_path / "absent.png"), "--text", CAPTION])


def test_unreadable_image_exits_naming_it(run_dir, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image at all")
    with pytest.raises(SystemExit, match="broken.png"):
        main(["--run", str(run_dir), "--image", str(broken), "--text", CAPTION])


@pytest.mark.parametrize("caption", ["", "   "])
def test_empty_caption_exits(run_dir, image_path, tmp_path, caption):
    with pytest.raises(SystemExit, match="empty caption has no tokens to attribute"):
        main(["--run", str(run_dir), "--image", str(image_path), "--text", CAPTION, "--text", caption,
              "--out", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


def test_over_long_caption_warns_and_is_truncated(run_dir, image_path, tmp_path, capsys):
    out = tmp_path / "long.png"
    caption = " ".join(["red"] * 100)
    with pytest.warns(UserWarning, match="truncated"):
        main(["--run", str(run_dir), "--image", str(image_path), "--text", caption, "--out", str(out)])
    expected = reference_rows(run_dir / "export", image_path, [caption], "grad_eclip", AttributionOptions())
    report = check_outputs(out, 1, expected, capsys.readouterr().out)
    assert report["rows"][0]["tokens"] == ["red"] * 75  # context length 77 minus SOT and EOS


def test_help_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "evaluation.explain", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--attribution" in result.stdout and "grad_eclip" in result.stdout and "--heads" in result.stdout
