"""Rendering: a scene drawn as pixels, and the phrases of a true caption located in its text and in the image."""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageDraw

from datamodules.shapes.world import BACKGROUND, COLORS, Caption, Scene, SceneObject, render_caption, witness

def _phrase(text: str, kind: str, span: tuple[int, int], boxes: list) -> dict[str, Any]:
    start, end = span
    return {"text": text[start:end], "type": kind, "char_span": [start, end], "boxes": boxes}


def caption_phrases(scene: Scene, caption: Caption) -> list[dict[str, Any]]:
    """Ground-truth phrases of a true caption: one attribute phrase per object, one relation phrase.

    Args:
        scene: The scene the caption is true of.
        caption: A structured caption.

    Returns:
        Phrase dicts with "text", "type", "char_span" and "boxes"; a relation phrase spans from its first
        to its last slot and its boxes are [subject box, object box].
    """
    text, spans = render_caption(caption)
    subject, obj = witness(scene, caption)
    phrases = [_phrase(text, "attribute", spans["s"], [list(subject.bbox)])]
    if obj is None:
        return phrases
    relation_span = (min(spans[k][0] for k in "sro"), max(spans[k][1] for k in "sro"))
    phrases.append(_phrase(text, "attribute", spans["o"], [list(obj.bbox)]))
    phrases.append(_phrase(text, "relation", relation_span, [list(subject.bbox), list(obj.bbox)]))
    return phrases


def draw_scene(scene: Scene) -> Image.Image:
    """Draw `scene` as an RGB image, each object filling its box without anti-aliasing.

    Args:
        scene: The scene to draw.

    Returns:
        The image, `scene.image_size` pixels square.
    """
    image = Image.new("RGB", (scene.image_size, scene.image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        _draw_object(draw, obj)
    return image


def _draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    x0, y0, x1, y1 = obj.bbox
    # PIL's shape coordinates are inclusive, the box's right and bottom edges are not.
    right, bottom = x1 - 1, y1 - 1
    middle_x, middle_y = (x0 + right) / 2, (y0 + bottom) / 2
    fill = COLORS[obj.color]
    if obj.shape == "square":
        draw.rectangle((x0, y0, right, bottom), fill=fill)
    elif obj.shape == "circle":
        draw.ellipse((x0, y0, right, bottom), fill=fill)
    elif obj.shape == "triangle":
        draw.polygon([(middle_x, y0), (right, bottom), (x0, bottom)], fill=fill)
    else:
        draw.polygon([(middle_x, y0), (right, middle_y), (middle_x, bottom), (x0, middle_y)], fill=fill)
