"""Regenerate the Grad-ECLIP parity fixture (`tests/data/parity/gradeclip`) by running the official code.

    python -m testkit.parity.gradeclip --official /path/to/Grad-Eclip --out tests/data/parity/gradeclip

`--official` is a checkout of github.com/Cyang-Zhao/Grad-Eclip at commit 5c1b5cc (a clone or a `git archive` of
it; the three files read are checked against that commit's git blob ids). That code is two notebooks and a script
that loads ViT-B/16 at import, not a package, so the functions the fixture needs are read by name from the
checkout's files and compiled unchanged, except that the image encoders' `x = x.half()` is dropped: the notebooks
run a CUDA fp16 model, the fixture a float32 one on the CPU. Nothing of that code is in this file. The functions
see the names the notebooks define around them (`clipmodel`, `clip_inres`, `clip_ksize`, `eos_position`) and run
on OpenAI `clip`'s own model classes, built tiny; `clip/model.py` is loaded by its file path because the
package's `__init__` imports `pkg_resources`, which recent setuptools no longer ship, and the model file needs
nothing from it.

The weights are saved under open_clip's names (OpenAI's and open_clip's CLIP share them) with an open_clip config,
and the script checks that open_clip loads them strictly and computes the same embeddings. One thread, fixed
seeds: two runs write identical bytes. The written README.md explains every tensor.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib.util
import io
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, List, Sequence, Tuple

import open_clip
import torch
import torch.nn.functional as F
import torchvision.transforms as T
from safetensors.torch import save_file
from torch import Tensor, nn

from core import cli

REPOSITORY = "Cyang-Zhao/Grad-Eclip"
COMMIT = "5c1b5cc"
# git blob ids of the files read, at that commit: a checkout that differs is refused.
OFFICIAL_FILES = {
    "grad_eclip_image.ipynb": "8a8bab421b23f3583791d082bcaff17e51942a1d",
    "grad_eclip_text.ipynb": "f2a27ead3338b63496a6381419ed43173e29b8dc",
    "generate_emap.py": "3319278ff05edf6c4278383594ab9cfecbd7ac86",
}
IMAGE_FUNCTIONS = ("attention_layer", "clip_encode_dense", "sim_qk", "grad_eclip")
TEXT_FUNCTIONS = ("attention_layer", "clip_encode_text_dense", "sim_qk", "grad_eclip")
VARIANT_FUNCTIONS = ("attention_layer", "clip_encode_dense", "clip_encode_text_dense", "grad_eclip", "grad_eclip_text")
CAPTIONS = ("a dog in a car waiting for traffic lights", "a man riding a horse",
            "two red cubes to the left of a small blue ball")
N_IMAGES = 2
# The first seed (from 0) whose maps pass `check_premises`: with seeds 0 and 1 every token of a caption's text
# map is relu'd to zero.
SEED = 2
COMMAND = "python -m testkit.parity.gradeclip --official /path/to/Grad-Eclip --out tests/data/parity/gradeclip"


@dataclass(frozen=True)
class TinyCLIP:
    """The fixture model: the smallest CLIP on which every path of the parity test runs (README "Model")."""

    name: str = "GradECLIP-Tiny-4-16"
    embed_dim: int = 16
    image_size: int = 16
    patch_size: int = 4  # a 4x4 grid: interior patches, so min-max then resize differs from resize then min-max
    vision_width: int = 16
    vision_heads: int = 2  # more than one, so the official single-head re-run is not the model itself
    vision_layers: int = 2  # the re-run last block follows a block that runs unchanged
    text_width: int = 16
    text_heads: int = 2
    text_layers: int = 3  # one block runs unchanged before the explained ones
    k_text_blocks: int = 2  # two explained blocks: per-block lambda, summed before the relu
    context_length: int = 77  # the official lambda range spans every context position, padding included

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size


# ----- the official code ----------------------------------------------------------------------------------
def git_blob_id(data: bytes) -> str:
    """The id git gives a file's content (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_checkout(root: Path) -> None:
    """Refuse a checkout whose files are not those of the pinned commit."""
    for name, blob in OFFICIAL_FILES.items():
        path = root / name
        if not path.is_file():
            raise SystemExit(f"{path} not found: --official must be a checkout of {REPOSITORY} @ {COMMIT}")
        if git_blob_id(path.read_bytes()) != blob:
            raise SystemExit(f"{path} is not the file of {REPOSITORY} @ {COMMIT} (git blob {blob})")


