"""`python -m evaluation.explain`: Grad-ECLIP heat map and per-token text attribution of
image-text pairs.

    python -m evaluation.explain --run runs/X --image cat.jpg --text "a cat on a mat" \
        --text "a mat"
    python -m evaluation.explain --model ViT-B-32 --pretrained openai --image cat.jpg \
        --text "a cat" --attribution gradcam --start-layer -4 --out cat.png

One PNG with a row per text (evaluation/figures.py): the image in its own colours, the Grad-ECLIP map of S(I, T)
over it with a colour bar (docs/methods.md#grad-eclip-explanations; `--heads` chooses the paper's single-head map
or our multi-head variant) and a bar chart of the text attribution (`--attribution`, any of
`attribution.ATTRIBUTIONS`, renormalised to sum 1 over the caption's own tokens, SOT/EOS excluded). A JSON beside
the PNG (`--out cat.png` or `--out cat`: cat.png and cat.json) and a table on stdout hold the numbers.

The model sees, by `--resize`: "aspect" (default, Grad-ECLIP's explanations): the whole image at its own size
and aspect ratio, its shorter side first brought down to 640 pixels when longer, each side then resized
(bicubic) to the nearest multiple of the patch size; the ViT runs on that patch grid, square or not, with its
positional embeddings resized to it. "square" [ours]: the model's validation transform (resize and centre
crop to its input size). The image shown is that input, de-normalised: the pixels the model saw, so the heat
map lies exactly on what it explains.

The text map explains S(I, T) with the image I of `--text-image`: "centre_crop" (default, Grad-ECLIP's text
explanations) the image's shorter side resized (bicubic) to the model's input size and the centre square cropped,
as the official code's CLIP preprocessing does; "whole" [ours] the image map's input above (the whole image with
`--resize aspect`). The similarity a row reports is that S(I, T).
"""
from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from PIL import Image
from torch import Tensor
from torchvision import transforms
from torchvision.transforms import InterpolationMode

from core.cli import add_output, output_paths
from modeling.encoders import BuiltModel, CLIPEncoders, build_model
from core.files import atomic_write_bytes, atomic_write_text
from evaluation.figures import TextPanel, explanation_figure, png_bytes
from modeling.attribution import (ATTRIBUTIONS, HEADS, TEXT_LAMBDA_RANGES, AttributionOptions,
                                                   TextAttributionInputs, eos_positions, image_grad_eclip,
                                                   text_attribution, word_end_table)
from parsers.images import IMAGE_ERRORS, read_rgb_file

DEFAULTS = AttributionOptions()
END_OF_WORD = "</w>"
# The original's explanations shrink an image whose shorter side passes this many pixels to exactly that.
ASPECT_MAX_SHORT_SIDE = 640


