"""The backbone a run starts from, as its config's `model` section describes it (training builds it, and weight
interpolation rebuilds it as the pretrained end; evaluation/interpolation.py)."""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

from torch import Tensor

from modeling.encoders import BuiltModel, build_model
from modeling.long_context import STRETCH_DTYPES, stretch_text_context


def build_backbone(model: Mapping) -> Tuple[BuiltModel, Optional[Tensor]]:
    """The open_clip model of `model` (name, pretrained, config_dir), its text context stretched when
    `model.context_length` is longer than its own (long_context.py), without adapters.

    Returns the built model and the values of its frozen leading positions (None without a stretch).
    """
    built = build_model(model["name"], model["pretrained"], model["config_dir"])
    context_length = model.get("context_length")
    if not context_length or context_length == built.model.context_length:
        return built, None
    if context_length < built.model.context_length:
        raise ValueError(f"model.context_length={context_length} is shorter than {built.name}'s own "
                         f"{built.model.context_length}; the stretch only lengthens the text context")
    built = stretch_text_context(built, context_length, model["keep_positions"], STRETCH_DTYPES[model["stretch_dtype"]])
    return built, built.model.positional_embedding.detach()[: model["keep_positions"]].clone()
