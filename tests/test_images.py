"""parsers/images.py, the one image decoder: its decoding on real files in tmp_path, and every reader of images in the
project (grounding, the feature cache, the COCO datamodule, the benchmarks, explain) decoding through it."""
from __future__ import annotations

import ast
import configparser
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
from PIL import Image

from parsers.images import MAX_ASPECT_RATIO, image_shape_problem, read_rgb_file, rgb_image

RNG = np.random.default_rng(0)
GRAY = RNG.integers(0, 256, (12, 20), dtype=np.uint8)
COLOUR = RNG.integers(0, 256, (12, 20, 3), dtype=np.uint8)


def pixels(image: Image.Image) -> np.ndarray:
    assert image.mode == "RGB"
    return np.asarray(image)


def test_a_16_bit_png_decodes_to_its_8_bit_version(tmp_path):
    Image.fromarray(GRAY).save(tmp_path / "8.png")
    Image.fromarray(GRAY.astype(np.uint16) * 257).save(tmp_path / "16.png")  # 0..65535: the same picture
    with Image.open(tmp_path / "16.png") as image:
        assert image.mode == "I;16"  # what PIL's own convert("RGB") clips to white
    sixteen, eight = (pixels(read_rgb_file(str(tmp_path / name))) for name in ("16.png", "8.png"))
    assert np.array_equal(sixteen, eight)


def test_16_bit_values_round_to_the_nearest_8_bit_value():
    values = np.array([[0, 128, 129, 257, 385, 386, 65535]], dtype=np.uint16)
    expected = np.array([0, 0, 1, 1, 1, 2, 255], dtype=np.uint8)  # round(v / 257)
    assert np.array_equal(pixels(rgb_image(Image.fromarray(values)))[0, :, 0], expected)


def test_32_bit_integer_mode_holding_16_bit_values_is_scaled_too():
    image = Image.fromarray(GRAY.astype(np.int32) * 257)  # how older Pillow opens a 16-bit PNG
    assert np.array_equal(pixels(rgb_image(image)), np.repeat(GRAY[..., None], 3, axis=2))


@pytest.mark.parametrize("mode", ["L", "P", "LA", "RGBA", "CMYK", "1"])
def test_8_bit_modes_decode_as_pil_converts_them(tmp_path, mode):
    source = Image.fromarray(GRAY if mode in ("L", "1") else COLOUR)
    image = source.convert(mode)
    path = tmp_path / f"image.{'jpg' if mode == 'CMYK' else 'png'}"
    image.save(path, **({"quality": 100} if mode == "CMYK" else {}))
    with Image.open(path) as reopened:
        assert reopened.mode == mode
        expected = reopened.convert("RGB")
    assert np.array_equal(pixels(read_rgb_file(str(path))), np.asarray(expected))


def test_images_without_a_known_brightness_range_are_refused():
    with pytest.raises(ValueError, match="float"):
        rgb_image(Image.fromarray(GRAY.astype(np.float32) / 255))
    with pytest.raises(ValueError, match="16-bit range"):
        rgb_image(Image.fromarray(GRAY.astype(np.int32) * 1000))


def test_shape_problems():
    assert image_shape_problem((640, 480)) is None and image_shape_problem((640, 480), (640, 480), 7) is None
    assert "annotations record 480x640" in image_shape_problem((640, 480), (480, 640))
    assert "shorter than 7" in image_shape_problem((1, 1), None, 7)
    assert image_shape_problem((1, 1)) is None  # no patch grid given
    assert "aspect ratio" in image_shape_problem((10000, 10))
    assert "aspect ratio" in image_shape_problem((10, 10000))
    assert image_shape_problem((int(MAX_ASPECT_RATIO * 50), 50)) is None  # the limit itself is accepted


def test_a_benchmark_image_inside_a_zip_archive_decodes_and_a_missing_member_is_named(tmp_path):
    """ELEVATER's images stay in their archives (`<archive>.zip@<member>`): read from there, errors name both."""
    import io
    import zipfile

    from evaluation.benchmarks.base import ImageRef
    from evaluation.benchmarks.images import UnreadableImageError, load_image

    buffer = io.BytesIO()
    Image.new("RGB", (6, 4), (10, 200, 30)).save(buffer, format="PNG")
    with zipfile.ZipFile(tmp_path / "test.zip", "w") as archive:
        archive.writestr("images/a.png", buffer.getvalue())
    image = load_image(ImageRef(str(tmp_path / "test.zip"), member="images/a.png"))
    assert image.size == (6, 4) and image.getpixel((0, 0)) == (10, 200, 30)
    with pytest.raises(UnreadableImageError, match=r"test\.zip \(images/b\.png\).*holds no member 'images/b\.png'"):
        load_image(ImageRef(str(tmp_path / "test.zip"), member="images/b.png"))
    (tmp_path / "broken.zip").write_bytes(b"not a zip")
    with pytest.raises(UnreadableImageError, match=r"broken\.zip.*not a readable zip archive"):
        load_image(ImageRef(str(tmp_path / "broken.zip"), member="images/a.png"))


