"""open_clip model construction and `CLIPEncoders`, which runs a CLIP's own submodules explicitly.

Methods need more than `encode_text`/`encode_image` return: projected per-token and per-patch features,
text attention probabilities that stay in the autograd graph (attribution losses), and the replacement of
token / patch embeddings by a learnable mask token before positional embeddings (MACCO). Running the
submodules one by one gives all of that without monkey-patching open_clip; tests check that the plain
outputs equal open_clip's own.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import open_clip
import torch
import torch.nn.functional as F
from open_clip.transformer import ResidualAttentionBlock, Transformer
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from core.config import CONFIGS_DIR, REPO_ROOT

log = logging.getLogger(__name__)

QUICKGELU_SUFFIX = "-quickgelu"
# Folder of an export (beside open_clip.pt) holding the open_clip model config it was built with.
MODEL_CONFIGS_DIR = "model_configs"


@dataclass
class TextFeatures:
    """Projected text features. `pooled` equals `model.encode_text` (unnormalised)."""

    pooled: Tensor  # [B, D], the projected EOS token
    tokens: Tensor  # [B, L, D], every position through ln_final and the text projection
    attentions: Optional[List[Tensor]] = None  # per layer [B, heads, L, L] softmax probabilities
    traces: Optional[List["AttentionTrace"]] = None  # per layer, with attn=True
    embeddings: Optional[Tensor] = None  # [B, L, width] token embeddings as used (after replacement)
    hidden: Optional[Tensor] = None  # [B, L, width] after ln_final, before the text projection
    block_inputs: Optional[List[Tensor]] = None  # per block [B, L, width], the residual stream entering it


@dataclass
class ImageFeatures:
    """Projected image features. `pooled` equals `model.encode_image` (unnormalised)."""

    pooled: Tensor  # [B, D], the projected CLS token
    patches: Tensor  # [B, P, D], every patch through ln_post and the visual projection
    traces: Optional[List["AttentionTrace"]] = None  # per layer, with attn=True
    grid_size: Optional[Tuple[int, int]] = None  # (rows, columns) of the patches, row-major in `patches`


@dataclass
class BuiltModel:
    model: nn.Module
    name: str  # canonical open_clip name (with -quickgelu for OpenAI-derived weights)
    preprocess_train: Callable
    preprocess_val: Callable
    tokenizer: Callable
    config: Optional[dict] = None  # the open_clip model config it was built from (written with an export)


def resolve_path(path: str) -> Path:
    """Relative paths in configs are relative to the working directory, else to the repository; `configs/...`
    (base.yaml's `model.config_dir`) is the installed package's copy when there is one."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    if candidate.parts[:1] == ("configs",):
        return CONFIGS_DIR.joinpath(*candidate.parts[1:])
    return REPO_ROOT / candidate


def register_model_configs(config_dir: Optional[str]) -> None:
    """Make the tiny test/demo model configs (JSON files) known to open_clip by their file stem."""
    if not config_dir:
        return
    directory = resolve_path(config_dir)
    if directory.is_dir() and directory not in open_clip.factory._MODEL_CONFIG_PATHS:
        open_clip.add_model_config(directory)


def _export_metadata(pretrained: str) -> Optional[dict]:
    """model.json written beside an exported checkpoint, if `pretrained` points at one."""
    path = Path(pretrained)
    meta = (path if path.is_dir() else path.parent) / "model.json"
    return json.loads(meta.read_text()) if meta.is_file() else None


def canonical_model_name(name: str, pretrained: Optional[str]) -> str:
    """The open_clip name to build, guarding the QuickGELU trap.

    OpenAI weights were trained with QuickGELU; open_clip switches activation silently only for
    `pretrained="openai"`, so a fine-tuned checkpoint loaded by path under `ViT-B-32` runs GELU and loses
    1-7 benchmark points. We always build OpenAI-derived models under their `-quickgelu` name, and refuse an
    export whose recorded model name differs from the configured one.
    """
    if pretrained == "openai" and not name.endswith(QUICKGELU_SUFFIX):
        quick = name + QUICKGELU_SUFFIX
        if quick in open_clip.list_models():
            log.info("pretrained=openai: building %s instead of %s (QuickGELU activation)", quick, name)
            return quick
    meta = _export_metadata(pretrained) if pretrained and Path(pretrained).exists() else None
    if meta is not None and meta.get("model") != name:
        raise ValueError(f"model.name={name!r} but the export at {pretrained} was trained as "
                         f"{meta.get('model')!r}; set model.name={meta.get('model')}")
    return name


def _pretrained_argument(pretrained: Optional[str]) -> Optional[str]:
    """A tag passes through; a local export directory resolves to its open_clip.pt."""
    if not pretrained:
        return None
    path = Path(pretrained)
    if path.is_dir():
        path = path / "open_clip.pt"
    if path.exists():
        return str(path)
    if Path(pretrained).is_dir():
        raise FileNotFoundError(f"model.pretrained={pretrained}: the folder holds no {path.name} (a run's export/ "
                                f"is written when its training ends)")
    if "/" in pretrained or pretrained.endswith((".pt", ".bin", ".safetensors", ".ckpt")):
        raise FileNotFoundError(f"model.pretrained={pretrained}: no such checkpoint file or export folder (a run's "
                                f"export/ is written when its training ends)")
    return pretrained


def pretrained_problem(pretrained: Optional[str]) -> Optional[str]:
    """Why the local weights `model.pretrained` names cannot be read, found without building anything; None when
    they exist, for random weights, and for a tag or a published checkpoint (open_clip and `modeling.published`
    resolve those)."""
    if not pretrained or pretrained.startswith(ZOO_PREFIX):
        return None
    if pretrained.startswith(HF_PREFIX):
        folder = pretrained[len(HF_PREFIX):]
        return None if Path(folder).is_dir() else f"model.pretrained={pretrained}: no such folder {folder}"
    try:
        _pretrained_argument(pretrained)
    except FileNotFoundError as err:
        return str(err)
    return None


def _export_config_dir(pretrained: Optional[str]) -> Optional[str]:
    """`model_configs/` of an export that `pretrained` points at (its own model, e.g. a stretched context)."""
    path = Path(pretrained) if pretrained else None
    if path is None or not path.exists():
        return None
    directory = (path if path.is_dir() else path.parent) / MODEL_CONFIGS_DIR
    return str(directory) if directory.is_dir() else None


def model_config(name: str, pretrained: Optional[str] = None, config_dir: Optional[str] = None) -> Optional[dict]:
    """The open_clip config `build_model` would build `name` from (None for a name open_clip does not know),
    read without building anything."""
    register_model_configs(config_dir)
    register_model_configs(_export_config_dir(pretrained))
    return open_clip.get_model_config(name)


ZOO_PREFIX, HF_PREFIX = "zoo:", "hf:"


def build_model(name: str, pretrained: Optional[str] = None, config_dir: Optional[str] = None) -> BuiltModel:
    """Build any open_clip model with random weights, a pretrained tag, or a local checkpoint or export; or a
    published checkpoint: `name="zoo:NAME"` with `pretrained=FILE`, `pretrained="zoo:NAME:FILE"` (the model name
    must then be the zoo entry's), or `pretrained="hf:DIR"`, a Hugging Face `CLIPModel` folder."""
    if name.startswith(ZOO_PREFIX) or (pretrained or "").startswith(ZOO_PREFIX):
        from modeling.published import build_from_zoo  # it builds on this module

        return build_from_zoo(name, pretrained, config_dir)
    if (pretrained or "").startswith(HF_PREFIX):
        from modeling.published import build_from_hf

        return build_from_hf(pretrained[len(HF_PREFIX):], name, config_dir)
    register_model_configs(config_dir)
    register_model_configs(_export_config_dir(pretrained))
    if name not in open_clip.list_models():
        raise ValueError(f"unknown open_clip model {name!r}; see open_clip.list_models() or add a JSON "
                         f"config to model.config_dir")
    name = canonical_model_name(name, pretrained)
    argument = _pretrained_argument(pretrained)
    local = argument is not None and Path(argument).is_file()
    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        name, pretrained=None if local else argument)
    if local:  # read strictly: open_clip's own loader would resize a text context that does not fit, silently
        from modeling import checkpoints

        checkpoints.load_strict(model, checkpoints.read_checkpoint(argument, "wrappers", model))
    return BuiltModel(model, name, preprocess_train, preprocess_val, open_clip.get_tokenizer(name),
                      open_clip.get_model_config(name))