def code_cells(path: Path) -> List[str]:
    """A notebook's code cells, or a script's whole text; IPython's `%` and `!` lines are blanked (not Python)."""
    if path.suffix != ".ipynb":
        return [path.read_text()]
    cells = json.loads(path.read_text())["cells"]
    sources = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]
    return ["\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))
            for source in sources]


class DropHalfCast(ast.NodeTransformer):
    """Removes the statement `x = x.half()` (the image encoders' cast of the input to the GPU model's fp16)."""

    def __init__(self) -> None:
        self.dropped = 0

    def visit_Assign(self, node: ast.Assign):
        if ast.unparse(node) == "x = x.half()":
            self.dropped += 1
            return None
        return node


def official_functions(path: Path, names: Sequence[str], namespace: Dict[str, object]) -> Dict[str, object]:
    """Compile the top-level functions `names` of an official file into `namespace` (their globals); returns it."""
    found: Dict[str, ast.FunctionDef] = {}
    for source in code_cells(path):
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                if node.name in found:
                    raise ValueError(f"{path.name} defines {node.name} twice")
                found[node.name] = node
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(f"{path.name} does not define {', '.join(missing)}")
    if "clip_encode_dense" in found:
        cast = DropHalfCast()
        found["clip_encode_dense"] = cast.visit(found["clip_encode_dense"])
        if cast.dropped != 1:
            raise ValueError(f"{path.name}: expected one `x = x.half()` in clip_encode_dense, found {cast.dropped}")
    module = ast.fix_missing_locations(ast.Module(body=[found[name] for name in names], type_ignores=[]))
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - the pinned official code, by design
    return namespace


def openai_clip_model() -> ModuleType:
    """OpenAI `clip`'s `model.py`, loaded by file path (the package's `__init__` imports `pkg_resources`)."""
    spec = importlib.util.find_spec("clip")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("OpenAI's `clip` package is needed (pip install openai-clip)")
    path = Path(list(spec.submodule_search_locations)[0]) / "model.py"
    module_spec = importlib.util.spec_from_file_location("openai_clip_model", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def namespaces(root: Path, model: nn.Module) -> Dict[str, Dict[str, object]]:
    """The official functions, each file's in its own globals, bound to `model` as the notebooks' `clipmodel`."""
    base = {"torch": torch, "F": F, "clipmodel": model}
    image = {**base, "clip_inres": model.visual.input_resolution, "clip_ksize": model.visual.conv1.kernel_size}
    return {"image": official_functions(root / "grad_eclip_image.ipynb", IMAGE_FUNCTIONS, image),
            "text": official_functions(root / "grad_eclip_text.ipynb", TEXT_FUNCTIONS, dict(base)),
            "text_up_to_eos": up_to_eos(official_functions(root / "grad_eclip_text.ipynb", TEXT_FUNCTIONS,
                                                           dict(base))),
            "variant": official_functions(root / "generate_emap.py", VARIANT_FUNCTIONS, dict(base))}


def up_to_eos(namespace: Dict[str, object]) -> Dict[str, object]:
    """The text notebook's functions with `sim_qk` replaced: lambda min-max scaled over positions 0..EOS only
    (not official; the audit variant). The notebook's `grad_eclip` calls whatever `sim_qk` its globals hold."""
    def sim_qk(q: Tensor, k: Tensor) -> Tensor:
        eos = int(namespace["eos_position"])
        cosine = (F.normalize(q[eos, 0, :], dim=-1) * F.normalize(k[:, 0, :], dim=-1)).sum(-1)
        seen = cosine[: eos + 1]
        return (cosine - seen.min()) / (seen.max() - seen.min())

    namespace["sim_qk"] = sim_qk
    return namespace


# ----- the model and its inputs ---------------------------------------------------------------------------
def build_model(config: TinyCLIP, vocab_size: int, seed: int = SEED) -> nn.Module:
    """OpenAI's CLIP at the fixture's size, float32, with every LayerNorm and bias drawn away from its init.

    OpenAI's constructor gives a ViT width // 64 heads, which a narrow tower cannot have: the vision tower is
    built again from the same class with `vision_heads`. Non-trivial LayerNorms and biases make the q and k
    biases and every affine step count.
    """
    openai = openai_clip_model()
    torch.manual_seed(seed)
    model = openai.CLIP(config.embed_dim, config.image_size, config.vision_layers, 64 * config.vision_heads,
                        config.patch_size, config.context_length, vocab_size, config.text_width, config.text_heads,
                        config.text_layers)
    model.visual = openai.VisionTransformer(config.image_size, config.patch_size, config.vision_width,
                                            config.vision_layers, config.vision_heads, config.embed_dim)
    generator = torch.Generator().manual_seed(seed + 1)
    layer_norms = {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, nn.LayerNorm) for p in
                   ("weight", "bias")}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name in layer_norms and name.endswith("weight"):
                parameter.copy_(1 + 0.1 * noise)
            elif name in layer_norms:
                parameter.copy_(0.05 * noise)
            elif name.endswith("bias"):
                parameter.copy_(0.02 * noise)
    return model.eval()


