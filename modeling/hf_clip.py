"""Exact conversion between open_clip CLIP models and Hugging Face `transformers.CLIPModel` folders.

`open_clip_to_hf` writes a folder that `CLIPModel.from_pretrained` and `CLIPProcessor.from_pretrained` read
offline (config.json, the weights, open_clip's own BPE as tokenizer files, an image-processor config);
`hf_to_open_clip` reads such a folder (one file or sharded, safetensors or pickle) back into an open_clip model
config and a state dict that loads with strict=True. Both directions move every tensor unchanged up to layout
(q/k/v split from or packed into the fused in-projection, projections transposed), so a round trip is bit for
bit and the two libraries compute the same features up to float rounding.

The two architectures agree for the standard CLIP only: a ViT image tower pooled at its class token, a causal
text tower pooled at its EOS token, pre-LN blocks without layer scale, LayerNorm eps 1e-5 and one activation,
GELU (erf, HF "gelu") or QuickGELU, in both towers. Anything else is refused with a ValueError naming it
(`UnsupportedModel`).

transformers is imported inside the functions that use it: `modeling.export` imports this module, and most of
what imports that never converts anything.
"""
from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import open_clip
import torch
from open_clip.transformer import QuickGELU, ResidualAttentionBlock, VisionTransformer
from torch import Tensor, nn

from modeling.checkpoints import CheckpointMismatch, describe_mismatch

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
PICKLE_FILE = "pytorch_model.bin"
INDEX_SUFFIX = ".index.json"  # HF's sharded checkpoints: <weights file>.index.json maps each tensor to its shard
PREPROCESSOR_FILE = "preprocessor_config.json"

BOS_ID, EOS_ID, PAD_ID = 49406, 49407, 0  # open_clip's tokenizer: start/end of text, and 0 ("!") after the EOS
LAYER_NORM_EPS = 1e-5  # torch's default, the eps of every open_clip LayerNorm
LEGACY_EOS_ID = 2  # HF CLIP configs written before transformers 4.31: HF pools at the argmax id, as open_clip does
HF_ACTIVATIONS = {False: "gelu", True: "quick_gelu"}  # open_clip's quick_gelu flag -> HF hidden_act
# open_clip names its special tokens differently from HF's CLIP vocab; the ids are the same.
HF_SPECIAL_TOKENS = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
PIL_RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3}  # open_clip interpolation -> PIL resample code


class UnsupportedModel(ValueError):
    """An open_clip model or HF config that the other library's CLIP cannot express exactly."""


# ----- the tensor map ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPair:
    """One open_clip tensor and the HF tensor(s) holding the same values.

    `layout` is "same" (identical tensors), "transposed" (open_clip's [in, out] projection parameter against
    an `nn.Linear` weight [out, in]) or "qkv" (open_clip's packed in-projection, rows q, k, v, against HF's
    three projections).
    """

    open_clip: str
    hf: Tuple[str, ...]
    layout: str = "same"


def _linear_pairs(open_clip_name: str, hf_name: str) -> List[TensorPair]:
    return [TensorPair(f"{open_clip_name}.{p}", (f"{hf_name}.{p}",)) for p in ("weight", "bias")]