@dataclass
class Explanation:
    """What one (image, text) row shows: the numbers written to the JSON and the heat map drawn."""

    text: str
    similarity: float  # S(I, T), cosine of the L2-normalised embeddings, I the text map's image (--text-image)
    tokens: List[str]  # BPE pieces of positions 1..EOS-1, "</w>" stripped
    token_ids: List[int]
    attributions: List[float]  # one per token, summing to 1 (renormalised; a row with nothing positive stays 0)
    heat_map: np.ndarray  # [H, W] in 0..1, the transform's input size

    def record(self) -> dict:
        return {"text": self.text, "similarity": self.similarity, "tokens": self.tokens,
                "token_ids": self.token_ids, "attributions": self.attributions}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].strip("`: "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--run", type=Path, help="a training run directory (explains its export/)")
    model.add_argument("--model", help="open_clip model name (with --pretrained; none = random weights)")
    parser.add_argument("--pretrained", help="open_clip pretrained tag or checkpoint path")
    parser.add_argument("--config-dir", default="configs/models", help="extra open_clip model configs")
    parser.add_argument("--image", required=True, type=Path)
    parser.add_argument("--text", required=True, action="append", help="caption (repeatable: one row each)")
    parser.add_argument("--attribution", default="grad_eclip", choices=list(ATTRIBUTIONS),
                        help="text attribution method (default: grad_eclip)")
    parser.add_argument("--heads", default=DEFAULTS.heads, choices=HEADS,
                        help="Grad-ECLIP heads, image map and grad_eclip text map (single = the published map, "
                             "the original's one-head re-run; multi = the model as it is, ours)")
    parser.add_argument("--text-lambda-range", default=DEFAULTS.text_lambda_range, choices=TEXT_LAMBDA_RANGES,
                        help="grad_eclip text map: lambda min-max over all context positions (the original) or "
                             "positions up to EOS (ours)")
    parser.add_argument("--layers", type=int, nargs="+", help="attention: blocks averaged (default: all)")
    parser.add_argument("--head-reduce", default=DEFAULTS.head_reduce, choices=("mean", "max"),
                        help="attention: reduction over heads")
    parser.add_argument("--start-layer", type=int, default=DEFAULTS.start_layer,
                        help="gradcam: first block of the relevance product (negative counts from the end)")
    parser.add_argument("--eclip-layers", type=int, default=DEFAULTS.eclip_layers,
                        help="grad_eclip: text map sums the last N blocks")
    parser.add_argument("--resize", default="aspect", choices=RESIZES,
                        help="model input: the whole image, aspect kept, sides rounded to the patch size (aspect, "
                             "the original's explanations) or the validation transform's square crop (ours)")
    parser.add_argument("--text-image", default="centre_crop", choices=TEXT_IMAGES,
                        help="the image whose similarity the text map explains: its centre crop at the model's "
                             "input size (centre_crop, the original's text explanations) or the image map's input "
                             "(whole, ours)")
    add_output(parser, "formats", default=Path("explain.png"),
               help="the PNG and the JSON, each with its own suffix (default explain.png and explain.json)")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def attribution_options_from_args(args: argparse.Namespace) -> AttributionOptions:
    # Perturbation replaces each word by one token here: the kind-preserving replacement of CAE needs the
    # training captions' parsed words, which a single explanation does not have.
    return AttributionOptions(layers=args.layers, head_reduce=args.head_reduce, start_layer=args.start_layer,
                              eclip_layers=args.eclip_layers, heads=args.heads,
                              text_lambda_range=args.text_lambda_range, replacement="token", renormalise=True)


def load_model(args: argparse.Namespace) -> BuiltModel:
    """The run's export, or an open_clip model (build_model switches OpenAI weights to QuickGELU)."""
    try:
        if args.run is not None:
            from modeling.export import load_export

            return load_export(args.run / "export")
        return build_model(args.model, args.pretrained, args.config_dir)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(str(err)) from None


def read_image(path: Path) -> Image.Image:
    """The 8-bit RGB image of `--image`, decoded by `parsers.images` as training and the benchmarks decode it; a
    folder, a missing or an undecodable file exits with a message naming it."""
    if path.is_dir():
        raise SystemExit(f"--image {path} is a folder: give one image file (e.g. {path / 'cat.jpg'})")
    if not path.is_file():
        raise SystemExit(f"--image {path}: no such file")
    try:
        return read_rgb_file(path)
    except IMAGE_ERRORS as err:
        raise SystemExit(f"--image {path}: cannot read it as an image ({err})") from None


def check_texts(texts: Sequence[str], tokenizer) -> None:
    """Refuse empty captions; warn about captions the tokenizer will cut (it keeps SOT + 75 tokens + EOS)."""
    room = tokenizer.context_length - 2
    for text in texts:
        count = len(tokenizer.encode(text))
        if count == 0:
            raise SystemExit(f"--text {text!r}: empty caption has no tokens to attribute")
        if count > room:
            warnings.warn(f"--text {text[:40]!r}...: {count} tokens, truncated to the first {room} "
                          f"(context length {tokenizer.context_length})", stacklevel=2)


def token_pieces(tokenizer, ids: Sequence[int]) -> List[str]:
    """BPE pieces as text: the byte-level alphabet decoded (non-ASCII), the end-of-word mark stripped."""
    pieces = []
    for token_id in ids:
        piece = tokenizer.decoder[token_id].replace(END_OF_WORD, "")
        raw = bytearray(tokenizer.byte_decoder[c] for c in piece)
        pieces.append(raw.decode("utf-8", errors="replace"))
    return pieces


def aspect_preserving_size(width: int, height: int, patch: Sequence[int]) -> tuple[int, int]:
    """(height, width) of Grad-ECLIP's input for an image of `width` x `height` pixels (after the shrink of
    `shrunk_for_explanation`): each side rounded to the nearest multiple of the patch side (at least one patch)."""
    patch_h, patch_w = patch
    return max(1, int(height / patch_h + 0.5)) * patch_h, max(1, int(width / patch_w + 0.5)) * patch_w


def shrunk_for_explanation(image: Image.Image) -> Image.Image:
    """The image with its shorter side brought down to ASPECT_MAX_SHORT_SIDE when longer (bicubic), as the
    original shrinks large images before explaining them."""
    width, height = image.size
    if min(width, height) <= ASPECT_MAX_SHORT_SIDE:
        return image
    scale = min(width, height) / ASPECT_MAX_SHORT_SIDE
    return image.resize((int(width / scale), int(height / scale)), Image.BICUBIC)


def aspect_preserving_input(built: BuiltModel, image: Image.Image) -> Tensor:
    """Grad-ECLIP's input [3, H, W]: the whole image, shrunk when large, sides rounded to the patch size."""
    image = shrunk_for_explanation(image)
    size = aspect_preserving_size(*image.size, built.model.visual.conv1.kernel_size)
    resized = transforms.Resize(size, interpolation=InterpolationMode.BICUBIC)(image)
    config = built.model.visual.preprocess_cfg
    return transforms.functional.normalize(transforms.functional.to_tensor(resized), list(config["mean"]),
                                           list(config["std"]))


def square_input(built: BuiltModel, image: Image.Image) -> Tensor:
    """[ours] The validation transform's input [3, S, S]: resized and centre-cropped to the model's size."""
    return built.preprocess_val(image)


def centre_crop_input(built: BuiltModel, image: Image.Image) -> Tensor:
    """Grad-ECLIP's text-map input [3, S, S], the official code's CLIP preprocessing: the shorter side resized
    (bicubic) to the model's input size S, the centre S x S square cropped, normalised with the model's mean and
    std."""
    config = built.model.visual.preprocess_cfg
    size = (config["size"],) * 2 if isinstance(config["size"], int) else tuple(config["size"])
    resized = transforms.Resize(max(size), interpolation=InterpolationMode.BICUBIC)(image)
    cropped = transforms.CenterCrop(size)(resized)
    return transforms.functional.normalize(transforms.functional.to_tensor(cropped), list(config["mean"]),
                                           list(config["std"]))


# --resize -> (model, image) -> the normalised pixels the model explains
MODEL_INPUTS: Dict[str, Callable[[BuiltModel, Image.Image], Tensor]] = {"aspect": aspect_preserving_input,
                                                                          "square": square_input}
RESIZES = tuple(MODEL_INPUTS)
# --text-image -> the image input the text map's S(I, T) is of (None: the image map's input)
TEXT_IMAGE_INPUTS: Dict[str, Optional[Callable[[BuiltModel, Image.Image], Tensor]]] = {"centre_crop": centre_crop_input,
                                                                                      "whole": None}
TEXT_IMAGES = tuple(TEXT_IMAGE_INPUTS)


def model_input(built: BuiltModel, image: Image.Image, resize: str) -> Tensor:
    """The normalised pixels [3, H, W] the model explains (see the module doc for `resize`)."""
    if resize not in MODEL_INPUTS:
        raise ValueError(f"resize must be one of {', '.join(MODEL_INPUTS)}, got {resize!r}")
    return MODEL_INPUTS[resize](built, image)


def prepare_inputs(built: BuiltModel, image: Image.Image, texts: Sequence[str], device: torch.device,
                   resize: str = "aspect") -> tuple[Tensor, Tensor]:
    """Pixels [T, 3, H, W] (the image once per text) and token ids [T, L] on `device`."""
    pixels = model_input(built, image, resize).unsqueeze(0).expand(len(texts), -1, -1, -1)
    return pixels.to(device), built.tokenizer(list(texts)).to(device)


def text_image_pixels(built: BuiltModel, image: Image.Image, pixels: Tensor, text_image: str) -> Tensor:
    """The pixels [T, 3, H, W] whose S(I, T) the text map explains (`--text-image`; "whole": `pixels` themselves)."""
    if text_image not in TEXT_IMAGE_INPUTS:
        raise ValueError(f"text_image must be one of {', '.join(TEXT_IMAGE_INPUTS)}, got {text_image!r}")
    make = TEXT_IMAGE_INPUTS[text_image]
    if make is None:
        return pixels
    return make(built, image).unsqueeze(0).expand(len(pixels), -1, -1, -1).to(pixels.device)


def explain(built: BuiltModel, pixels: Tensor, ids: Tensor, texts: Sequence[str], method: str,
            options: AttributionOptions, text_pixels: Optional[Tensor] = None) -> List[Explanation]:
    """Similarity, text attribution and image heat map per (image, text) pair: the heat map explains `pixels`, the
    text attribution and the similarity are of `text_pixels` (`text_image_pixels`; None: `pixels`)."""
    encoders = CLIPEncoders(built.model.eval())
    word_ends = word_end_table(built.tokenizer, built.model.vocab_size)
    # No torch.no_grad anywhere: the gradient-based maps differentiate S(I, T) (the weights keep
    # requires_grad so the forward records a graph; autograd.grad leaves their .grad untouched).
    text_pixels = pixels if text_pixels is None else text_pixels
    image = F.normalize(encoders.encode_image(text_pixels, resize_positions=True).pooled.detach(), dim=-1)
    text = encoders.encode_text(ids, attn=True)
    inputs = TextAttributionInputs(encoders, ids, image, text, word_ends)
    attribution = text_attribution(method, inputs, options).detach().cpu()
    heat_maps = image_grad_eclip(encoders, pixels, text.pooled.detach(), heads=options.heads).detach().cpu()
    similarity = inputs.target.detach().cpu()
    eos = eos_positions(ids).cpu()
    rows = []
    for b, caption in enumerate(texts):
        content = ids[b, 1: int(eos[b])].tolist()
        rows.append(Explanation(caption, float(similarity[b]), token_pieces(built.tokenizer, content), content,
                                attribution[b, 1: int(eos[b])].tolist(), heat_maps[b].numpy()))
    return rows


def display_image(pixels: Tensor, preprocess) -> np.ndarray:
    """The transform's output [3, H, W] de-normalised to an [H, W, 3] array in 0..1."""
    normalize = next((t for t in getattr(preprocess, "transforms", []) if isinstance(t, transforms.Normalize)),
                     None)
    image = pixels.detach().cpu().float()
    if normalize is not None:
        image = image * torch.tensor(normalize.std).view(3, 1, 1) + torch.tensor(normalize.mean).view(3, 1, 1)
    return image.clamp(0, 1).permute(1, 2, 0).numpy()


def plot(image: np.ndarray, rows: Sequence[Explanation], method: str, heads: str) -> Figure:
    """One panel per text, one text per row (evaluation/figures.py): the image, its heat map and the token bars."""
    panels = [[TextPanel(row.text, row.similarity, row.tokens, row.attributions, row.heat_map)] for row in rows]
    return explanation_figure(image, panels, method, heads)


def attribution_table(rows: Sequence[Explanation], method: str) -> str:
    lines = []
    for row in rows:
        lines.append(f'"{row.text}"  S(I,T) = {row.similarity:.4f}  ({method})')
        width = max(len(token) for token in row.tokens)
        lines.extend(f"  {token:<{width}}  {value:.4f}" for token, value in zip(row.tokens, row.attributions))
    return "\n".join(lines)


def save(out: Path, figure: Figure, report: dict) -> Dict[str, Path]:
    """The PNG and the JSON of `--out` (`output_paths`), both written atomically; returns them by suffix."""
    paths = output_paths(out, (".png", ".json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(paths[".png"], png_bytes(figure))
    atomic_write_text(paths[".json"], json.dumps(report, indent=2))
    return paths


def run_report(args: argparse.Namespace, built: BuiltModel, options: AttributionOptions,
               rows: Sequence[Explanation]) -> dict:
    source = str(args.run) if args.run is not None else args.pretrained  # None: random weights
    return {"model": built.name, "source": source, "image": str(args.image), "resize": args.resize,
            "text_image": args.text_image, "image_shown": "the model's input, de-normalised",
            "attribution": args.attribution, "options": asdict(options), "rows": [row.record() for row in rows]}


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    image = read_image(args.image)
    built = load_model(args)
    check_texts(args.text, built.tokenizer)
    options = attribution_options_from_args(args)
    built.model.to(args.device)
    pixels, ids = prepare_inputs(built, image, args.text, torch.device(args.device), args.resize)
    text_pixels = text_image_pixels(built, image, pixels, args.text_image)
    rows = explain(built, pixels, ids, args.text, args.attribution, options, text_pixels)
    figure = plot(display_image(pixels[0], built.preprocess_val), rows, args.attribution, args.heads)
    paths = save(args.out, figure, run_report(args, built, options, rows))
    print(attribution_table(rows, args.attribution))
    print(f"wrote {paths['.png']} and {paths['.json']}")


if __name__ == "__main__":
    main()
