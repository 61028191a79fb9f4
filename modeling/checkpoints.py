"""Reading published CLIP checkpoints into open_clip state dicts that load strictly.

Compositional CLIPs are published in a handful of layouts: a plain open_clip `state_dict()` or an open_clip
training checkpoint (NegCLIP, CE-CLIP, FSC-CLIP, MACCO), keys under a wrapper's prefix (DDP's `module.`, a
LightningModule's attribute, torch.compile's `_orig_mod.`), the OpenAI `clip` package's state dict (GNM-CLIP,
partly fp16) or TorchScript archive, and full state dicts carrying unmerged LoRA factors (DAC, TSVLC, FSC-CLIP
LoRA). Each reader in `FORMATS` turns one layout into an open_clip-keyed float32 state dict; `read_checkpoint`
then checks that it fits the target model exactly (keys, shapes, text context), and `load_strict` loads it.
Nothing is ever matched loosely: a file whose keys do not fit raises `CheckpointMismatch` naming them.
"""
from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from open_clip.utils import to_2tuple
from torch import Tensor, nn

log = logging.getLogger(__name__)

PathLike = Union[str, Path]
StateDict = Dict[str, Tensor]
Shapes = Dict[str, torch.Size]

MAX_LISTED = 8  # keys named per category in an error; the counts are always complete
# Entries of OpenAI's TorchScript archives that are architecture facts, not weights (clip.model.build_model drops
# them too), each with the reading of the target model it must agree with.
OPENAI_METADATA = ("input_resolution", "context_length", "vocab_size")
# DAC, TSVLC and FSC-CLIP construct every LoRA layer with loralib's default alpha of 1: scale = alpha / rank.
LORA_ALPHA = 1.0
# Container keys under which checkpoints hold the model's state dict: open_clip training checkpoints and Lightning
# checkpoints ("state_dict"), the OpenAI-package training loop of GNM-CLIP ("model_state_dict").
TRAINING_CONTAINERS = ("state_dict",)
OPENAI_CONTAINERS = ("model_state_dict", "state_dict")
LIGHTNING_VERSION_KEY = "pytorch-lightning_version"
# The key whose prefixes are tried when looking for the one that makes a wrapped file fit (ViT and ResNet CLIPs
# both have it; any other architecture falls back to its first key).
ANCHOR_KEY = "visual.conv1.weight"


class CheckpointMismatch(ValueError):
    """A checkpoint's keys or shapes do not fit the architecture it is loaded into."""


class BaseMismatch(ValueError):
    """The base weights a LoRA checkpoint carries are not the base it is being applied to."""


class BaseRequired(ValueError):
    """A LoRA checkpoint holding the factors alone, read without the base weights they apply to."""


class UntrustedPickle(ValueError):
    """A checkpoint pickles objects other than tensors, and the caller did not allow unpickling them."""


# ---------------------------------------------------------------------------------------------------------------
# Loading files


def torch_load(path: PathLike, trust_pickle: bool = False) -> Any:
    """`torch.load` on the CPU, restricted to tensors and plain containers unless the caller trusts the file.

    Some published training checkpoints (FSC-CLIP) pickle numpy scalars beside the weights, which the restricted
    unpickler refuses; unpickling them in full can run code from the file, so it needs `trust_pickle=True`.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if not trust_pickle:
            refused = re.search(r"GLOBAL (\S+) was not an allowed global", str(error))
            what = f"e.g. {refused.group(1)}" if refused else "refused by torch.load(weights_only=True)"
            raise UntrustedPickle(f"{path} pickles objects other than tensors ({what}); unpickling them can run "
                                  f"code from the file. If the file comes from a source you trust, read it with "
                                  f"trust_pickle=True") from error
        log.warning("%s: unpickling in full (trust_pickle=True)", path)
        return torch.load(path, map_location="cpu", weights_only=False)
    except RuntimeError as error:
        if "TorchScript" in str(error):
            raise ValueError(f"{path} is a TorchScript archive: read it with format 'torchscript'") from error
        raise


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(isinstance(value, Tensor) for value in obj.values())


def unwrap(obj: Any, containers: Sequence[str], source: str) -> StateDict:
    """The state dict inside a checkpoint: `obj` itself, or `obj[container]` for the first container key it has."""
    if _is_state_dict(obj):
        return dict(obj)
    if isinstance(obj, Mapping):
        for container in containers:
            if container in obj and _is_state_dict(obj[container]):
                return dict(obj[container])
    found = sorted(map(str, obj)) if isinstance(obj, Mapping) else type(obj).__name__
    raise CheckpointMismatch(f"{source}: neither a state dict nor a checkpoint holding one under "
                             f"{' or '.join(map(repr, containers))}; found {found}")


def as_float32(state: Mapping[str, Tensor]) -> StateDict:
    """Floating tensors cast to float32 (OpenAI's weights are stored partly in fp16); others unchanged."""
    return {key: value.float() if value.is_floating_point() else value for key, value in state.items()}


# ---------------------------------------------------------------------------------------------------------------
# Fitting keys to a model


def expected_shapes(model: nn.Module) -> Shapes:
    """The persistent keys of `model` and their shapes (non-persistent buffers such as `attn_mask` are absent)."""
    return {key: value.shape for key, value in model.state_dict().items()}


def _listing(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:MAX_LISTED])
    return shown + (f", ... ({len(keys) - MAX_LISTED} more)" if len(keys) > MAX_LISTED else "")