def _block_pairs(open_clip_prefix: str, hf_prefix: str, layers: int) -> Iterator[TensorPair]:
    """A tower's pre-LN blocks: open_clip `resblocks.i` against HF `encoder.layers.i`."""
    renamed = (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
               ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2"))
    for i in range(layers):
        ours, theirs = f"{open_clip_prefix}.resblocks.{i}", f"{hf_prefix}.layers.{i}"
        for p in ("weight", "bias"):
            yield TensorPair(f"{ours}.attn.in_proj_{p}",
                             tuple(f"{theirs}.self_attn.{head}_proj.{p}" for head in "qkv"), "qkv")
        for open_clip_name, hf_name in renamed:
            yield from _linear_pairs(f"{ours}.{open_clip_name}", f"{theirs}.{hf_name}")


def tensor_map(text_layers: int, vision_layers: int) -> List[TensorPair]:
    """Every tensor of an open_clip CLIP and where HF's CLIPModel keeps it."""
    return [
        TensorPair("token_embedding.weight", ("text_model.embeddings.token_embedding.weight",)),
        TensorPair("positional_embedding", ("text_model.embeddings.position_embedding.weight",)),
        *_block_pairs("transformer", "text_model.encoder", text_layers),
        *_linear_pairs("ln_final", "text_model.final_layer_norm"),
        TensorPair("text_projection", ("text_projection.weight",), "transposed"),
        TensorPair("visual.class_embedding", ("vision_model.embeddings.class_embedding",)),
        TensorPair("visual.positional_embedding", ("vision_model.embeddings.position_embedding.weight",)),
        TensorPair("visual.conv1.weight", ("vision_model.embeddings.patch_embedding.weight",)),
        *_linear_pairs("visual.ln_pre", "vision_model.pre_layrnorm"),  # (sic): HF's own spelling
        *_block_pairs("visual.transformer", "vision_model.encoder", vision_layers),
        *_linear_pairs("visual.ln_post", "vision_model.post_layernorm"),
        TensorPair("visual.proj", ("visual_projection.weight",), "transposed"),
        TensorPair("logit_scale", ("logit_scale",)),
    ]


def _to_hf(pair: TensorPair, tensor: Tensor) -> Dict[str, Tensor]:
    # Copies, never views: torch.save writes a view's whole storage (q, k and v would each hold all three).
    if pair.layout == "qkv":
        return {name: part.clone() for name, part in zip(pair.hf, tensor.chunk(3))}
    if pair.layout == "transposed":
        return {pair.hf[0]: tensor.t().contiguous()}
    return {pair.hf[0]: tensor.clone()}


def _to_open_clip(pair: TensorPair, tensors: Mapping[str, Tensor]) -> Tensor:
    parts = [tensors[name] for name in pair.hf]
    if pair.layout == "qkv":
        return torch.cat(parts)
    if pair.layout == "transposed":
        return parts[0].t().contiguous()
    return parts[0]


def check_tensors(tensors: Mapping[str, Tensor], expected: Mapping[str, Optional[torch.Size]], source: str) -> None:
    """Raise CheckpointMismatch naming the missing, unexpected and reshaped tensors of `tensors` (an expected
    shape of None accepts any)."""
    shapes = {name: tensors[name].shape if shape is None and name in tensors else shape
              for name, shape in expected.items()}
    problem = describe_mismatch(shapes, tensors, ("found", "expected"))
    if problem:
        raise CheckpointMismatch(f"{source} does not fit a CLIPModel: {problem}")


def hf_tensor_shapes(config) -> Dict[str, torch.Size]:
    """The state dict shapes of `transformers.CLIPModel(config)`, from the class itself (built on the meta
    device: no memory, no initialisation)."""
    from transformers import CLIPModel

    with torch.device("meta"):
        model = CLIPModel(config)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


# ----- open_clip -> HF -----------------------------------------------------------------------------------------


def _blocks(model: nn.Module) -> List[nn.Module]:
    return [*model.transformer.resblocks, *model.visual.transformer.resblocks]


def _activation_problems(model: nn.Module, model_config: Mapping) -> Tuple[List[str], bool]:
    """What keeps the towers' MLP activation from being one HF hidden_act, and whether it is QuickGELU."""
    kinds = set()
    for block in _blocks(model):
        act = block.mlp[1] if isinstance(block.mlp, nn.Sequential) and len(block.mlp) == 3 else None
        if isinstance(act, QuickGELU):
            kinds.add("quick_gelu")
        elif type(act) is nn.GELU and act.approximate == "none":
            kinds.add("gelu")
        else:
            kinds.add(f"{type(act).__name__ if act is not None else 'a non-standard MLP'}")
    if len(kinds) != 1 or not kinds <= set(HF_ACTIVATIONS.values()):
        return [f"MLP activation(s) {sorted(kinds)} (HF CLIP runs one of gelu / quick_gelu in both towers)"], False
    quick = kinds == {"quick_gelu"}
    if "quick_gelu" in model_config and bool(model_config["quick_gelu"]) != quick:
        return [f"model config quick_gelu={model_config['quick_gelu']} but the model runs "
                f"{'QuickGELU' if quick else 'GELU'} (built under the wrong name?)"], quick
    return [], quick


def _block_problems(block: nn.Module) -> List[str]:
    if type(block) is not ResidualAttentionBlock:
        return [f"{type(block).__name__} blocks (qk-norm, scaled cosine attention or other custom blocks)"]
    attn = block.attn
    problems = []
    if hasattr(block, "ln_1_kv"):
        problems.append("cross-attention blocks")
    if not isinstance(block.ls_1, nn.Identity) or not isinstance(block.ls_2, nn.Identity):
        problems.append("layer scale (ls_init_value)")
    if not isinstance(attn, nn.MultiheadAttention) or attn.in_proj_bias is None or attn.bias_k is not None \
            or not attn._qkv_same_embed_dim:
        problems.append("attention other than nn.MultiheadAttention with a packed, biased in-projection")
    elif not all(isinstance(layer, nn.Linear) for layer in (attn.out_proj, block.mlp.c_fc, block.mlp.c_proj)):
        problems.append("wrapped linear layers (adapters: merge them into the weights first)")
    return problems


def _norm_problems(model: nn.Module) -> List[str]:
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm) and (module.eps != LAYER_NORM_EPS or module.bias is None
                                                 or not module.elementwise_affine):
            return [f"LayerNorm {name} with eps={module.eps} (HF's CLIP config holds one eps; open_clip's is "
                    f"{LAYER_NORM_EPS}, with weight and bias)"]
    return []


