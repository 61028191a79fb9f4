"""LoRA adapters on the CLIP towers, through peft (`model.lora` in a config; docs/methods.md#lora).

Each targeted linear layer W of a tower block becomes peft's `lora.Linear`: W x + (alpha / rank) B A dropout(x)
with A [rank, in] (Kaiming-uniform) and B [out, rank] (zeros). A zero B adds exact zeros, so training starts from
the backbone's function. Its values equal the backbone's bit for bit only where the explicit attention that a wrapped
`out_proj` runs (below) uses the same kernels as `nn.MultiheadAttention`'s training path: tests/test_lora.py checks
that for the tiny test model in float32 on the CPU; in general (a larger model such as ViT-B/32, eval mode's fused
inference kernel, a GPU) the two agree up to float rounding. Adapters need a trained backbone (`model.pretrained`):
on random weights they adapt nothing learnt, so fit refuses them.

The targets are the block's linear layers (`TARGETS`): the attention's output projection and the two MLP layers.
The attention's query / key / value projection is not one: `nn.MultiheadAttention` holds it as a bare packed
parameter that the explicit attention paths (`modeling.encoders`) read directly, and peft's wrappers for it act only
inside `nn.MultiheadAttention.forward`, which those paths do not call; it stays frozen.

`nn.MultiheadAttention.forward` reads `out_proj.weight` directly too, skipping a wrapped `out_proj`'s own forward:
`modeling.encoders` therefore runs a block whose `out_proj` carries an adapter through its explicit attention, and
whatever runs the open_clip model's own `encode_image` / `encode_text` (the evaluation scorers) gets `merged(model)`,
a plain copy with the adapters folded into the weights, as the export writes it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from torch import nn

# The towers' transformers in an open_clip CLIP, and the targets' paths inside one of their blocks.
TOWERS: Dict[str, str] = {"image": "visual.transformer", "text": "transformer"}
TARGETS: Dict[str, str] = {"out_proj": "attn.out_proj", "c_fc": "mlp.c_fc", "c_proj": "mlp.c_proj"}
ADAPTER_NAME = "default"  # peft's name of the one adapter a model carries


@dataclass(frozen=True)
class TowerShape:
    """What the adapters of one tower depend on: its width, its number of blocks and its MLP's hidden width."""

    width: int
    layers: int
    mlp_width: int

    def target_features(self, target: str) -> Tuple[int, int]:
        """(in, out) features of a block's `target` layer."""
        return {"out_proj": (self.width, self.width), "c_fc": (self.width, self.mlp_width),
                "c_proj": (self.mlp_width, self.width)}[target]


def tower_shapes(model_config: Mapping) -> Dict[str, TowerShape]:
    """Each tower's shape from an open_clip model config (its defaults filled in by open_clip's own dataclasses)."""
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    vision, text = CLIPVisionCfg(**model_config["vision_cfg"]), CLIPTextCfg(**model_config["text_cfg"])
    return {"image": TowerShape(vision.width, vision.layers, int(vision.width * vision.mlp_ratio)),
            "text": TowerShape(text.width, text.layers, int(text.width * text.mlp_ratio))}


def chosen_blocks(layers: Optional[Sequence[int]], count: int) -> List[int]:
    """The block indices `layers` names (negative from the end; None = all) in a tower of `count` blocks."""
    if layers is None:
        return list(range(count))
    return sorted({index % count for index in layers})


def lora_setting_problems(lora: Mapping, model_config: Optional[Mapping]) -> List[str]:
    """What is wrong with a `model.lora` section for a model of `model_config` (empty when it is off or fine)."""
    if lora["rank"] == 0:
        return []
    problems = _setting_problems(lora)
    if problems or model_config is None:
        return problems
    shapes = tower_shapes(model_config)
    for tower in lora["towers"]:
        shape = shapes[tower]
        bad = [index for index in lora["layers"] or () if not -shape.layers <= index < shape.layers]
        if bad:
            problems.append(f"model.lora.layers: {bad} not among the {shape.layers} blocks of the {tower} tower "
                            f"(0..{shape.layers - 1}, or negative from the end)")
        for target in lora["targets"]:
            features = shape.target_features(target)
            if lora["rank"] > min(features):
                problems.append(f"model.lora.rank={lora['rank']} is larger than the {tower} tower's {target} layer "
                                f"({features[0]} -> {features[1]} features): a rank of at most {min(features)}")
    return problems