def describe_mismatch(expected: Shapes, state: Mapping[str, Tensor],
                      names: Tuple[str, str] = ("checkpoint", "model")) -> Optional[str]:
    """What keeps `state` from loading strictly into a model with `expected` keys and shapes (None: nothing);
    `names` label the two sides' shapes."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    reshaped = sorted(key for key in set(expected) & set(state) if tuple(state[key].shape) != tuple(expected[key]))
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing: {_listing(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected: {_listing(unexpected)}")
    if reshaped:
        shapes = [f"{key} ({names[0]} {list(state[key].shape)}, {names[1]} {list(expected[key])})"
                  for key in reshaped]
        parts.append(f"{len(reshaped)} of another shape: {_listing(shapes)}")
    return "; ".join(parts) or None


def check_fits(model: nn.Module, state: Mapping[str, Tensor], source: str = "the state dict") -> None:
    """Raise `CheckpointMismatch` unless `state` has exactly the model's keys, each with the model's shape."""
    expected = expected_shapes(model)
    problem = describe_mismatch(expected, state)
    if problem is None:
        return
    hint = ""
    fitting = [prefix for prefix in _prefix_candidates(state, expected)
               if prefix and not _prefix_problem(state, expected, prefix, others_allowed=False)]
    if fitting:
        hint = f" (the keys fit under the prefix {fitting[0]!r}: read the file with format 'wrappers')"
    raise CheckpointMismatch(f"{source} does not fit the model: {problem}{hint}")


def load_strict(model: nn.Module, state_dict: Mapping[str, Tensor]) -> nn.Module:
    """Load `state_dict` into `model` strictly, after naming every missing, unexpected or reshaped key."""
    check_fits(model, state_dict)
    model.load_state_dict(state_dict, strict=True)
    return model


def _anchor(expected: Shapes) -> str:
    return ANCHOR_KEY if ANCHOR_KEY in expected else min(expected)


def _prefix_candidates(state: Mapping[str, Tensor], expected: Shapes) -> List[str]:
    """Every prefix (ending in a dot, or empty) that some key of `state` carries before the model's anchor key."""
    anchor = _anchor(expected)
    prefixes = {key[: -len(anchor)] for key in state if key.endswith(anchor)}
    return sorted(prefix for prefix in prefixes if prefix == "" or prefix.endswith("."))


def _prefix_problem(state: Mapping[str, Tensor], expected: Shapes, prefix: str,
                    others_allowed: bool) -> Optional[Tuple[List[str], List[str]]]:
    """(missing, unexpected) keys when `prefix` is stripped, None when the keys then equal the model's.

    Keys outside the prefix are unexpected unless `others_allowed` (a LightningModule's other attributes)."""
    stripped = {key[len(prefix):] for key in state if key.startswith(prefix)}
    outside = [] if others_allowed else [key for key in state if not key.startswith(prefix)]
    missing = sorted(set(expected) - stripped)
    unexpected = sorted(stripped - set(expected)) + sorted(outside)
    return (missing, unexpected) if missing or unexpected else None