def _vision_problems(visual: nn.Module) -> List[str]:
    if not isinstance(visual, VisionTransformer):
        return [f"a {type(visual).__name__} image tower (only open_clip's VisionTransformer)"]
    problems = []
    if visual.attn_pool is not None:
        problems.append("the vision tower's attentional pooler")
    if visual.pool_type != "tok":
        problems.append(f"vision pool_type={visual.pool_type!r} (HF pools the class token: 'tok')")
    if not isinstance(visual.ln_pre, nn.LayerNorm):
        problems.append("a vision tower without ln_pre (no_ln_pre)")
    conv = visual.conv1
    if (len(set(visual.image_size)) != 1 or len(set(conv.kernel_size)) != 1 or conv.stride != conv.kernel_size
            or conv.bias is not None or conv.padding != (0, 0)):
        problems.append(f"image size {tuple(visual.image_size)} / patch embedding {conv} (HF: square images, "
                        f"square non-overlapping patches, no bias)")
    return problems


def _text_problems(model: nn.Module, model_config: Mapping) -> List[str]:
    problems = []
    if model.attn_mask is None:
        problems.append("a text tower without causal mask (no_causal_mask)")
    if model.text_pool_type != "argmax":
        problems.append(f"text pool_type={model.text_pool_type!r} (HF pools the EOS token: 'argmax')")
    if not isinstance(model.text_projection, nn.Parameter):
        problems.append(f"text projection {type(model.text_projection).__name__} (HF: a projection matrix "
                        f"without bias, open_clip's proj_type='linear', proj_bias=False)")
    tokenizer_size = len(_open_clip_tokenizer().encoder)
    if model.token_embedding.num_embeddings != tokenizer_size:
        problems.append(f"vocab_size {model.token_embedding.num_embeddings} (the folder's tokenizer is "
                        f"open_clip's CLIP BPE of {tokenizer_size} tokens)")
    text_cfg = model_config.get("text_cfg", {})
    for key in ("hf_tokenizer_name", "tokenizer_mode", "tokenizer_kwargs"):
        if text_cfg.get(key):
            problems.append(f"text_cfg.{key}={text_cfg[key]!r} (the folder's tokenizer is open_clip's default)")
    return problems


def _unsupported(model: nn.Module, model_config: Mapping) -> Tuple[List[str], bool]:
    """Everything about `model` HF's CLIPModel cannot express, and whether its activation is QuickGELU."""
    if not isinstance(model, open_clip.CLIP):
        return [f"a {type(model).__name__} (only open_clip.CLIP, with its built-in text tower)"], False
    problems = _vision_problems(model.visual)
    if problems and not isinstance(model.visual, VisionTransformer):
        return problems, False
    problems += _text_problems(model, model_config)
    problems += [problem for block in _blocks(model) for problem in _block_problems(block)]
    problems += _norm_problems(model)
    if model.logit_bias is not None:
        problems.append("logit_bias (SigLIP-style; HF's CLIPModel has no logit bias)")
    if model.logit_scale.ndim != 0:
        problems.append("a non-scalar logit_scale (nonscalar_logit_scale)")
    activation_problems, quick = _activation_problems(model, model_config)
    return list(dict.fromkeys(problems + activation_problems)), quick


