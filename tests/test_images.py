"""Image decoding shared by grounding and training (parsers/images.py), on real files in tmp_path."""
from __future__ import annotations

import numpy as np
import pytest
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