def _check_supported_block(block: nn.Module) -> None:
    if not isinstance(block, ResidualAttentionBlock) or hasattr(block, "ln_1_kv"):
        raise ValueError(f"CLIPEncoders supports open_clip's standard ResidualAttentionBlock, got "
                         f"{type(block).__name__}")


@dataclass
class AttentionTrace:
    """What one block's self-attention computed, kept in the autograd graph (attribution methods).

    `context` is the attention output before `out_proj` (heads concatenated), the tensor whose gradient
    Grad-ECLIP uses as channel weights; `block_input` is the residual stream entering the block.
    """

    block_input: Tensor  # [B, N, W]
    probs: Tensor  # [B, heads, N, N], softmax probabilities
    q: Tensor  # [B, heads, N, W / heads], before the 1/sqrt(d) scaling
    k: Tensor  # [B, heads, N, W / heads]
    v: Tensor  # [B, heads, N, W / heads]
    context: Tensor  # [B, N, W]


def attention_with_trace(block: ResidualAttentionBlock, x: Tensor, attn_mask: Optional[Tensor],
                         heads: Optional[int] = None) -> Tuple[Tensor, AttentionTrace]:
    """The block's self-attention computed from its own weights, returning what it computed too.

    Same maths as `nn.MultiheadAttention` (batch-first), but explicit so the probabilities are the ones
    used in the forward pass and stay in the graph. `heads` overrides the number of heads (Grad-ECLIP's
    single-head re-run, which changes the function; default: the block's own).
    """
    attn = block.attn
    batch, length, width = x.shape
    heads = heads or attn.num_heads
    qkv = F.linear(x, attn.in_proj_weight, attn.in_proj_bias)
    q, k, v = qkv.view(batch, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
    scores = (q * (width // heads) ** -0.5) @ k.transpose(-2, -1)
    if attn_mask is not None:
        scores = scores + attn_mask.to(scores.dtype)
    probs = scores.softmax(dim=-1)
    context = (probs @ v).transpose(1, 2).reshape(batch, length, width)
    return attn.out_proj(context), AttentionTrace(x, probs, q, k, v, context)


def attention_with_probs(block: ResidualAttentionBlock, x: Tensor,
                         attn_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """`attention_with_trace` returning only the output and the probabilities."""
    out, trace = attention_with_trace(block, x, attn_mask)
    return out, trace.probs


def wraps_out_projection(block: ResidualAttentionBlock) -> bool:
    """Whether the block's attention output projection is wrapped (a LoRA adapter, modeling/lora.py).

    `nn.MultiheadAttention.forward` reads `out_proj.weight` itself and never calls `out_proj`, so it would skip the
    wrapper: such a block runs `explicit_attention` instead of open_clip's own."""
    return not isinstance(block.attn.out_proj, nn.Linear)


def explicit_attention(block: ResidualAttentionBlock, x: Tensor, attn_mask: Optional[Tensor]) -> Tensor:
    """The block's self-attention (batch-first, on the ln_1 output) from its own weights and modules, with
    `out_proj` called as a module: the computation of `nn.MultiheadAttention`'s training path (bit for bit where
    both run the same kernels, as tests/test_lora.py checks for the tiny test model in float32 on the CPU; up to
    float rounding in general), which its fused inference kernel matches up to float rounding."""
    attn = block.attn
    batch, length, width = x.shape
    qkv = F.linear(x, attn.in_proj_weight, attn.in_proj_bias)
    q, k, v = qkv.view(batch, length, 3, attn.num_heads, width // attn.num_heads).permute(2, 0, 3, 1, 4)
    mask = attn_mask.to(q.dtype) if attn_mask is not None else None
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=attn.dropout if attn.training else 0.0)
    return attn.out_proj(context.transpose(1, 2).reshape(batch, length, width))


def self_attention(block: ResidualAttentionBlock, x: Tensor, attn_mask: Optional[Tensor]) -> Tensor:
    """open_clip's `block.attention` on the ln_1 output, or `explicit_attention` when its `out_proj` is wrapped."""
    if wraps_out_projection(block):
        return explicit_attention(block, x, attn_mask)
    return block.attention(q_x=x, attn_mask=attn_mask)


def run_block_plain(block: ResidualAttentionBlock, x: Tensor, attn_mask: Optional[Tensor]) -> Tensor:
    """open_clip's `block(x, attn_mask=attn_mask)`, through `self_attention` (so a wrapped `out_proj` counts)."""
    if not wraps_out_projection(block):
        return block(x, attn_mask=attn_mask)
    x = x + block.ls_1(explicit_attention(block, block.ln_1(x), attn_mask))
    return x + block.ls_2(block.mlp(block.ln_2(x)))


def run_block(block: ResidualAttentionBlock, x: Tensor, attn_mask: Optional[Tensor],
              heads: Optional[int] = None) -> Tuple[Tensor, AttentionTrace]:
    """One pre-LN residual block, explicitly: x + attn(ln_1(x)), then + mlp(ln_2(x))."""
    _check_supported_block(block)
    attn_out, trace = attention_with_trace(block, block.ln_1(x), attn_mask, heads)
    trace.block_input = x
    x = x + block.ls_1(attn_out)
    x = x + block.ls_2(block.mlp(block.ln_2(x)))
    return x, trace


# Ops whose outputs a block recomputing its MLP activation keeps (the matrix products); everything else inside the
# recomputed region (the activation) is computed again in the backward.
_KEPT_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


# Newer torch asks whether the tensors selective checkpointing keeps go through saved-tensor hooks around it
# (e.g. perf.step's byte count): yes, like every other saved tensor.
_CHECKPOINT_OPTIONS = ({"respect_saved_tensors_hooks": True}
                       if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


def _keep_matrix_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def mlp_recomputing_activation(mlp: nn.Module, x: Tensor) -> Tensor:
    """open_clip's MLP (c_fc, activation, c_proj) that keeps c_fc's output [N, 4W] for the backward and computes
    the activation from it again there (selective checkpointing: c_proj's product is kept, not recomputed).

    Autograd would keep the activation's input and output (QuickGELU also its sigmoid): two or three [N, 4W]
    tensors per block; this keeps the input and c_proj's [N, W] output, a fifth (GELU) to a third (QuickGELU)
    less of a tower's activation memory. The recomputation runs the same kernels on the same input, so values
    and gradients are the same bit for bit; it costs one elementwise activation per block. Under autocast
    c_proj's weight is cast at every forward (`_autocast_without_cast_cache`), so when one autocast region runs a
    tower twice, that weight's gradient adds the two forwards' parts in float32 rather than in the autocast
    dtype: the values are the same, that gradient differs by the low-precision rounding.
    """
    first, rest = mlp[0], mlp[1:]
    hidden = first(x)
    context = functools.partial(create_selective_checkpoint_contexts, _keep_matrix_products)
    with _autocast_without_cast_cache(hidden.device.type):
        return checkpoint(rest, hidden, use_reentrant=False, context_fn=context, **_CHECKPOINT_OPTIONS)


@contextlib.contextmanager
def _autocast_without_cast_cache(device_type: str) -> Iterator[None]:
    """Autocast as it is, but casting parameters anew at every use inside the context.

    Autocast casts a parameter once per autocast region and reuses the copy. The recomputation in the backward
    runs in an autocast region of its own, so a forward that found c_proj's weight already cast (a tower's second
    forward in one step, as MACCO's) would replay other operations than it recorded, which selective
    checkpointing refuses. Without the cache both cast: the same values, one weight cast per block and forward.
    """
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False):
        yield


def _recomputes_mlp(block: ResidualAttentionBlock) -> bool:
    """Whether the block's MLP is open_clip's Sequential(c_fc, activation, ..., c_proj)."""
    return isinstance(block.mlp, nn.Sequential) and next(iter(block.mlp._modules), None) == "c_fc"


def run_block_recomputing_activation(block: ResidualAttentionBlock, x: Tensor, attn_mask: Optional[Tensor]) -> Tensor:
    """open_clip's `block(x, attn_mask=attn_mask)` with `mlp_recomputing_activation`: the same values."""
    _check_supported_block(block)
    x = x + block.ls_1(self_attention(block, block.ln_1(x), attn_mask))
    mlp_input = block.ln_2(x)
    mlp_output = mlp_recomputing_activation(block.mlp, mlp_input) if _recomputes_mlp(block) else block.mlp(mlp_input)
    return x + block.ls_2(mlp_output)


def run_blocks(transformer: Transformer, x: Tensor, attn_mask: Optional[Tensor] = None,
               need_attn: bool = False, recompute_activations: bool = False,
               block_inputs: Optional[List[Tensor]] = None) -> Tuple[Tensor, Optional[List[AttentionTrace]]]:
    """Run a batch-first open_clip Transformer block by block, optionally tracing every attention.

    `recompute_activations` (without `need_attn`, while autograd records) keeps less for the backward
    (`mlp_recomputing_activation`); the values are the same. Not for a double backward. A list passed as
    `block_inputs` receives the residual stream entering each block (tensors autograd keeps anyway).
    """
    if not transformer.batch_first:
        raise ValueError("CLIPEncoders expects a batch-first open_clip Transformer")
    if not need_attn and recompute_activations and torch.is_grad_enabled():
        for block in transformer.resblocks:
            _append(block_inputs, x)
            x = run_block_recomputing_activation(block, x, attn_mask)
        return x, None
    if not need_attn and (block_inputs is not None or any(map(wraps_out_projection, transformer.resblocks))):
        for block in transformer.resblocks:  # Transformer.forward's own loop (batch-first)
            _append(block_inputs, x)
            x = run_block_plain(block, x, attn_mask)
        return x, None
    if not need_attn:
        return transformer(x, attn_mask=attn_mask), None
    traces = []
    for block in transformer.resblocks:
        _append(block_inputs, x)
        x, trace = run_block(block, x, attn_mask)
        traces.append(trace)
    return x, traces


def _append(collected: Optional[List[Tensor]], x: Tensor) -> None:
    if collected is not None:
        collected.append(x)


def _project(x: Tensor, projection: Optional[nn.Module | Tensor]) -> Tensor:
    if projection is None:
        return x
    return projection(x) if isinstance(projection, nn.Linear) else x @ projection


def _replace(x: Tensor, replace: Optional[Tensor], mask_token: Optional[Tensor]) -> Tensor:
    """Put `mask_token` at positions where `replace` [B, N] is True (embedding level)."""
    if replace is None:
        return x
    if mask_token is None:
        raise ValueError("replace given without mask_token")
    if replace.shape != x.shape[:2]:
        raise ValueError(f"replace mask of shape {tuple(replace.shape)} for embeddings {tuple(x.shape)}")
    return torch.where(replace.unsqueeze(-1), mask_token.to(x.dtype), x)


def eos_position(ids: Tensor) -> Tensor:
    """[B] position of each caption's EOS: CLIP's EOT token has the largest id (open_clip's argmax pooling)."""
    return ids.argmax(dim=-1)


def _prefix_keys_values(block: ResidualAttentionBlock, x: Tensor) -> Tuple[Tensor, Tensor]:
    """The block's attention keys and values [B, heads, L, W / heads] of its input x [B, L, W]."""
    attn = block.attn
    batch, length, width = x.shape
    bias = attn.in_proj_bias[width:] if attn.in_proj_bias is not None else None
    kv = F.linear(block.ln_1(x), attn.in_proj_weight[width:], bias)
    keys, values = kv.view(batch, length, 2, attn.num_heads, width // attn.num_heads).permute(2, 0, 3, 1, 4)
    return keys, values


def _continuation_mask(start: Tensor, prefix: int, length: int, dtype: torch.dtype) -> Tensor:
    """[P, 1, S, prefix + S] additive attention mask (0 = attended, -inf = not): prefix key j when j < start[p],
    continuation key i' <= i. Additive in the attention's dtype, so no block converts a boolean one again."""
    keys = torch.arange(prefix, device=start.device)
    shared = (keys < start.unsqueeze(1)).unsqueeze(1).expand(-1, length, -1)  # [P, S, prefix]
    causal = torch.ones(length, length, dtype=torch.bool, device=start.device).tril()
    attended = torch.cat([shared, causal.expand(len(start), -1, -1)], dim=2).unsqueeze(1)
    return torch.zeros(attended.shape, dtype=dtype, device=start.device).masked_fill_(~attended, float("-inf"))


def _continuation_block(block: ResidualAttentionBlock, x: Tensor, placed: Tensor, prefix_keys: Tensor,
                        prefix_values: Tensor, mask: Tensor, eos: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    """One pre-LN block on the continuations' rows x [R, W], packed without padding (`placed` [P, S] marks the
    R positions they hold in the padded [P, S] layout): the row-wise layers run on the R rows, the attention on
    the padded layout, each continuation attending to its prefix's keys and values [P, heads, prefix, W / heads]
    too. With `eos` (each continuation's last position [P] and the packed index of that row [P]) only the EOS
    rows are computed after the attention (their keys and values still come from every row): [P, W]."""
    attn = block.attn
    batch, length = placed.shape
    width, heads = x.shape[-1], attn.num_heads
    packed = F.linear(block.ln_1(x), attn.in_proj_weight, attn.in_proj_bias)  # [R, 3W], autocast's dtype
    qkv = packed.new_zeros(batch, length, 3 * width)
    qkv[placed] = packed
    q, k, v = qkv.view(batch, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
    if eos is not None:
        eos_position, eos_row = eos
        rows = torch.arange(batch, device=x.device)
        q, mask, x = q[rows, :, eos_position].unsqueeze(2), mask[rows, :, eos_position].unsqueeze(2), x[eos_row]
    keys, values = torch.cat([prefix_keys, k], dim=2), torch.cat([prefix_values, v], dim=2)
    context = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).transpose(1, 2).reshape(batch, -1, width)
    context = context[:, 0] if eos is not None else context[placed]
    x = x + block.ls_1(attn.out_proj(context))
    return x + block.ls_2(block.mlp(block.ln_2(x)))


class CLIPEncoders(nn.Module):
    """Explicit text and image forward passes of an open_clip CLIP (ViT image tower, causal text tower).

    Args:
        model: an `open_clip.CLIP` with a ViT visual tower (standard blocks, token pooling).
        recompute_activations: training forwards without attention traces keep only each block's MLP
            pre-activation and compute the activation again in the backward (`mlp_recomputing_activation`): the
            same values and (in float32) gradients with a fifth to a third less activation memory. Not for a
            double backward.
    """

    def __init__(self, model: nn.Module, recompute_activations: bool = False):
        super().__init__()
        self.recompute_activations = recompute_activations
        if not hasattr(model, "token_embedding") or not hasattr(model.visual, "conv1"):
            raise ValueError("CLIPEncoders needs an open_clip CLIP with a built-in text tower and a ViT")
        if getattr(model.visual, "attn_pool", None) is not None:
            raise ValueError("attention-pooled vision towers are not supported")
        if model.visual.final_ln_after_pool and model.visual.pool_type != "tok":
            raise ValueError("final_ln_after_pool with non-token pooling is not supported")
        self.model = model

    @property
    def text_width(self) -> int:
        return self.model.token_embedding.embedding_dim

    @property
    def vision_width(self) -> int:
        return self.model.visual.conv1.out_channels

    @property
    def grid_size(self) -> Tuple[int, int]:
        return tuple(self.model.visual.grid_size)

    def encode_text(self, ids: Tensor, replace: Optional[Tensor] = None, mask_token: Optional[Tensor] = None,
                    attn: bool = False, trim: Union[bool, int] = False, keep_block_inputs: bool = False,
                    embeddings_as_leaf: bool = False) -> TextFeatures:
        """Encode token ids [B, L]; `replace` [B, L] swaps token embeddings for `mask_token`.

        `trim` drops the positions after the batch's last EOS before the tower runs: the tower is causal and
        pools EOS, so `pooled` is unchanged while COCO captions (~15 of 77 tokens) cost a fraction of the
        compute. Per-token outputs then have the trimmed length. `trim=True` measures that length here, a read
        of a device value (a sync on a GPU); an int is the length measured before the ids moved to the device
        (at least the last EOS position + 1). `keep_block_inputs` returns each block's input
        (`TextFeatures.block_inputs`, what `encode_text_continuations` starts from). `embeddings_as_leaf` makes
        token embeddings that require no grad (a frozen token embedding, as under LoRA) a leaf that does, so that
        gradient-based attributions can differentiate them and everything after them; no value changes.
        """
        if trim is not False:
            length = int(ids.argmax(dim=-1).max()) + 1 if trim is True else int(trim)
            ids = ids[:, :length]
            replace = replace[:, :length] if replace is not None else None
        m = self.model
        cast_dtype = m.transformer.get_cast_dtype()
        embeddings = _replace(m.token_embedding(ids).to(cast_dtype), replace, mask_token)
        if embeddings_as_leaf and not embeddings.requires_grad:
            embeddings = embeddings.detach().requires_grad_(True)
        return self.encode_text_embeddings(embeddings, ids, attn, keep_block_inputs)

    def encode_text_embeddings(self, embeddings: Tensor, ids: Tensor, attn: bool = False,
                               keep_block_inputs: bool = False) -> TextFeatures:
        """The text tower from token embeddings [B, L, width] (gradient attribution differentiates them).

        `L` may be shorter than the context length: the tower is causal and pools the EOS token, so
        dropping positions after the last EOS of the batch changes nothing but the cost.
        """
        m = self.model
        length = embeddings.shape[1]
        x = embeddings + m.positional_embedding[:length].to(embeddings.dtype)
        attn_mask = m.attn_mask[:length, :length] if m.attn_mask is not None else None
        block_inputs = [] if keep_block_inputs or attn else None
        x, traces = run_blocks(m.transformer, x, attn_mask, need_attn=attn,
                               recompute_activations=self.recompute_activations, block_inputs=block_inputs)
        hidden = m.ln_final(x)
        tokens = _project(hidden, m.text_projection)
        attentions = [trace.probs for trace in traces] if traces is not None else None
        return TextFeatures(pooled=self.text_pool(tokens, ids), tokens=tokens, attentions=attentions,
                            traces=traces, embeddings=embeddings, hidden=hidden, block_inputs=block_inputs)

    @property
    def shares_text_prefixes(self) -> bool:
        """Whether `encode_text_continuations` applies: a causal text tower pooled at its EOS (argmax) token."""
        m = self.model
        return m.attn_mask is not None and m.text_pool_type == "argmax"

    def encode_text_continuations(self, ids: Tensor, start: Tensor, source: Tensor,
                                  source_block_inputs: Sequence[Tensor], chunk_size: Optional[int] = None) -> Tensor:
        """Pooled embeddings [P, D] of captions `ids` [P, N] that agree with caption `source[p]` of an encoded
        batch before position `start[p]` (>= 1): only positions start[p]..EOS run through the tower.

        The tower is causal, so the hidden states before `start[p]` are the source caption's. Each block's keys
        and values there are computed once from the source's input to that block (`source_block_inputs[l]`
        [B, L, width], `TextFeatures.block_inputs`, kept in the autograd graph: gradients reach the weights
        through the shared prefix as through a full forward). The captions run `chunk_size` at a time (all at
        once by default), sorted by the number of positions they run so that each chunk pads little: the
        row-wise layers run on the continuations' own positions only (no padding), the attention on them padded
        to the chunk's longest; the last block computes the EOS rows alone, the only ones pooled. Equal to
        `encode_text(ids).pooled` up to float rounding (other matrix shapes).
        """
        if not self.shares_text_prefixes:
            raise ValueError("encode_text_continuations needs a causal text tower pooled at its EOS token")
        blocks = list(self.model.transformer.resblocks)
        if len(source_block_inputs) != len(blocks):
            raise ValueError(f"{len(source_block_inputs)} block inputs for a tower of {len(blocks)} blocks")
        for block in blocks:
            _check_supported_block(block)
        prefix = int(start.max())
        prefixes = [_prefix_keys_values(block, x[:, :prefix]) for block, x in zip(blocks, source_block_inputs)]
        order = torch.argsort(eos_position(ids) - start, stable=True)
        pooled = [self._continuations(ids[rows], start[rows], source[rows], prefixes)
                  for rows in order.split(chunk_size or max(len(order), 1))]
        return torch.cat(pooled)[torch.argsort(order)]

    def _continuations(self, ids: Tensor, start: Tensor, source: Tensor,
                       prefixes: List[Tuple[Tensor, Tensor]]) -> Tensor:
        """`encode_text_continuations` of one chunk, from every block's prefix keys and values [B, heads, L', d]."""
        m = self.model
        lengths = eos_position(ids) - start + 1  # [P] tokens from start to EOS, both included
        prefix = int(start.max())
        offsets = torch.arange(int(lengths.max()), device=ids.device)
        placed = offsets < lengths.unsqueeze(1)  # [P, S]
        positions = (start.unsqueeze(1) + offsets)[placed]  # [R], the packed rows' positions in their captions
        x = m.token_embedding(ids[placed.nonzero(as_tuple=True)[0], positions]).to(m.transformer.get_cast_dtype())
        x = x + m.positional_embedding[positions].to(x.dtype)
        mask = _continuation_mask(start, prefix, len(offsets), prefixes[0][0].dtype)
        eos = (lengths - 1, torch.cumsum(lengths, dim=0) - 1)
        for index, (block, (keys, values)) in enumerate(zip(m.transformer.resblocks, prefixes)):
            last = index == len(prefixes) - 1
            x = _continuation_block(block, x, placed, keys[source, :, :prefix], values[source, :, :prefix], mask,
                                    eos if last else None)
        return _project(m.ln_final(x), m.text_projection)

    def text_tokens(self, x: Tensor) -> Tensor:
        """ln_final and the text projection of the tower's output sequence [B, L, width]."""
        return _project(self.model.ln_final(x), self.model.text_projection)

    def text_pool(self, tokens: Tensor, ids: Tensor) -> Tensor:
        """open_clip's own pooling (the EOS token for CLIP) of projected tokens [B, L, D]."""
        m = self.model
        return open_clip.transformer.text_global_pool(
            tokens, ids[:, : tokens.shape[1]], m.text_pool_type, eos_token_id=getattr(m, "text_eos_id", None))

    def text_head(self, x: Tensor, ids: Tensor) -> Tensor:
        """The pooled text embedding [B, D] from the tower's output sequence."""
        return self.text_pool(self.text_tokens(x), ids)

    def patch_embeddings(self, images: Tensor) -> Tensor:
        """conv1 output as a sequence [B, P, width] (before CLS, positions and ln_pre)."""
        x = self.model.visual.conv1(images)
        return x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)

    def patch_grid(self, images: Tensor) -> Tuple[int, int]:
        """(rows, columns) of the patches conv1 makes of images [B, 3, H, W]."""
        conv = self.model.visual.conv1
        (kernel_h, kernel_w), (stride_h, stride_w) = conv.kernel_size, conv.stride
        return (images.shape[-2] - kernel_h) // stride_h + 1, (images.shape[-1] - kernel_w) // stride_w + 1

    def image_positions(self, grid: Tuple[int, int], resize: bool = False) -> Tensor:
        """The vision tower's positional embeddings [1 + rows * columns, width] for a patch grid.

        The model's own grid takes them as they are. Another grid (an input of another size or aspect ratio, as
        Grad-ECLIP explains images) needs `resize`: the patch positions, laid out on the model's grid, are resized
        to `grid` bicubically (align_corners=False, no antialiasing, as Grad-ECLIP's code); CLS keeps its own.
        """
        table = self.model.visual.positional_embedding
        own = self.grid_size
        if tuple(grid) == own:
            return table
        if not resize:
            raise ValueError(f"the images make a {grid[0]} x {grid[1]} patch grid, the model's positional "
                             f"embeddings a {own[0]} x {own[1]} one: give images of "
                             f"{tuple(self.model.visual.image_size)} pixels, or resize the positions "
                             f"(encode_image(..., resize_positions=True))")
        dtype = torch.promote_types(table.dtype, torch.float32)  # bicubic resizing needs float32 or wider
        patches = table[1:].to(dtype).reshape(1, *own, -1).permute(0, 3, 1, 2)
        patches = F.interpolate(patches, size=tuple(grid), mode="bicubic", align_corners=False)
        return torch.cat([table[:1], patches.permute(0, 2, 3, 1).reshape(grid[0] * grid[1], -1).to(table.dtype)])

    def encode_image(self, images: Tensor, replace: Optional[Tensor] = None,
                     mask_token: Optional[Tensor] = None, attn: bool = False,
                     resize_positions: bool = False) -> ImageFeatures:
        """Encode images [B, 3, H, W]; `replace` [B, P] swaps patch embeddings for `mask_token`.

        Images of another size than the model's need `resize_positions` (see `image_positions`).
        """
        v = self.model.visual
        grid = self.patch_grid(images)
        positions = self.image_positions(grid, resize_positions)
        x = _replace(self.patch_embeddings(images), replace, mask_token)
        cls = v.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + positions.to(x.dtype)
        x = v.ln_pre(v.patch_dropout(x))
        x, traces = run_blocks(v.transformer, x, need_attn=attn, recompute_activations=self.recompute_activations)
        return self.image_head(x, traces, grid)

    def image_head(self, x: Tensor, traces: Optional[List[AttentionTrace]] = None,
                   grid: Optional[Tuple[int, int]] = None) -> ImageFeatures:
        """ln_post, pooling and projection of the vision tower's output sequence [B, 1 + P, width]."""
        v = self.model.visual
        x = v.ln_post(x)
        pooled = x[:, 1:].mean(dim=1) if v.pool_type == "avg" else x[:, 0]
        return ImageFeatures(pooled=_project(pooled, v.proj), patches=_project(x[:, 1:], v.proj), traces=traces,
                             grid_size=grid)