def _tower_config(transformer: nn.Module, activation: str, projection_dim: int) -> dict:
    block = transformer.resblocks[0]
    return {"hidden_size": transformer.width, "intermediate_size": block.mlp.c_fc.out_features,
            "num_hidden_layers": len(transformer.resblocks), "num_attention_heads": block.attn.num_heads,
            "hidden_act": activation, "layer_norm_eps": LAYER_NORM_EPS, "projection_dim": projection_dim}


def hf_config_for(model: nn.Module, quick_gelu: bool, logit_scale: Tensor):
    """The `transformers.CLIPConfig` of a supported open_clip CLIP, read from its modules; `logit_scale` is the
    value written (its dtype the weights')."""
    from transformers import CLIPConfig

    activation = HF_ACTIVATIONS[quick_gelu]
    projection_dim = model.text_projection.shape[1]
    text = {**_tower_config(model.transformer, activation, projection_dim),
            "vocab_size": model.token_embedding.num_embeddings,
            "max_position_embeddings": model.positional_embedding.shape[0],
            # eos_token_id != 2: HF pools at the first EOS id, which is open_clip's argmax (the EOS id is the
            # largest; open_clip pads with 0 after it).
            "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    visual = model.visual
    vision = {**_tower_config(visual.transformer, activation, projection_dim), "num_channels": 3,
              "image_size": visual.image_size[0], "patch_size": visual.conv1.kernel_size[0]}
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim,
                        logit_scale_init_value=float(logit_scale),
                        dtype=str(logit_scale.dtype).removeprefix("torch."))
    config.architectures = ["CLIPModel"]
    return config


def open_clip_to_hf(model: nn.Module, model_config: Optional[Mapping], out_dir: Path | str,
                    safe_serialization: bool = True, dtype: Optional[torch.dtype] = None) -> Path:
    """Write an open_clip CLIP as a `transformers.CLIPModel` folder; return the folder.

    Args:
        model: an `open_clip.CLIP` with a ViT image tower (see the module for what is supported).
        model_config: its open_clip model config (embed_dim, quick_gelu, vision_cfg, text_cfg and optionally
            preprocess_cfg), checked against the model (QuickGELU) and used for the image preprocessing; None
            when there is none (the model's modules say everything else).
        out_dir: the folder to write (created; files of the same names are replaced).
        safe_serialization: model.safetensors, else pytorch_model.bin.
        dtype: cast floating tensors to it (default: keep the model's).

    Raises:
        UnsupportedModel: the model is not one HF's CLIPModel computes exactly; the message lists why.
    """
    model_config = model_config or {}
    problems, quick_gelu = _unsupported(model, model_config)
    if problems:
        raise UnsupportedModel("cannot express this open_clip model as a transformers CLIPModel: "
                               + "; ".join(problems))
    state = {name: tensor.detach().to(device="cpu", dtype=dtype if tensor.is_floating_point() else None)
             for name, tensor in model.state_dict().items()}
    config = hf_config_for(model, quick_gelu, state["logit_scale"])
    image_processor = _image_processor(model, model_config)
    pairs = tensor_map(config.text_config.num_hidden_layers, config.vision_config.num_hidden_layers)
    check_tensors(state, dict.fromkeys(pair.open_clip for pair in pairs), "the open_clip model")
    tensors = {name: tensor for pair in pairs for name, tensor in _to_hf(pair, state[pair.open_clip]).items()}
    check_tensors(tensors, hf_tensor_shapes(config), "the converted open_clip model")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    _write_weights(tensors, out_dir, safe_serialization)
    _write_tokenizer(out_dir, config.text_config.max_position_embeddings)
    image_processor.save_pretrained(out_dir)
    return out_dir


def _write_weights(tensors: Dict[str, Tensor], out_dir: Path, safe_serialization: bool) -> None:
    if safe_serialization:
        from safetensors.torch import save_file

        save_file(tensors, out_dir / SAFETENSORS_FILE, metadata={"format": "pt"})  # HF refuses files without it
    else:
        torch.save(tensors, out_dir / PICKLE_FILE)


@functools.lru_cache(maxsize=1)
def _open_clip_tokenizer() -> "open_clip.tokenizer.SimpleTokenizer":
    return open_clip.tokenizer.SimpleTokenizer()