def text_ids(captions: Sequence[str]) -> Tensor:
    """[T, 77] open_clip token ids renumbered 0..V-1 in increasing order, V the captions' distinct ids.

    Renumbering keeps padding at 0 and EOS the largest id (the argmax that finds it) and shrinks the token
    table from 49408 rows to V; a map never looks at which word an id is.
    """
    ids = open_clip.tokenize(list(captions))
    return torch.unique(ids, return_inverse=True)[1]


def smooth_images(config: TinyCLIP, count: int, seed: int = SEED) -> Tensor:
    """[count, 3, S, S] noise on the patch grid, bicubic-upsampled: images with structure at the patch scale."""
    noise = torch.randn(count, 3, config.grid, config.grid, generator=torch.Generator().manual_seed(seed + 2))
    return F.interpolate(noise, size=(config.image_size, config.image_size), mode="bicubic", align_corners=False)


# ----- the official maps ----------------------------------------------------------------------------------
def quiet(function: Callable, *args, **kwargs):
    """Call an official function without its progress prints."""
    with contextlib.redirect_stdout(io.StringIO()):
        return function(*args, **kwargs)


def display_order(grid_map: Tensor, size: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
    """The image notebook's display of a map: min-max on the grid, then torchvision's Resize to the image."""
    scaled = grid_map.clone()
    scaled -= scaled.min()
    scaled /= scaled.max()
    return scaled, T.Resize(size)(scaled.unsqueeze(0))[0]


def image_maps(images: Tensor, text_embeddings: Tensor, encode: Callable[[Tensor], tuple],
               explain: Callable[[Tensor, tuple], Tensor]) -> Tuple[Tensor, Tensor]:
    """Grid maps [B, T, g, g] and explained cosines [B, T]: each image encoded once by `encode` (an official
    dense encoder, batch of one as in the notebooks), each text's cosine explained by `explain`."""
    maps, targets = [], []
    for image in images:
        outputs, *traces = quiet(encode, image[None])
        cosine = (F.normalize(outputs[:, 0], dim=-1) @ text_embeddings.T)[0]
        maps.append(torch.stack([explain(c, traces) for c in cosine]).detach())
        targets.append(cosine.detach())
    return torch.stack(maps), torch.stack(targets)


def notebook_image_maps(ns: Dict[str, object], images: Tensor, text_embeddings: Tensor) -> Tuple[Tensor, Tensor]:
    """`grad_eclip_image.ipynb`: `clip_encode_dense(x, n=1)` then `grad_eclip(c, qs, ks, vs, atten_outs, size)`."""
    def explain(c: Tensor, traces: list) -> Tensor:
        _, vs, qs, ks, _, atten_outs, map_size = traces
        return ns["grad_eclip"](c, qs, ks, vs, atten_outs, map_size)

    return image_maps(images, text_embeddings, lambda x: ns["clip_encode_dense"](x, n=1), explain)


def variant_image_maps(ns: Dict[str, object], images: Tensor, text_embeddings: Tensor) -> Tensor:
    """`generate_emap.py`: `clip_encode_dense(x)` then `grad_eclip(c, q_out, k_out, v, att_output, map_size)`.

    (Its own `__main__` passes five arguments to this six-argument function; the function is called here as
    its signature reads.)
    """
    def explain(c: Tensor, traces: list) -> Tensor:
        _, _, v, q_out, k_out, _, att_output, map_size = traces
        return ns["grad_eclip"](c, q_out, k_out, v, att_output, map_size)

    return image_maps(images, text_embeddings, ns["clip_encode_dense"], explain)[0]


def text_maps(ns: Dict[str, object], ids: Tensor, image_embeddings: Tensor, k: int, official_variant: bool = False
              ) -> Tuple[Tensor, Tensor]:
    """Text maps [T, B, L] (the official values at 1..EOS-1, zeros elsewhere) and explained cosines [T, B].

    Each caption is encoded once with `clip_encode_text_dense(text, n=k)` and each image's cosine explained,
    with the notebook's `grad_eclip(c, qs, ks, vs, atten_outs, eos_position)` or `generate_emap.py`'s
    `grad_eclip_text(c, q_outs, k_outs, vs, atten_outs, eos_position)`.
    """
    maps, targets = [], []
    for text in ids:
        eos_position = text[None].argmax(dim=-1)  # as the notebook: a one-element tensor, read by its sim_qk
        ns["eos_position"] = eos_position
        x, (qs, ks, vs), _, atten_outs = ns["clip_encode_text_dense"](text[None], n=k)
        cosine = image_embeddings @ F.normalize(x, dim=-1).T  # [B, 1]
        explain = ns["grad_eclip_text"] if official_variant else ns["grad_eclip"]
        rows = []
        for c in cosine:
            row = torch.zeros(ids.shape[1])
            row[1: int(eos_position)] = explain(c, qs, ks, vs, atten_outs, eos_position).detach()
            rows.append(row)
        maps.append(torch.stack(rows))
        targets.append(cosine[:, 0].detach())
    return torch.stack(maps), torch.stack(targets)


def official_outputs(root: Path, model: nn.Module, images: Tensor, ids: Tensor, k: int) -> Dict[str, Tensor]:
    """Every expected tensor of the fixture, from the official functions run on `model` (README "Expected")."""
    ns = namespaces(root, model)
    with torch.no_grad():
        image_embeddings = F.normalize(model.encode_image(images), dim=-1)
        text_embeddings = F.normalize(model.encode_text(ids), dim=-1)
    raw, image_target = notebook_image_maps(ns["image"], images, text_embeddings)
    scaled, full = zip(*(display_order(m, tuple(images.shape[-2:])) for m in raw.flatten(0, 1)))
    text_all, text_target = text_maps(ns["text"], ids, image_embeddings, k)
    text_up_to_eos, _ = text_maps(ns["text_up_to_eos"], ids, image_embeddings, k)
    variant_text, _ = text_maps(ns["variant"], ids, image_embeddings, k, official_variant=True)
    return {"image_map_raw": raw, "image_map_minmax": torch.stack(scaled).view_as(raw),
            "image_map_fullres": torch.stack(full).view(*raw.shape[:2], *images.shape[-2:]),
            "image_target_cosine": image_target,
            "text_map_lambda_all_positions": text_all, "text_map_lambda_up_to_eos": text_up_to_eos,
            "text_target_cosine": text_target,
            "variant_generate_emap/image_map_raw": variant_image_maps(ns["variant"], images, text_embeddings),
            "variant_generate_emap/text_map_lambda_all_positions": variant_text,
            "original_model_image_text_cosine": image_embeddings @ text_embeddings.T}


def check_premises(expected: Dict[str, Tensor], eos: Sequence[int]) -> None:
    """Refuse a fixture on which a path of the test would not show: a map with fewer than two positive entries
    (its min-max or sum normalisation would be undefined or one-hot), or variants that nearly coincide."""
    image = expected["image_map_raw"].flatten(0, 1).flatten(1)
    if bool((image.gt(0).sum(dim=1) < 2).any()):
        raise SystemExit("an image map has fewer than two positive patches")
    for maps, end in zip(expected["text_map_lambda_all_positions"], eos):
        if bool((maps[:, 1:end].gt(0).sum(dim=1) < 2).any()):
            raise SystemExit("a text map has fewer than two positive tokens")
    for a, b in (("text_map_lambda_all_positions", "text_map_lambda_up_to_eos"),
                 ("text_map_lambda_all_positions", "variant_generate_emap/text_map_lambda_all_positions"),
                 ("image_map_raw", "variant_generate_emap/image_map_raw")):
        if (expected[a] - expected[b]).abs().max() < 0.05 * expected[a].abs().max():
            raise SystemExit(f"{a} and {b} nearly coincide: the test could not tell them apart")


# ----- open_clip and the files ----------------------------------------------------------------------------
def open_clip_config(config: TinyCLIP, vocab_size: int) -> dict:
    return {"embed_dim": config.embed_dim, "quick_gelu": True,
            "vision_cfg": {"image_size": config.image_size, "layers": config.vision_layers,
                           "width": config.vision_width, "patch_size": config.patch_size,
                           "head_width": config.vision_width // config.vision_heads},
            "text_cfg": {"context_length": config.context_length, "vocab_size": vocab_size,
                         "width": config.text_width, "heads": config.text_heads, "layers": config.text_layers}}


def check_open_clip(config_dir: Path, name: str, weights: Dict[str, Tensor], model: nn.Module, images: Tensor,
                    ids: Tensor) -> None:
    """open_clip loads the weights strictly and computes the OpenAI model's embeddings (to rounding)."""
    open_clip.add_model_config(config_dir)
    twin = open_clip.create_model(name)
    twin.load_state_dict(weights, strict=True)
    twin.eval()
    with torch.no_grad():
        pairs = ((twin.encode_image(images), model.encode_image(images)),
                 (twin.encode_text(ids), model.encode_text(ids)))
    for ours, theirs in pairs:
        if not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6):
            raise SystemExit(f"open_clip's {name} differs from the OpenAI model: "
                             f"{(ours - theirs).abs().max().item():.2e}")


def write_fixture(out: Path, config: TinyCLIP, root: Path) -> None:
    """Build the model and inputs, run the official code on them and write every file of the fixture to `out`."""
    ids = text_ids(CAPTIONS)
    vocab_size = int(ids.max()) + 1
    model = build_model(config, vocab_size)
    images = smooth_images(config, N_IMAGES)
    eos = ids.argmax(dim=-1).tolist()
    expected = official_outputs(root, model, images, ids, config.k_text_blocks)
    check_premises(expected, eos)
    weights = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_configs").mkdir(exist_ok=True)
    for stale in (out / "model_configs").glob("*.json"):  # a config of an earlier model size
        stale.unlink()
    (out / "model_configs" / f"{config.name}.json").write_text(
        json.dumps(open_clip_config(config, vocab_size), indent=2) + "\n")
    check_open_clip(out / "model_configs", config.name, weights, model, images, ids)
    save_file(weights, out / "weights.safetensors", metadata={"model": config.name})
    save_file({"images": images.contiguous(), "text_ids": ids.contiguous()}, out / "inputs.safetensors")
    save_file({key: value.detach().contiguous() for key, value in expected.items()}, out / "expected.safetensors")
    meta = {"model": config.name, "k_text_blocks": config.k_text_blocks, "n_image_blocks": 1,
            "captions": list(CAPTIONS), "eos_positions": eos, "grid": [config.grid, config.grid],
            "image_size": config.image_size, "vision_heads": config.vision_heads, "text_heads": config.text_heads,
            "text_layers": config.text_layers, "vision_layers": config.vision_layers}
    (out / "expected.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out / "README.md").write_text(readme(config, vocab_size, eos, sum(t.numel() for t in weights.values())))


def readme(config: TinyCLIP, vocab_size: int, eos: Sequence[int], parameters: int) -> str:
    files = ", ".join(f"`{name}`" for name in OFFICIAL_FILES)
    return README.format(**asdict(config), grid=config.grid, vocab=vocab_size, vocab_max=vocab_size - 1,
                         eos=", ".join(map(str, eos)), n=N_IMAGES, t=len(CAPTIONS), parameters=parameters, seed=SEED,
                         repository=REPOSITORY, commit=COMMIT, command=COMMAND, files=files,
                         ctx=config.context_length)


README = """# Grad-ECLIP parity fixture

Maps computed by the official Grad-ECLIP code, `{repository}` @ `{commit}`, on a tiny CLIP, for
`tests/test_gradeclip_parity.py`. This folder is written by

```
{command}
```

where `--official` is a checkout of that commit. The script reads the official functions by name from
{files}
(checked against the commit's git blob ids) and runs them. That repository states no licence: none of its code
or text is stored here, only the numbers its code computed. CPU, float32, one thread, fixed seeds: a second run
writes the same bytes. Regenerate; do not edit by hand.

Functions run:
- `grad_eclip_image.ipynb`: `attention_layer`, `clip_encode_dense(x, n=1)`, `sim_qk`, `grad_eclip`;
- `grad_eclip_text.ipynb`: `attention_layer`, `clip_encode_text_dense(text, n=k)`, `sim_qk`, `grad_eclip`;
- `generate_emap.py`: `attention_layer`, `clip_encode_dense`, `clip_encode_text_dense`, `grad_eclip`,
  `grad_eclip_text` (the labelled variant).

They run as written but for one line: the image encoders' `x = x.half()` is dropped (the notebooks run a CUDA
fp16 model, this one is float32). The model is built from OpenAI `clip`'s own `CLIP` and `VisionTransformer`
classes, the model the notebooks were written for, and bound as their global `clipmodel`.

## Model

| part | value |
|---|---|
| open_clip name | `{name}` (`model_configs/{name}.json`) |
| joint embedding | {embed_dim}, QuickGELU |
| vision tower | {image_size} px, patch {patch_size} ({grid}x{grid} grid), width {vision_width}, {vision_heads} heads, \
{vision_layers} layers |
| text tower | width {text_width}, {text_heads} heads, {text_layers} layers, {ctx} positions, {vocab} token ids |
| explained text blocks k | {k_text_blocks} |
| parameters | {parameters} |

`weights.safetensors` is the state dict under open_clip's names: `open_clip.add_model_config(folder)`,
`create_model(name)` and `load_state_dict(..., strict=True)` load it (the script checks that open_clip then
computes the OpenAI model's embeddings). Initial values: OpenAI's initialisation (seed {seed}), then every
LayerNorm weight 1 + 0.1 N(0,1), every LayerNorm bias 0.05 N(0,1) and every other bias 0.02 N(0,1), so that
the biases (those of q and k among them) count. The seed is the first whose maps all have two or more
positive entries.

It is the smallest model on which every path of the test runs:
- two heads per tower: the official maps re-run the explained blocks with one full-width head; with one head
  the re-run would be the model itself and the single- and multi-head maps could not differ;
- two vision layers: the re-run last block follows a block that runs unchanged;
- three text layers, the last two explained: one block runs unchanged first, each explained block has its own
  lambda, and the blocks' maps are summed before the relu (with one block the order would not show). The test
  reads k from `expected.json`; the published k = 8 only makes the same loop visit more blocks;
- a 4x4 grid: interior patches, whose values a bilinear upsampling never reaches exactly, so min-max then
  resize (the notebook) differs from resize then min-max, and a transposed grid shows;
- all 77 text positions: the official lambda is min-max scaled over every context position, padding included;
- the widths change no path, only the size.

The token ids are open_clip's ids of the captions renumbered 0..{vocab_max} in increasing order: padding stays 0
and EOS stays the largest id (found by argmax), and the token table has {vocab} rows, not 49408.

## Inputs (`inputs.safetensors`)

| name | shape | meaning |
|---|---|---|
| `images` | [{n}, 3, {image_size}, {image_size}] f32 | N(0,1) noise on the grid, bicubic-upsampled (normalised units) |
| `text_ids` | [{t}, {ctx}] i64 | the captions in `expected.json`, EOS at {eos} |

## Expected values (`expected.safetensors`, `expected.json`)

Image maps are indexed [image b, text j], text maps [text j, image b]; every (image, text) pair is explained.

| name | shape | meaning |
|---|---|---|
| `image_map_raw` | [{n}, {t}, {grid}, {grid}] | official image map on the grid, relu'd, not scaled |
| `image_map_minmax` | [{n}, {t}, {grid}, {grid}] | the same, min-max scaled per map |
| `image_map_fullres` | [{n}, {t}, {image_size}, {image_size}] | min-max on the grid, then torchvision `Resize` |
| `image_target_cosine` | [{n}, {t}] | the explained c: re-run image embedding . model text embedding |
| `text_map_lambda_all_positions` | [{t}, {n}, {ctx}] | official text map, at 1..EOS-1 (sum 1), zeros elsewhere |
| `text_map_lambda_up_to_eos` | [{t}, {n}, {ctx}] | not official: lambda min-max scaled over 0..EOS only |
| `text_target_cosine` | [{t}, {n}] | the explained c of the text maps |
| `variant_generate_emap/image_map_raw` | as above | `generate_emap.py`: q, k through `out_proj` first |
| `variant_generate_emap/text_map_lambda_all_positions` | as above | the same variant, text |
| `original_model_image_text_cosine` | [{n}, {t}] | the model's own cosines |

`expected.json` holds the captions, the EOS positions, the grid, heads, layers and k.

## What the official code computes

Image (the last block, n = 1):
1. the vision tower runs unchanged up to the last block's input x;
2. that block runs again with one head of the full width W: h = LN1(x), [q, k, v] = h W_in^T + b_in,
   ctx = softmax(q k^T / sqrt(W)) v, x + ctx W_out^T + b_out, then the MLP, `ln_post` and `proj`;
3. c = cosine of the re-run CLS embedding and the text embedding;
4. g = dc/dctx at the CLS row; lambda_i = min-max over the patches of cos(q_CLS, k_i), q and k with bias;
5. map_i = relu(sum_d g_d v_id lambda_i), in row-major grid order.

Text (the last k blocks):
1. the first blocks run unchanged; the last k run again with one head each and the causal mask;
2. c = cosine of the model's image embedding and `ln_final`(EOS row) `text_projection`;
3. per block l: g^l = dc/dctx^l at the EOS row, lambda^l_i = min-max over all positions of cos(q^l_EOS, k^l_i),
   m^l_i = sum_d g^l_d v^l_id lambda^l_i;
4. map = relu(sum_l m^l), kept at 1..EOS-1 and divided by its sum.

`generate_emap.py` passes q and k through `out_proj` before their cosine.
"""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", type=Path, required=True, metavar="DIR",
                        help=f"a checkout of {REPOSITORY} @ {COMMIT} (a clone or a `git archive` of it)")
    cli.add_output(parser, "folder", "the fixture folder to write", required=True)
    args = parser.parse_args(argv)
    check_checkout(args.official)
    torch.set_num_threads(1)  # one reduction order: identical bytes on every run
    write_fixture(args.out, TinyCLIP(), args.official)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
