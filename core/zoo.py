"""The published compositional CLIP checkpoints: where each is, its format, and the model it loads into.

A paper on compositionality compares against the published fine-tuned CLIPs, and most of them are not plain open_clip
files: OpenAI `clip` state dicts, training checkpoints under a `state_dict` key or a DDP `module.` prefix, full
state dicts carrying LoRA tensors (DAC, TSVLC, FSC-CLIP's LoRA variants), a 64-token text context (CLoVe). `ZOO`
records, per checkpoint, what it takes to load it exactly (`modeling/checkpoints.py` reads each format strictly), and
the numbers reported for it, with their source. `python -m evaluation --model zoo:NAME --pretrained FILE` scores one,
`model.pretrained=zoo:NAME:FILE` starts a training run from it; docs/zoo.md is generated from this table
(`python -m core.zoo --out docs/zoo.md`).

Architectures: every checkpoint below that was fine-tuned from OpenAI's CLIP was trained with QuickGELU, so it is
built as `<arch>-quickgelu`. Several authors' own evaluation scripts load their files under the plain open_clip
name, which runs GELU instead (the activation open_clip picks only for the `openai` tag); their published numbers
may carry that mistake, ours do not.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

from core.cli import add_output
from core.files import atomic_write_text

# Who reports a number (`Reported.source`); docs/zoo.md prints each with its reference.
SOURCES: Mapping[str, str] = {
    "vl_compo": "Oh et al., CVPRW 2024: results.csv of ytaek-oh/vl_compo (commit 43e2eae), the checkpoint's row",
    "aro_paper": "Yuksekgonul et al., ICLR 2023, Table 6 (as quoted in mertyg/vision-language-models-are-bows issues "
                 "9 and 33)",
    "ce_clip_readme": "lezhang7/Enhance-FineGrained README result tables (commit ef87eb7, assets/*.png): the CE-CLIP "
                      "paper's Tables 1-3",
    "fsc_clip_readme": "ytaek-oh/fsc-clip README, Model Zoo table (commit 604015d)",
}


@dataclass(frozen=True)
class Reported:
    """A number reported for a checkpoint: `value` (percent) of `metric`, by `source` (a key of SOURCES)."""

    metric: str
    value: float
    source: str

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"unknown source {self.source!r}; known: {', '.join(SOURCES)}")


@dataclass(frozen=True)
class ZooEntry:
    """One published checkpoint.

    Attributes:
        name: the registry key (`zoo:<name>`).
        title: the name papers print.
        paper: authors, title, venue.
        code: the official repository.
        weights: where to download the file(s), as the authors publish them.
        format: how the file is read (a key of `modeling.checkpoints.FORMATS`); None for a checkpoint that is not
            released as CLIP weights (the entry then only documents it).
        architecture: the open_clip model it loads into, strictly.
        context_length: the text context it was trained with (CLoVe: 64).
        base: the pretrained tag it was fine-tuned from (its interpolation start, and the base a LoRA file or a
            WiSE-FT patch is applied to).
        wise_ft: for a checkpoint published before its authors' WiSE-FT patch (CLoVe), the weight of the file in
            `(1 - w) base + w file`; None for a checkpoint used as it is.
        lora_scale: alpha / rank of a LoRA file (DAC, TSVLC, FSC-CLIP's LoRA variants: 1 / 4).
        trust_pickle: the file pickles objects besides tensors (numpy scalars in FSC-CLIP's files) and needs
            `torch.load(weights_only=False)`: only for files from the source named in `weights`.
        reported: numbers reported for it, each with its source.
        notes: what a user must know to load or read it.
    """

    name: str
    title: str
    paper: str
    code: str
    weights: str
    format: Optional[str]
    architecture: str
    context_length: int = 77
    base: str = "openai"
    wise_ft: Optional[float] = None
    lora_scale: Optional[float] = None
    trust_pickle: bool = False
    reported: Sequence[Reported] = field(default_factory=tuple)
    notes: str = ""


def _vl_compo(comp_avg: float, aro: float, sugarcrepe: float, valse: float, winoground: float, imagenet: float,
              elevater: float) -> tuple:
    """The row vl_compo reports for a checkpoint (results.csv columns of the same names)."""
    return (Reported("vl_compo comp_avg (12 benchmarks)", comp_avg, "vl_compo"),
            Reported("ARO (mean of 4)", aro, "vl_compo"), Reported("SugarCrepe", sugarcrepe, "vl_compo"),
            Reported("VALSE", valse, "vl_compo"), Reported("Winoground group", winoground, "vl_compo"),
            Reported("ImageNet zero-shot top-1", imagenet, "vl_compo"),
            Reported("ELEVATER 21-task mean", elevater, "vl_compo"))


def _fsc_clip(comp: float, zero_shot: float, i2t: float, t2i: float) -> tuple:
    return (Reported("fsc-clip Comp (11 benchmarks)", comp, "fsc_clip_readme"),
            Reported("21-task zero-shot mean", zero_shot, "fsc_clip_readme"),
            Reported("retrieval image-to-text (mean)", i2t, "fsc_clip_readme"),
            Reported("retrieval text-to-image (mean)", t2i, "fsc_clip_readme"))


LORA_NOTE = ("the file is a full state dict: the frozen OpenAI weights and the LoRA tensors (rank 4, alpha 1) on every "
             "block's packed attention in_proj, out_proj, mlp.c_fc, mlp.c_proj of both towers and on visual.conv1; "
             "they are merged as W + (alpha / rank) B A")
DAC_PAPER = "Doveh et al., Dense and Aligned Captions (DAC) Promote Compositional Reasoning in VL Models, NeurIPS 2023"
TSVLC_PAPER = "Doveh et al., Teaching Structured Vision & Language Concepts to Vision & Language Models, CVPR 2023"
FSC_PAPER = ("Oh et al., Preserving Multi-Modal Capabilities of Pre-trained VLMs for Improving Vision-Linguistic "
             "Compositionality, EMNLP 2024")
FSC_WEIGHTS = "https://huggingface.co/ytaek-oh/fsc-clip/resolve/main/{file}"

ENTRIES = (
    ZooEntry("negclip", "NegCLIP",
             "Yuksekgonul et al., When and why vision-language models behave like bags-of-words, ICLR 2023",
             "https://github.com/mertyg/vision-language-models-are-bows",
             "Google Drive file 1ooVVPxB-tvptgmHlIMMFGV3Cg-IrhbRZ (negclip.pth: gdown --id <id>)",
             "open_clip", "ViT-B-32-quickgelu",
             reported=(Reported("ARO VG-Relation", 81.0, "aro_paper"),
                       Reported("ARO VG-Attribution", 71.0, "aro_paper"),
                       Reported("ARO Flickr30k-Order", 91.0, "aro_paper"),
                       *_vl_compo(47.86, 80.88, 83.69, 73.72, 8.0, 60.93, 55.89)),
             notes="an open_clip 1.3 training checkpoint ({epoch, name, state_dict, optimizer}), trained on one GPU"),
    ZooEntry("ce_clip", "CE-CLIP",
             "Zhang et al., Contrasting Intra-Modal and Ranking Cross-Modal Hard Negatives to Enhance "
             "Visio-Linguistic Compositional Understanding, CVPR 2024",
             "https://github.com/lezhang7/Enhance-FineGrained",
             "Google Drive file 1DWPw3CtGh5cHz9bW_-iXRSG7BBUVl13K (mirror: https://huggingface.co/le723z/CE_CLIP)",
             "wrappers", "ViT-B-32-quickgelu",
             reported=(Reported("ARO VG-Relation", 83.0, "ce_clip_readme"),
                       Reported("ARO VG-Attribution", 76.4, "ce_clip_readme"),
                       Reported("VALSE", 72.5, "ce_clip_readme"),
                       *_vl_compo(47.21, 76.27, 85.67, 76.73, 5.25, 49.92, 49.86)),
             notes="an open_clip 2.10 training checkpoint, trained with DDP (keys may carry `module.`)"),
    ZooEntry("gnm_clip", "GNM-CLIP",
             "Sahin et al., Enhancing Multimodal Compositional Reasoning of Visual Language Models with Generative "
             "Negative Mining, WACV 2024",
             "https://github.com/ugorsahin/Generative-Negative-Mining",
             "https://huggingface.co/ugursahin/generative-negative-mining-clip/resolve/"
             "9bbcf4422926b303d3235b4c1377c84d76791e3a/gnm_clip.pt",
             "openai", "ViT-B-32-quickgelu",
             reported=_vl_compo(42.73, 57.13, 78.69, 71.08, 10.25, 61.42, 56.29),
             notes="an OpenAI `clip` package checkpoint ({epoch, model_state_dict, optimizer_state_dict, loss}), "
                   "partly float16: cast to float32"),
    ZooEntry("clove", "CLoVe",
             "Castro et al., CLoVe: Encoding Compositional Language in Contrastive Vision-Language Models, 2024",
             "https://github.com/Netflix/clove",
             "https://github.com/Netflix/clove/releases/download/pretrained/clove_without_patching.pt",
             "wrappers", "ViT-B-32-quickgelu", context_length=64, wise_ft=0.6,
             notes="a 64-token text context (the first 64 positions of OpenAI's 77, not a stretch); the published "
                   "model is the authors' WiSE-FT patch 0.4 OpenAI + 0.6 file, OpenAI's side cut to 64 positions "
                   "(`zoo:clove_unpatched` is the file alone)"),
    ZooEntry("clove_unpatched", "CLoVe (without patching)",
             "Castro et al., CLoVe: Encoding Compositional Language in Contrastive Vision-Language Models, 2024",
             "https://github.com/Netflix/clove",
             "https://github.com/Netflix/clove/releases/download/pretrained/clove_without_patching.pt",
             "wrappers", "ViT-B-32-quickgelu", context_length=64,
             reported=_vl_compo(47.32, 82.96, 84.50, 71.86, 6.5, 53.07, 50.94),
             notes="the released file as it is; vl_compo's CLoVe row (ImageNet 53.1) matches it rather than the "
                   "patched model"),
    ZooEntry("dac_llm", "DAC-LLM", DAC_PAPER, "https://github.com/SivanDoveh/DAC",
             "Google Drive folder 1DmHeV8oWiMwtkaTH-nruMyjBiuJvcwnv (the LLM checkpoint)",
             "lora", "ViT-B-32-quickgelu", lora_scale=0.25,
             reported=_vl_compo(49.76, 86.39, 85.27, 70.46, 4.75, 51.06, 51.09), notes=LORA_NOTE),
    ZooEntry("dac_sam", "DAC-SAM", DAC_PAPER, "https://github.com/SivanDoveh/DAC",
             "Google Drive folder 1DmHeV8oWiMwtkaTH-nruMyjBiuJvcwnv (the SAM checkpoint)",
             "lora", "ViT-B-32-quickgelu", lora_scale=0.25,
             reported=_vl_compo(49.80, 83.34, 83.80, 70.25, 8.5, 52.35, 51.86), notes=LORA_NOTE),
    ZooEntry("tsvlc_rb", "TSVLC (RB negatives)", TSVLC_PAPER, "https://github.com/SivanDoveh/TSVLC",
             "not in the authors' announced files (vl_compo scores it as TSVLC-Negs_RB)",
             "lora", "ViT-B-32-quickgelu", lora_scale=0.25,
             reported=_vl_compo(46.09, 83.54, 76.88, 69.35, 6.75, 58.47, 54.92), notes=LORA_NOTE),
    ZooEntry("tsvlc_rb_llm", "TSVLC (RB + LLM negatives)", TSVLC_PAPER, "https://github.com/SivanDoveh/TSVLC",
             "Google Drive folder 1WosT_kdam1ymWjVSK2ezyydLoqmm0LdX",
             "lora", "ViT-B-32-quickgelu", lora_scale=0.25,
             reported=_vl_compo(45.79, 82.67, 73.19, 72.08, 5.75, 59.73, 55.35), notes=LORA_NOTE),
    ZooEntry("fsc_clip", "FSC-CLIP (COCO, ViT-B/32)", FSC_PAPER, "https://github.com/ytaek-oh/fsc-clip",
             FSC_WEIGHTS.format(file="coco_fsc-clip-ViT-B-32.pt"), "wrappers", "ViT-B-32-quickgelu",
             trust_pickle=True, reported=_fsc_clip(54.2, 55.7, 66.3, 58.3),
             notes="an open_clip 2.24 training checkpoint; it pickles numpy scalars, so it is read with "
                   "torch.load(weights_only=False): load only the authors' file"),
    ZooEntry("fsc_clip_lora", "FSC-CLIP LoRA (COCO, ViT-B/32)", FSC_PAPER, "https://github.com/ytaek-oh/fsc-clip",
             FSC_WEIGHTS.format(file="coco_fsc-clip-lora-ViT-B-32.pt"), "lora", "ViT-B-32-quickgelu",
             lora_scale=0.25, trust_pickle=True, reported=_fsc_clip(53.6, 55.5, 65.2, 57.2), notes=LORA_NOTE),
    ZooEntry("clip_cae", "CLIP-CAE (attention-based)",
             "Li et al., Interpretable Composition Attribution Enhancement for Visio-linguistic Compositional "
             "Understanding, EMNLP 2024",
             "no code released; weights at https://huggingface.co/hiker-lw/CLIP-CAE",
             "https://huggingface.co/hiker-lw/CLIP-CAE (CLIP-CAE-AB.pt; -GCB, -PB, -GB for the other attributions)",
             "wrappers", "ViT-B-32-quickgelu",
             notes="the model card loads it as open_clip ViT-B-32 (GELU); it was fine-tuned from OpenAI's weights"),
    ZooEntry("macco_clip", "MACCO-CLIP",
             "Li et al., Cross-Modal Masked Compositional Concept Modeling for Enhancing Visio-Linguistic "
             "Compositionality, ACL 2026",
             "https://github.com/hiker-lw/MACCO",
             "https://huggingface.co/hiker-lw/MACCO (MACCO-CLIP-ViT-B-32.pt)",
             "wrappers", "ViT-B-32-quickgelu",
             notes="{epoch, name, state_dict} of the CLIP alone (the predictor heads are not in the file)"),
    ZooEntry("smartclip", "SmartCLIP",
             "Xie et al., SmartCLIP: Modular Vision-language Alignment with Identification Guarantees, CVPR 2025",
             "https://github.com/Mid-Push/SmartCLIP", "no released CLIP weights found", None, "ViT-B-16-quickgelu",
             notes="its model adds a text-conditioned mask network over the image embedding, so a release would not "
                   "be a plain CLIP; train it here with configs/smartclip.yaml"),
)
ZOO: Dict[str, ZooEntry] = {entry.name: entry for entry in ENTRIES}

ZOO_PREFIX = "zoo:"


def zoo_entry(name: str) -> ZooEntry:
    """The entry registered as `name` (with or without the `zoo:` prefix); an unknown name lists the known ones."""
    key = name[len(ZOO_PREFIX):] if name.startswith(ZOO_PREFIX) else name
    if key not in ZOO:
        raise KeyError(f"unknown zoo checkpoint {key!r}; the zoo holds: {', '.join(ZOO)}")
    entry = ZOO[key]
    if entry.format is None:
        raise ValueError(f"zoo:{key} ({entry.title}) cannot be loaded: {entry.weights}. {entry.notes}")
    return entry


def markdown(entries: Sequence[ZooEntry] = ENTRIES) -> str:
    """docs/zoo.md: every checkpoint, how it loads, and what is reported for it."""
    lines = ["# Published checkpoints (the model zoo)", "",
             "Generated from `core/zoo.py` by `python -m core.zoo --out docs/zoo.md`; do not edit by hand. How to "
             "score and train from them: [evaluation](evaluation.md#published-checkpoints), "
             "[training](training.md#starting-from-a-published-checkpoint).", "",
             "| zoo name | checkpoint | format | loads into | context | base |", "|---|---|---|---|---:|---|"]
    lines += [f"| `zoo:{e.name}` | {e.title} | {e.format or 'not released'} | `{e.architecture}` | {e.context_length} "
              f"| {e.base}{f' (WiSE-FT {e.wise_ft})' if e.wise_ft else ''} |" for e in entries]
    for entry in entries:
        lines += ["", f"## {entry.title} (`zoo:{entry.name}`)", "", f"- Paper: {entry.paper}.",
                  f"- Code: {entry.code}", f"- Weights: {entry.weights}"]
        if entry.notes:
            lines.append(f"- Format: {entry.notes}.")
        if entry.reported:
            lines += ["", "| reported | value | source |", "|---|---:|---|"]
            lines += [f"| {r.metric} | {r.value:.2f} | {r.source} |" for r in entry.reported]
    lines += ["", "## Sources", ""] + [f"- `{key}`: {text}" for key, text in SOURCES.items()]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Write the model zoo's page (docs/zoo.md) from core/zoo.py.")
    add_output(parser, "file", help="the page to write (default docs/zoo.md)", default=Path("docs/zoo.md"))
    args = parser.parse_args(argv)
    atomic_write_text(args.out, markdown())
    print(f"wrote {args.out} ({len(ENTRIES)} checkpoints)")


if __name__ == "__main__":
    main()