def bpe_files(tokenizer: "open_clip.tokenizer.SimpleTokenizer") -> Tuple[str, str]:
    """vocab.json and merges.txt (HF's format) of open_clip's BPE: its encoder and merges in rank order."""
    vocab = {HF_SPECIAL_TOKENS.get(token, token): index for token, index in tokenizer.encoder.items()}
    merges = [" ".join(pair) for pair, _ in sorted(tokenizer.bpe_ranks.items(), key=lambda item: item[1])]
    return json.dumps(vocab, ensure_ascii=False), "#version: 0.2\n" + "\n".join(merges) + "\n"


@functools.lru_cache(maxsize=4)
def _tokenizer_files(context_length: int) -> Tuple[Tuple[str, bytes], ...]:
    """The tokenizer files of a CLIPTokenizerFast built from open_clip's BPE (built once per context length:
    converting the BPE to a fast tokenizer takes a second)."""
    from transformers import CLIPTokenizerFast

    with tempfile.TemporaryDirectory() as scratch:
        vocab, merges = bpe_files(_open_clip_tokenizer())
        (Path(scratch) / "vocab.json").write_text(vocab, encoding="utf-8")
        (Path(scratch) / "merges.txt").write_text(merges, encoding="utf-8")
        # Pad with id 0 ("!") as open_clip does. split_special_tokens keeps a "!" in a caption ordinary text
        # (BPE "!</w>", as open_clip), not the special pad token: the special tokens enter only by id.
        tokenizer = CLIPTokenizerFast(str(Path(scratch) / "vocab.json"), str(Path(scratch) / "merges.txt"),
                                      pad_token="!", model_max_length=context_length, split_special_tokens=True)
        saved = Path(scratch) / "saved"
        tokenizer.save_pretrained(saved)
        return tuple((path.name, path.read_bytes()) for path in sorted(saved.iterdir()))


def _write_tokenizer(out_dir: Path, context_length: int) -> None:
    for name, data in _tokenizer_files(context_length):
        (out_dir / name).write_bytes(data)


def _preprocess_cfg(model: nn.Module, model_config: Mapping) -> dict:
    from open_clip.transform import PreprocessCfg

    cfg = {"mean": PreprocessCfg.mean, "std": PreprocessCfg.std, "interpolation": PreprocessCfg.interpolation,
           "resize_mode": PreprocessCfg.resize_mode}
    for source in (getattr(model.visual, "preprocess_cfg", None) or {}, model_config.get("preprocess_cfg") or {}):
        cfg.update({key: value for key, value in source.items() if key in cfg})
    return cfg


def _image_processor(model: nn.Module, model_config: Mapping):
    """The CLIPImageProcessor of open_clip's eval transform: resize (shortest side, or both sides for 'squash'),
    center crop, scale to [0, 1], normalize."""
    from transformers import CLIPImageProcessor

    cfg = _preprocess_cfg(model, model_config)
    size = model.visual.image_size[0]
    if cfg["resize_mode"] not in ("shortest", "squash") or cfg["interpolation"] not in PIL_RESAMPLE:
        raise UnsupportedModel(f"open_clip preprocessing resize_mode={cfg['resize_mode']!r}, "
                               f"interpolation={cfg['interpolation']!r} has no CLIPImageProcessor equivalent")
    squash = cfg["resize_mode"] == "squash"
    return CLIPImageProcessor(
        do_resize=True, size={"height": size, "width": size} if squash else {"shortest_edge": size},
        resample=PIL_RESAMPLE[cfg["interpolation"]], do_center_crop=not squash,
        crop_size={"height": size, "width": size}, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
        image_mean=list(cfg["mean"]), image_std=list(cfg["std"]), do_convert_rgb=True)


# ----- HF -> open_clip -----------------------------------------------------------------------------------------


def read_hf_config(hf_dir: Path | str):
    """The folder's `transformers.CLIPConfig` (refusing another model type)."""
    from transformers import CLIPConfig

    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {hf_dir}: not a Hugging Face model folder")
    model_type = json.loads(path.read_text()).get("model_type")
    if model_type != "clip":
        raise UnsupportedModel(f"{path} has model_type={model_type!r}; only CLIP ('clip') converts to open_clip")
    return CLIPConfig.from_pretrained(hf_dir)