def test_a_bgr_npy_frame_decodes_to_rgb(tmp_path):
    from evaluation.benchmarks.base import ImageRef
    from evaluation.benchmarks.images import load_image

    frame = np.zeros((4, 6, 3), dtype=np.uint8)
    frame[..., 0] = 255  # blue, stored first (BGR)
    np.save(tmp_path / "frame.npy", frame)
    assert load_image(ImageRef(str(tmp_path / "frame.npy"))).getpixel((0, 0)) == (0, 0, 255)


# ----- one decoder: every reader of image files in the project decodes through parsers/images.py ---------------
BOX = (2, 3, 10, 6)  # (x, y, w, h): the crop a benchmark ImageRef may carry, taken after decoding


def _written(tmp_path, kind: str):
    """An image file of `kind` and the 8-bit RGB pixels it must decode to."""
    if kind == "16-bit grayscale":
        path = tmp_path / "image.png"
        Image.fromarray(GRAY.astype(np.uint16) * 257).save(path)  # PIL's own convert("RGB") clips this to white
        return path, np.repeat(GRAY[..., None], 3, axis=2)
    mode = kind.split()[0]
    path = tmp_path / f"image.{'jpg' if mode == 'CMYK' else 'png'}"
    Image.fromarray(COLOUR).convert(mode).save(path, **({"quality": 100} if mode == "CMYK" else {}))
    with Image.open(path) as reopened:
        assert reopened.mode == mode
        return path, np.asarray(reopened.convert("RGB"))  # right for 8-bit modes (see parsers/images.py)


def _array(image) -> torch.Tensor:
    """A transform that keeps the decoded pixels: what a reader hands its transform is what is compared."""
    assert image.mode == "RGB"
    return torch.from_numpy(np.array(image))


def _size(path):
    with Image.open(path) as image:
        return image.size


def _grounding(path, tmp_path):
    from parsers.grounding import GroundingRequest, ImageReader

    reader = ImageReader()
    image = reader._read(GroundingRequest(str(path), ["a phrase"], annotated_size=_size(path)))
    assert image is not None, reader.unreadable_images
    return _array(image)


def _feature_cache(path, tmp_path):
    from datamodules.features import _ImageFiles

    pixels, readable = _ImageFiles([str(path)], _array, on_bad_image="error")[0]
    assert readable
    return pixels


def _coco_datamodule(path, tmp_path):
    import json

    import open_clip

    from datamodules.coco import CocoCaptions

    width, height = _size(path)
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps({"images": [{"id": 1, "file_name": path.name, "width": width, "height": height}],
                                    "annotations": [{"id": 1, "image_id": 1, "caption": "a picture"}]}))
    data = CocoCaptions(captions, path.parent, open_clip.get_tokenizer("ViT-B-32"), _array)
    return data[0]["image"]


def _benchmark_file(path, tmp_path):
    from evaluation.benchmarks.base import ImageRef
    from evaluation.benchmarks.images import load_image

    return _array(load_image(ImageRef(str(path))))


def _benchmark_zip_member(path, tmp_path):
    import zipfile

    from evaluation.benchmarks.base import ImageRef
    from evaluation.benchmarks.images import load_image

    with zipfile.ZipFile(tmp_path / "images.zip", "w") as archive:
        archive.writestr(f"images/{path.name}", path.read_bytes())
    return _array(load_image(ImageRef(str(tmp_path / "images.zip"), member=f"images/{path.name}")))