def strip_prefix(state: Mapping[str, Tensor], expected: Shapes, source: str, prefix: Optional[str] = None,
                 others_allowed: bool = False) -> StateDict:
    """The keys of `state` under the one prefix whose stripping makes them equal the model's keys.

    Exactly one consistent prefix is stripped, and only when the stripped key set equals the model's: a prefix
    that fits part of the keys is refused, and so is a choice between several fitting prefixes (name one with
    `prefix`). Keys outside the prefix are refused unless `others_allowed`.
    """
    candidates = [prefix] if prefix is not None else _prefix_candidates(state, expected) or [""]
    problems = {candidate: _prefix_problem(state, expected, candidate, others_allowed) for candidate in candidates}
    fitting = [candidate for candidate, problem in problems.items() if problem is None]
    if len(fitting) > 1:
        raise CheckpointMismatch(f"{source}: the keys fit the model under several prefixes ({fitting}); name the "
                                 f"one to read with the option prefix=...")
    if not fitting:
        best = min(problems, key=lambda candidate: sum(map(len, problems[candidate])))
        missing, unexpected = problems[best]
        raise CheckpointMismatch(f"{source}: no single key prefix makes the keys equal the model's; the closest, "
                                 f"{best!r}, leaves {len(missing)} missing ({_listing(missing)}) and "
                                 f"{len(unexpected)} unexpected ({_listing(unexpected)})")
    chosen = fitting[0]
    outside = [key for key in state if not key.startswith(chosen)]
    if outside:
        log.info("%s: keeping the keys under %r, leaving %d other keys (%s)", source, chosen, len(outside),
                 _listing(sorted(outside)))
    return {key[len(chosen):]: value for key, value in state.items() if key.startswith(chosen)}


# ---------------------------------------------------------------------------------------------------------------
# Text context length (CLoVe keeps 64 of OpenAI's 77 positions)


def fit_context_length(state_dict: Mapping[str, Tensor], context_length: int) -> Mapping[str, Tensor]:
    """Return `state_dict` when its text positional embedding has `context_length` rows, else refuse.

    A shorter table is not stretched: open_clip's `resize_text_pos_embed` interpolates it, which moves every
    position the text tower was trained on. The model must be built with the checkpoint's context instead. A
    longer table is cut only on request (`truncate_context`).
    """
    table = state_dict.get("positional_embedding")
    if table is None or table.shape[0] == context_length:
        return state_dict
    rows = table.shape[0]
    if rows < context_length:
        raise CheckpointMismatch(
            f"the checkpoint's text positional embedding has {rows} rows, the model's text context is "
            f"{context_length}: build the model with the checkpoint's context (open_clip.create_model(name, "
            f"force_context_length={rows})) and tokenize to {rows} tokens; stretching the table would move every "
            f"position")
    raise CheckpointMismatch(
        f"the checkpoint's text positional embedding has {rows} rows, the model's text context is "
        f"{context_length}: cut it deliberately with truncate_context(state_dict, {context_length}) if texts of "
        f"at most {context_length} tokens are meant")


def truncate_context(state_dict: Mapping[str, Tensor], n: int) -> StateDict:
    """A copy of `state_dict` whose text positional embedding keeps its first `n` rows (positions 0..n-1).

    With a causal text tower pooled at EOS, a text of at most `n` tokens sees only these rows, so its features
    are unchanged; this is how CLoVe's OpenAI side is prepared for WiSE-FT at context 64.
    """
    table = state_dict["positional_embedding"]
    if table.shape[0] < n:
        raise CheckpointMismatch(f"cannot keep {n} rows of a text positional embedding of {table.shape[0]}")
    return {**state_dict, "positional_embedding": table[:n].clone()}


def wise_ft(a: Mapping[str, Tensor], b: Mapping[str, Tensor], weight_b: float) -> StateDict:
    """WiSE-FT weight-space ensembling: (1 - weight_b) * a + weight_b * b, key by key (Wortsman et al. 2022).

    Every key is mixed, the logit scale and positional embeddings included (CLoVe's `patch_model` does the same:
    0.4 * OpenAI + 0.6 * CLoVe). Computed in float64, returned in `a`'s dtypes.
    """
    if not 0.0 <= weight_b <= 1.0:
        raise ValueError(f"weight_b={weight_b} is not in [0, 1]")
    shapes_a = {key: value.shape for key, value in a.items()}
    problem = describe_mismatch(shapes_a, b, names=("second", "first"))
    if problem is not None:
        raise CheckpointMismatch(f"WiSE-FT needs state dicts with the same keys and shapes; the second has {problem}")
    mixed = {}
    for key, value in a.items():
        if not value.is_floating_point():
            if not torch.equal(value, b[key]):
                raise CheckpointMismatch(f"WiSE-FT: the non-floating tensor {key} differs between the state dicts")
            mixed[key] = value.clone()
            continue
        mixed[key] = ((1.0 - weight_b) * value.double() + weight_b * b[key].double()).to(value.dtype)
    return mixed