def _config_problems(config) -> List[str]:
    text, vision = config.text_config, config.vision_config
    problems = []
    for name, tower in (("text_config", text), ("vision_config", vision)):
        if tower.hidden_act not in HF_ACTIVATIONS.values():
            problems.append(f"{name}.hidden_act={tower.hidden_act!r} (open_clip: gelu or quick_gelu)")
        if tower.layer_norm_eps != LAYER_NORM_EPS:
            problems.append(f"{name}.layer_norm_eps={tower.layer_norm_eps} (open_clip: {LAYER_NORM_EPS})")
        if tower.hidden_size % tower.num_attention_heads:
            problems.append(f"{name}.hidden_size={tower.hidden_size} not divisible by num_attention_heads="
                            f"{tower.num_attention_heads}")
    if text.hidden_act != vision.hidden_act:
        problems.append(f"hidden_act {text.hidden_act!r} (text) and {vision.hidden_act!r} (vision): open_clip "
                        f"runs one activation in both towers")
    if vision.num_channels != 3:
        problems.append(f"vision_config.num_channels={vision.num_channels} (open_clip: 3)")
    return problems


def _mlp_ratio(tower) -> dict:
    """open_clip's mlp_ratio for a tower's intermediate size (omitted when it is the default 4)."""
    ratio = tower.intermediate_size / tower.hidden_size
    if int(tower.hidden_size * ratio) != tower.intermediate_size:
        raise UnsupportedModel(f"intermediate_size {tower.intermediate_size} is no open_clip mlp_ratio of "
                               f"hidden_size {tower.hidden_size}")
    return {} if ratio == 4.0 else {"mlp_ratio": ratio}


def open_clip_config_for(config) -> dict:
    """The open_clip model config (`open_clip.CLIP(**it)`) of a `transformers.CLIPConfig`."""
    problems = _config_problems(config)
    if problems:
        raise UnsupportedModel("cannot express this transformers CLIPModel in open_clip: " + "; ".join(problems))
    text, vision = config.text_config, config.vision_config
    text_cfg = {"context_length": text.max_position_embeddings, "vocab_size": text.vocab_size,
                "width": text.hidden_size, "heads": text.num_attention_heads, "layers": text.num_hidden_layers,
                **_mlp_ratio(text)}
    # HF pools at the argmax id for the legacy eos_token_id 2, else at the first eos_token_id: open_clip's
    # argmax too when that id is the largest, its 'eos' pooling otherwise.
    if text.eos_token_id not in (LEGACY_EOS_ID, text.vocab_size - 1):
        text_cfg.update(pool_type="eos", eos_id=text.eos_token_id)
    vision_cfg = {"image_size": vision.image_size, "layers": vision.num_hidden_layers, "width": vision.hidden_size,
                  "patch_size": vision.patch_size, "head_width": vision.hidden_size // vision.num_attention_heads,
                  **_mlp_ratio(vision)}
    return {"embed_dim": config.projection_dim, "quick_gelu": text.hidden_act == HF_ACTIVATIONS[True],
            "vision_cfg": vision_cfg, "text_cfg": text_cfg}


def _load_file(path: Path) -> Dict[str, Tensor]:
    if path.name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


def read_hf_weights(hf_dir: Path | str) -> Dict[str, Tensor]:
    """Every tensor of the folder's weights: model.safetensors, pytorch_model.bin, or their sharded index."""
    hf_dir = Path(hf_dir)
    for name in (SAFETENSORS_FILE, PICKLE_FILE):
        if (hf_dir / name).is_file():
            return _load_file(hf_dir / name)
        index = hf_dir / (name + INDEX_SUFFIX)
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return {key: tensor for shard in shards for key, tensor in _load_file(hf_dir / shard).items()}
    raise FileNotFoundError(f"no weights in {hf_dir}: expected {SAFETENSORS_FILE}, {PICKLE_FILE} or a sharded "
                            f"index ({SAFETENSORS_FILE}{INDEX_SUFFIX}, {PICKLE_FILE}{INDEX_SUFFIX})")


def _check_vocabulary(hf_dir: Path) -> None:
    """A vocab.json beside the weights must be open_clip's BPE, or open_clip would tokenize differently."""
    path = hf_dir / "vocab.json"
    if path.is_file() and json.loads(path.read_text(encoding="utf-8")) != json.loads(
            bpe_files(_open_clip_tokenizer())[0]):
        raise UnsupportedModel(f"{path} is not CLIP's BPE vocabulary: open_clip's tokenizer would give other ids")