def _setting_problems(lora: Mapping) -> List[str]:
    problems = []
    if lora["rank"] < 0:
        problems.append(f"model.lora.rank={lora['rank']}: give 0 (off) or a positive rank")
    if lora["alpha"] <= 0:
        problems.append(f"model.lora.alpha={lora['alpha']}: the scaling alpha / rank needs a positive alpha")
    if not 0 <= lora["dropout"] < 1:
        problems.append(f"model.lora.dropout={lora['dropout']}: a probability in [0, 1)")
    if lora["layers"] is not None and not lora["layers"]:
        problems.append("model.lora.layers=[]: name one or more blocks, or null for every block")
    for key, allowed in (("towers", TOWERS), ("targets", TARGETS)):
        unknown = [name for name in lora[key] if name not in allowed]
        if unknown or not lora[key]:
            problems.append(f"model.lora.{key}={list(lora[key])}: choose one or more of {', '.join(allowed)}")
    return problems


def adapted_module_names(model: nn.Module, lora: Mapping) -> List[str]:
    """The dotted names of the linear layers of `model` that `lora` adapts."""
    names = []
    for tower in lora["towers"]:
        blocks = model.get_submodule(TOWERS[tower]).resblocks
        for index in chosen_blocks(lora["layers"], len(blocks)):
            names += [f"{TOWERS[tower]}.resblocks.{index}.{TARGETS[target]}" for target in lora["targets"]]
    return names


def add_lora(model: nn.Module, lora: Mapping) -> nn.Module:
    """Freeze every parameter of the open_clip CLIP `model` and put peft's LoRA adapters on the layers `lora`
    names (in place; returns `model`). Raises ValueError naming what does not fit the model."""
    import peft  # here: a second or more to import, and only runs with adapters need it

    problems = _setting_problems(lora)
    names = [] if problems else adapted_module_names(model, lora)
    for name in names:
        layer = model.get_submodule(name)
        if not isinstance(layer, nn.Linear):
            problems.append(f"{name} is a {type(layer).__name__}, not a linear layer")
        elif lora["rank"] > min(layer.in_features, layer.out_features):
            problems.append(f"model.lora.rank={lora['rank']} is larger than {name} ({layer.in_features} -> "
                            f"{layer.out_features} features)")
    if problems:
        raise ValueError("; ".join(problems))
    model.requires_grad_(False)
    config = peft.LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                             target_modules=names, bias="none")
    return peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)


def is_adapter_layer(module: nn.Module) -> bool:
    """Whether `module` is a layer peft wrapped with an adapter (it holds `lora_A`)."""
    return "lora_A" in module._modules


def adapter_layers(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    return ((name, module) for name, module in model.named_modules() if is_adapter_layer(module))


def has_adapters(model: nn.Module) -> bool:
    return next(adapter_layers(model), None) is not None


def merged(model: nn.Module) -> nn.Module:
    """A copy of `model` with every adapter folded into its layer's weight (W + (alpha / rank) B A) and the wrapper
    replaced by that plain layer: an open_clip model whose state dict has open_clip's own keys. `model` itself is
    unchanged. A model without adapters is returned as it is."""
    if not has_adapters(model):
        return model
    plain = copy.deepcopy(model)
    for name, layer in list(adapter_layers(plain)):
        layer.merge(safe_merge=True)  # refuses a non-finite result
        parent, _, child = name.rpartition(".")
        setattr(plain.get_submodule(parent), child, layer.get_base_layer())
    return plain


def adapter_parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