# ---------------------------------------------------------------------------------------------------------------
# Readers of the published layouts


def read_open_clip(path: PathLike, model: Optional[nn.Module] = None, trust_pickle: bool = False) -> StateDict:
    """A plain open_clip `model.state_dict()` file, or an open_clip training checkpoint holding one under
    "state_dict" (`{"epoch", "name", "state_dict", "optimizer", ...}`); the keys are taken as they are."""
    return as_float32(unwrap(torch_load(path, trust_pickle), TRAINING_CONTAINERS, str(path)))


def _require_model(model: Optional[nn.Module], fmt: str) -> nn.Module:
    if model is None:
        raise ValueError(f"format {fmt!r} needs the target model (model=...) to check the file against")
    return model


def read_wrapped(path: PathLike, model: Optional[nn.Module] = None, prefix: Optional[str] = None,
                 trust_pickle: bool = False) -> StateDict:
    """Keys under one wrapper prefix: DDP's `module.`, torch.compile's `_orig_mod.`, a Lightning checkpoint's
    `<attribute>.` (whatever attribute the LightningModule held the CLIP in), or a combination of them.

    The prefix is the one whose stripping makes the key set equal the model's (`strip_prefix`). A Lightning
    checkpoint may hold the module's other attributes beside the CLIP; those keys are left out. The state dict
    may sit inside an open_clip training or Lightning checkpoint.
    """
    expected = expected_shapes(_require_model(model, "wrappers"))
    checkpoint = torch_load(path, trust_pickle)
    lightning = isinstance(checkpoint, Mapping) and LIGHTNING_VERSION_KEY in checkpoint
    state = unwrap(checkpoint, TRAINING_CONTAINERS, str(path))
    return as_float32(strip_prefix(state, expected, str(path), prefix, others_allowed=lightning))


def _metadata_expected(model: nn.Module) -> Dict[str, Any]:
    """The target model's values of OpenAI's metadata entries, in the archives' terms."""
    shapes = expected_shapes(model)
    return {"input_resolution": to_2tuple(model.visual.image_size),
            "context_length": shapes["positional_embedding"][0],
            "vocab_size": shapes["token_embedding.weight"][0]}


def drop_openai_metadata(state: Mapping[str, Tensor], model: Optional[nn.Module], source: str) -> StateDict:
    """`state` without OpenAI's `input_resolution`/`context_length`/`vocab_size` entries, after checking that
    each agrees with the target model (image size, text context, vocabulary)."""
    present = [key for key in OPENAI_METADATA if key in state]
    if not present:
        return dict(state)
    wanted = _metadata_expected(_require_model(model, "openai metadata"))
    for key in present:
        value = int(state[key])
        found = to_2tuple(value) if key == "input_resolution" else value
        if found != wanted[key]:
            raise CheckpointMismatch(f"{source}: {key} is {value} in the checkpoint but {wanted[key]} in the model")
    return {key: value for key, value in state.items() if key not in OPENAI_METADATA}


def read_openai(path: PathLike, model: Optional[nn.Module] = None, trust_pickle: bool = False) -> StateDict:
    """The OpenAI `clip` package's state dict (the key names of open_clip's CLIP), possibly fp16 and possibly
    inside a training checkpoint under "model_state_dict" (GNM-CLIP) or "state_dict"; cast to float32."""
    state = unwrap(torch_load(path, trust_pickle), OPENAI_CONTAINERS, str(path))
    return as_float32(drop_openai_metadata(state, model, str(path)))


def read_torchscript(path: PathLike, model: Optional[nn.Module] = None) -> StateDict:
    """An OpenAI TorchScript archive (what `clip.load(..., jit=True)` downloads): its state dict, without the
    metadata entries once they are checked against the model; cast to float32."""
    try:
        archive = torch.jit.load(str(path), map_location="cpu")
    except RuntimeError as error:
        raise ValueError(f"{path} is not a TorchScript archive ({str(error).splitlines()[0]}); a pickled state "
                         f"dict reads with format 'openai'") from error
    state = archive.state_dict()
    return as_float32(drop_openai_metadata(state, _require_model(model, "torchscript"), str(path)))