def _benchmark_parquet_cell(path, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from evaluation.benchmarks.base import ImageRef
    from evaluation.benchmarks.images import image_file_name, load_image

    cells = [{"bytes": b"", "path": "other.png"}, {"bytes": path.read_bytes(), "path": path.name}]
    pq.write_table(pa.table({"image": cells}), tmp_path / "test.parquet")  # the Hugging Face image feature
    ref = ImageRef(str(tmp_path / "test.parquet"), member="image:1")
    assert image_file_name(ref) == path.name
    return _array(load_image(ref))


def _explain(path, tmp_path):
    from evaluation.explain import read_image

    return _array(read_image(path))


READERS = {"grounding": _grounding, "feature cache": _feature_cache, "COCO datamodule": _coco_datamodule,
           "benchmark file": _benchmark_file, "benchmark zip member": _benchmark_zip_member,
           "benchmark parquet cell": _benchmark_parquet_cell, "explain": _explain}


@pytest.mark.parametrize("kind", ["16-bit grayscale", "P (paletted)", "LA", "CMYK"])
@pytest.mark.parametrize("reader", READERS)
def test_every_reader_decodes_an_image_file_to_the_same_pixels(tmp_path, reader, kind):
    """A reader with a decoder of its own (`Image.open(...).convert("RGB")`) clips the 16-bit image to white."""
    path, expected = _written(tmp_path, kind)
    assert np.array_equal(READERS[reader](path, tmp_path).numpy(), expected)


@pytest.mark.parametrize("kind", ["16-bit grayscale", "P (paletted)"])
def test_a_benchmark_crop_is_taken_after_decoding(tmp_path, kind):
    from evaluation.benchmarks.base import ImageRef
    from evaluation.benchmarks.images import load_image

    path, expected = _written(tmp_path, kind)
    x, y, w, h = BOX
    crop = np.asarray(load_image(ImageRef(str(path), box=BOX)))
    assert np.array_equal(crop, expected[y:y + h, x:x + w])


def test_a_benchmark_image_that_does_not_decode_names_itself(tmp_path):
    """`rgb_image`'s refusals (a float image) reach the benchmark harness as an unreadable image, like PIL's own."""
    from evaluation.benchmarks.base import ImageRef
    from evaluation.benchmarks.images import UnreadableImageError, load_image

    Image.fromarray(GRAY.astype(np.float32)).save(tmp_path / "float.tiff")
    with pytest.raises(UnreadableImageError, match=r"float\.tiff.*float"):
        load_image(ImageRef(str(tmp_path / "float.tiff")))


# Libraries that decode image files themselves: importing one is a second decoder beside parsers/images.py.
OTHER_DECODERS = ("cv2", "imageio", "skimage.io", "torchvision.io")
REPO_ROOT = Path(__file__).resolve().parents[1]


def project_packages() -> List[str]:
    """Every package of the project: the root packages setup.cfg's import-linter contracts cover."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(REPO_ROOT / "setup.cfg")
    return config["importlinter"]["root_packages"].split()


def _own_decoding(tree: ast.AST) -> List[int]:
    """Lines that decode an image file without parsers/images.py: PIL's `Image.open(...)`, a `.convert("RGB")`,
    or an import of another decoding library."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            opens = node.func.attr == "open" and isinstance(node.func.value, ast.Name) and node.func.value.id == "Image"
            converts = (node.func.attr == "convert" and node.args and isinstance(node.args[0], ast.Constant)
                        and node.args[0].value == "RGB")
            if opens or converts:
                lines.append(node.lineno)
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(name == lib or name.startswith(lib + ".") for name in names for lib in OTHER_DECODERS):
            lines.append(node.lineno)
    return lines


def test_no_module_but_parsers_images_decodes_image_files():
    """The reader tests above cover the paths that exist; this finds a new one that decodes on its own."""
    packages = project_packages()
    assert {"parsers", "datamodules", "evaluation", "lightning_modules", "perf", "study"} <= set(packages)
    own = [f"{path.relative_to(REPO_ROOT)}:{line}" for package in packages
           for path in sorted((REPO_ROOT / package).rglob("*.py")) if path != REPO_ROOT / "parsers" / "images.py"
           for line in _own_decoding(ast.parse(path.read_text()))]
    assert not own, "decode with parsers.images (read_rgb_file, read_rgb_bytes, read_npy_frame): " + ", ".join(own)


def test_the_search_for_other_decoders_finds_them():
    decoding = "from PIL import Image\nimport cv2\nImage.open(p).convert('RGB')\nx = image.convert(\"RGB\")\n"
    assert sorted(_own_decoding(ast.parse(decoding))) == [2, 3, 3, 4]
    assert _own_decoding(ast.parse("image.convert('L')\nread_rgb_file(p)\n")) == []
