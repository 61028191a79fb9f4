"""JSON forms of scenes and structured captions, and their inverses."""

from __future__ import annotations

from typing import Any

from datamodules.shapes.world import Caption, Description, Scene, SceneObject


def scene_to_dict(scene: Scene) -> dict[str, Any]:
    """JSON form of a scene: "width", "height" and "objects"."""
    objects = [
        {"id": obj.id, "shape": obj.shape, "color": obj.color, "size": obj.size, "bbox": list(obj.bbox)}
        for obj in scene.objects
    ]
    return {"width": scene.image_size, "height": scene.image_size, "objects": objects}


def scene_from_dict(record: dict[str, Any]) -> Scene:
    """Rebuild a scene from its JSON form (a scene-graph image record or a swap item's scene).

    Args:
        record: A dict with "width" and "objects".

    Returns:
        The scene.
    """
    objects = tuple(
        SceneObject(obj["id"], obj["shape"], obj["color"], obj["size"], tuple(obj["bbox"]))
        for obj in record["objects"]
    )
    return Scene(record["width"], objects)


def _description_to_dict(description: Description | None) -> dict[str, Any] | None:
    if description is None:
        return None
    return {"color": description.color, "shape": description.shape, "size": description.size}


def _description_from_dict(record: dict[str, Any] | None) -> Description | None:
    return None if record is None else Description(record["color"], record["shape"], record["size"])


def caption_to_dict(caption: Caption) -> dict[str, Any]:
    """JSON form of a structured caption: "template", "subject", "relation", "object", "wording"."""
    return {
        "template": caption.template,
        "subject": _description_to_dict(caption.subject),
        "relation": caption.relation,
        "object": _description_to_dict(caption.obj),
        "wording": caption.wording,
    }


def caption_from_dict(record: dict[str, Any]) -> Caption:
    """Rebuild a structured caption from its JSON form.

    Args:
        record: A dict as written by `caption_to_dict`.

    Returns:
        The caption.
    """
    return Caption(
        template=record["template"],
        subject=_description_from_dict(record["subject"]),
        relation=record["relation"],
        obj=_description_from_dict(record["object"]),
        wording=record["wording"],
    )