# LoRA layout of DAC, TSVLC and FSC-CLIP (one loralib variant): a linear or conv layer `X` keeps `X.weight` and adds
# `X.lora_A` / `X.lora_B`; the packed attention input projection `X.in_proj_weight` adds `X.in_proj_weight_lora_A` /
# `_lora_B`. The merged weight is W + scale * (B @ A), viewed as W's shape for a convolution.
LORA_FACTORS = ("A", "B")


def lora_target(key: str) -> Optional[Tuple[str, str]]:
    """(the weight a LoRA factor adapts, "A" or "B") for a LoRA key, None for any other key."""
    for factor in LORA_FACTORS:
        if key.endswith(f"_lora_{factor}"):
            return key[: -len(f"_lora_{factor}")], factor
        if key.endswith(f".lora_{factor}"):
            return key[: -len(f".lora_{factor}")] + ".weight", factor
    return None


def split_lora(state: Mapping[str, Tensor], source: str) -> Tuple[StateDict, Dict[str, Dict[str, Tensor]]]:
    """(base tensors, {adapted weight: {"A": tensor, "B": tensor}}), refusing a factor without its partner."""
    base, factors = {}, {}
    for key, value in state.items():
        target = lora_target(key)
        if target is None:
            if "lora" in key.rsplit(".", 1)[-1]:
                raise CheckpointMismatch(f"{source}: {key} is a LoRA tensor of a layout this reader does not know")
            base[key] = value
        else:
            factors.setdefault(target[0], {})[target[1]] = value
    unpaired = sorted(f"{target} (lora_{'B' if 'A' in pair else 'A'} missing)"
                      for target, pair in factors.items() if len(pair) != 2)
    if unpaired:
        raise CheckpointMismatch(f"{source}: {len(unpaired)} LoRA factors without their partner: {_listing(unpaired)}")
    return base, factors


def lora_rank(target: str, weight: Tensor, a: Tensor, b: Tensor) -> int:
    """The rank of the factors of `weight`, after checking their shapes against loralib's layout.

    Linear [out, in]: A [r, in], B [out, r]. Conv [out, in, k, k]: A [r*k, in*k], B [out*k, r*k], so that
    (B @ A) [out*k, in*k] views as the kernel.
    """
    if weight.dim() == 2:
        rank, (out_features, in_features) = a.shape[0], weight.shape
        shapes = ((rank, in_features), (out_features, rank))
    elif weight.dim() == 4 and weight.shape[-1] == weight.shape[-2]:
        kernel = weight.shape[-1]
        rank = a.shape[0] // kernel
        shapes = ((rank * kernel, weight.shape[1] * kernel), (weight.shape[0] * kernel, rank * kernel))
    else:
        raise CheckpointMismatch(f"LoRA factors on {target}, a tensor of shape {list(weight.shape)}")
    if rank == 0 or (tuple(a.shape), tuple(b.shape)) != shapes:
        raise CheckpointMismatch(f"LoRA factors of {target} {list(weight.shape)} have shapes A {list(a.shape)}, "
                                 f"B {list(b.shape)}; expected A {list(shapes[0])}, B {list(shapes[1])}")
    return rank


def merge_lora(base: Mapping[str, Tensor], factors: Mapping[str, Mapping[str, Tensor]],
               lora_scale: Optional[float] = None, source: str = "LoRA") -> StateDict:
    """`base` with every adapted weight replaced by W + scale * (B @ A) (in float64, returned as float32).

    `scale` defaults to alpha / rank with the published alpha of 1 (0.25 at rank 4)."""
    merged = as_float32(base)
    for target, pair in sorted(factors.items()):
        if target not in merged:
            raise CheckpointMismatch(f"{source}: LoRA factors for {target}, which the base does not have")
        weight, a, b = merged[target], pair["A"], pair["B"]
        rank = lora_rank(target, weight, a, b)
        scale = lora_scale if lora_scale is not None else LORA_ALPHA / rank
        delta = (b.double() @ a.double()).view(weight.shape)
        merged[target] = (weight.double() + scale * delta).float()
    return merged