def hf_to_open_clip(hf_dir: Path | str) -> Tuple[dict, Dict[str, Tensor]]:
    """Read a `transformers.CLIPModel` folder as (open_clip model config, open_clip state dict).

    `open_clip.CLIP(**model_config).load_state_dict(state_dict, strict=True)` rebuilds the model; tensors keep
    their dtype. The image preprocessing of the folder, if any, is `hf_preprocess_cfg`.

    Raises:
        UnsupportedModel: a config open_clip cannot express (activation, LayerNorm eps, ...), named.
        CheckpointMismatch: the weights miss tensors the config needs or hold others (named).
    """
    hf_dir = Path(hf_dir)
    config = read_hf_config(hf_dir)
    model_config = open_clip_config_for(config)
    _check_vocabulary(hf_dir)
    # position_ids are index buffers that transformers before 4.31 saved with the weights.
    tensors = {name: tensor for name, tensor in read_hf_weights(hf_dir).items()
               if not name.endswith("embeddings.position_ids")}
    check_tensors(tensors, hf_tensor_shapes(config), str(hf_dir))
    pairs = tensor_map(config.text_config.num_hidden_layers, config.vision_config.num_hidden_layers)
    return model_config, {pair.open_clip: _to_open_clip(pair, tensors) for pair in pairs}


def hf_preprocess_cfg(hf_dir: Path | str) -> Optional[dict]:
    """open_clip's preprocess cfg (size, mean, std, interpolation, resize_mode) of the folder's
    preprocessor_config.json (`create_model_and_transforms(..., force_preprocess_cfg=...)`), or None."""
    path = Path(hf_dir) / PREPROCESSOR_FILE
    if not path.is_file():
        return None
    processor = json.loads(path.read_text())
    size = processor.get("crop_size") if processor.get("do_center_crop", True) else processor.get("size")
    size = size.get("height", size.get("shortest_edge")) if isinstance(size, Mapping) else size
    interpolation = {code: name for name, code in PIL_RESAMPLE.items()}.get(processor.get("resample"), "bicubic")
    resize_mode = "shortest" if processor.get("do_center_crop", True) else "squash"
    return {"size": size, "mean": tuple(processor["image_mean"]), "std": tuple(processor["image_std"]),
            "interpolation": interpolation, "resize_mode": resize_mode}



# The fields that make two open_clip configs one architecture (what a state dict and a forward depend on).
ARCHITECTURE_FIELDS = {"": ("embed_dim", "quick_gelu"),
                       "vision_cfg": ("image_size", "layers", "width", "patch_size", "head_width", "mlp_ratio"),
                       "text_cfg": ("context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio",
                                    "pool_type")}
FIELD_DEFAULTS = {"quick_gelu": False, "head_width": 64, "mlp_ratio": 4.0, "context_length": 77,
                  "vocab_size": 49408, "pool_type": "argmax"}


def _field(config: Mapping, section: str, key: str):
    values = config.get(section, {}) if section else config
    return values.get(key, FIELD_DEFAULTS.get(key))


def config_differences(known: Mapping, derived: Mapping) -> List[str]:
    """Where the architecture of open_clip config `derived` (read from a folder) differs from `known` (a named
    model's), as `field: known -> derived`; empty when they are one architecture."""
    return [f"{section + '.' if section else ''}{key}: {_field(known, section, key)} -> {_field(derived, section, key)}"
            for section, keys in ARCHITECTURE_FIELDS.items() for key in keys
            if _field(known, section, key) != _field(derived, section, key)]


def derived_model_name(config: Mapping) -> str:
    """A name for the open_clip model of a folder that no model name was given for: its shape, e.g.
    `HF-ViT-12x768-p32-224-text-12x512-ctx77-quickgelu`, unique per architecture."""
    vision, text = config["vision_cfg"], config["text_cfg"]
    name = (f"HF-ViT-{vision['layers']}x{vision['width']}-p{vision['patch_size']}-{vision['image_size']}"
            f"-text-{text['layers']}x{text['width']}-ctx{text.get('context_length', 77)}")
    return name + ("-quickgelu" if config.get("quick_gelu") else "")