def _same_weights(stored: Tensor, given: Optional[Tensor]) -> bool:
    """Whether `given` is the tensor `stored` was saved from, allowing for storage in a narrower float type:
    both are compared in the narrower of their dtypes, up to its rounding."""
    if given is None or stored.shape != given.shape:
        return False
    if not (stored.is_floating_point() and given.is_floating_point()):
        return torch.equal(stored, given)
    narrow = max(stored.dtype, given.dtype, key=lambda dtype: torch.finfo(dtype).eps)
    return torch.allclose(stored.to(narrow).float(), given.to(narrow).float(), rtol=torch.finfo(narrow).eps, atol=0.0)


def check_base(stored: Mapping[str, Tensor], base: Mapping[str, Tensor], source: str) -> None:
    """Raise `BaseMismatch` unless every base tensor the file carries equals the given base's."""
    differing = sorted(key for key, value in stored.items() if not _same_weights(value, base.get(key)))
    if differing:
        raise BaseMismatch(f"{source}: {len(differing)} of {len(stored)} base tensors differ from the given base "
                           f"({_listing(differing)}); the LoRA factors were trained on another base")


def _lora_prefix(state: Mapping[str, Tensor], source: str) -> str:
    """The one prefix (`module.` of DDP, or none) that every key of a LoRA file carries."""
    anchors = ("visual.conv1.weight", "visual.conv1.lora_A")
    prefixes = {key[: -len(anchor)] for key in state for anchor in anchors if key.endswith(anchor)}
    consistent = [prefix for prefix in prefixes if all(key.startswith(prefix) for key in state)]
    if len(consistent) != 1:
        found = sorted(prefixes) or "none"
        raise CheckpointMismatch(f"{source}: no single prefix carried by every key before visual.conv1 (found "
                                 f"{found})")
    return consistent[0]


def read_lora(path: PathLike, model: Optional[nn.Module] = None, base: Optional[Mapping[str, Tensor]] = None,
              lora_scale: Optional[float] = None, trust_pickle: bool = False) -> StateDict:
    """A state dict with unmerged LoRA factors (DAC, TSVLC, FSC-CLIP LoRA), merged into plain weights.

    The published files are full state dicts: the frozen base weights plus `lora_A`/`lora_B` on every block's
    packed attention input projection, attention output projection and MLP layers in both towers, and on
    `visual.conv1`; possibly inside a training checkpoint and under DDP's `module.`. A file of the factors alone
    needs `base` (an open_clip state dict). When both are there, the file's base must be the given one
    (`BaseMismatch` otherwise): factors trained on one base mean nothing on another.
    """
    source = str(path)
    state = unwrap(torch_load(path, trust_pickle), TRAINING_CONTAINERS, source)
    prefix = _lora_prefix(state, source)
    stored, factors = split_lora({key[len(prefix):]: value for key, value in state.items()}, source)
    if not factors:
        raise CheckpointMismatch(f"{source} holds no LoRA factors: read it with format 'open_clip'")
    if not stored and base is None:
        raise BaseRequired(f"{source} holds LoRA factors only: give the base they were trained on (base=...)")
    if stored and base is not None:
        check_base(stored, base, source)
    return merge_lora(stored or base, factors, lora_scale, source)


Reader = Callable[..., StateDict]
FORMATS: Dict[str, Reader] = {
    "open_clip": read_open_clip,
    "wrappers": read_wrapped,
    "openai": read_openai,
    "torchscript": read_torchscript,
    "lora": read_lora,
}


def read_checkpoint(path: PathLike, fmt: str, model: nn.Module, **options: Any) -> StateDict:
    """Read a checkpoint of format `fmt` (a key of `FORMATS`) into a state dict that loads strictly into `model`.

    The reader sees the model (prefix detection, OpenAI metadata checks); the result is checked for the model's
    text context (`fit_context_length`) and its exact keys and shapes (`CheckpointMismatch` otherwise).
    `options` go to the reader: `trust_pickle`, `prefix` (wrappers), `base` and `lora_scale` (lora).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; known formats: {', '.join(FORMATS)}")
    state = FORMATS[fmt](path, model=model, **options)
    shapes = expected_shapes(model)
    if "positional_embedding" in shapes:
        fit_context_length(state, shapes["positional_embedding"][0])
    check_fits(model, state, f"{path} (format {fmt!r})")
    return state
