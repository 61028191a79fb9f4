"""Each method's typed options: the `method` section of a run's config is its method's class below.

A class extends the shared part (`core.config.MethodConfig`: `name`, `hard_negatives.*`) with the method's own
keys, documented where they are declared; `CHOICES` lists the allowed values of its string options. The
registry (`lightning_modules.methods.REGISTRY`) pairs each method with its class, so a key of another method or
a typo is refused when the config is loaded, naming the method that owns the key or the closest valid key. This
module imports no torch: config checks stay fast.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, Optional, Sequence

from core.config import ATTRIBUTION_CHOICES, AttributionConfig, MethodConfig

Choices = Dict[str, Sequence[str]]


@dataclass
class ClipFTOptions(MethodConfig):
    """CLIP-FT (and NegCLIP with `hard_negatives`): plain contrastive fine-tuning has no options of its own."""

    CHOICES: ClassVar[Choices] = {}


@dataclass
class ClipCAEOptions(MethodConfig):
    """CLIP-CAE: L = L_itc + attr_weight * L_attr with the `attribution` method (needs data.masks=true).

    attr_hinge "batch" = the paper's one hinge max(0, A_obj - A_comp + attr_margin) per (global) batch, A_obj /
    A_comp the mean attribution over all object / composition tokens of the batch; "caption" [ours] = the hinge
    per caption, averaged over the captions with both kinds of tokens.
    """

    CHOICES: ClassVar[Choices] = {"attr_hinge": ("batch", "caption"),
                                  **{f"attribution.{key}": allowed for key, allowed in ATTRIBUTION_CHOICES.items()}}
    # The training-time text attribution whose object / composition balance the hinge corrects.
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    # lambda, the weight of L_attr, and eps, the hinge's margin (the paper's symbols).
    attr_weight: float = 1.0
    attr_margin: float = 0.0
    # One hinge per global "batch" (the paper) or per "caption" [ours].
    attr_hinge: str = "batch"


@dataclass
class MaccoOptions(MethodConfig):
    """MACCO-CLIP: loss weights (1 L_mca + 0.1 L_mir + 20 L_mlm + 250 L_mim), predictor depths and heads, and
    whether the image predictor masks the text keys after EOS [ours; the original has no mask: false in
    configs/macco.yaml]. Without the mask the text runs untrimmed (all 77 positions are keys, as the original).

    mca_masked: which masked copies enter L_mca as extra anchors and negatives: "both" (the paper's 2B x 2B),
    or [ours, to take the contrast apart] "text" ([I] x [T; T~]), "image" ([I; I~] x [T]) or "none" (B x B)."""

    CHOICES: ClassVar[Choices] = {"mca_masked": ("both", "text", "image", "none")}
    # Weights of the four terms: masked contrastive L_mca, masked-to-full alignment L_mir, masked token
    # prediction L_mlm, masked patch prediction L_mim (the paper's 1, 0.1, 20, 250).
    mca_weight: float = 1.0
    mir_weight: float = 0.1
    mlm_weight: float = 20.0
    mim_weight: float = 250.0
    # Cross-attention blocks of the text predictor and of the image predictor, and their attention heads.
    text_predictor_depth: int = 2
    image_predictor_depth: int = 3
    predictor_heads: int = 8
    # true [ours]: the image predictor ignores text keys after EOS; false: the original's unmasked keys.
    key_padding_mask: bool = True
    # Masked copies in L_mca: "both" (the paper), or [ours] "text", "image", "none" (see above).
    mca_masked: str = "both"


@dataclass
class SmartCLIPOptions(MethodConfig):
    """SmartCLIP: 10 (sidm + dism) + 2 mean|m|, fixed temperature 100, hard (straight-through) or soft masks.

    mask_positions: the positions the mask network attends to and pools over: "all" context positions, padding
    after EOS included (the official code), or the "caption" positions SOT..EOS only [ours].
    """

    CHOICES: ClassVar[Choices] = {"mask_positions": ("all", "caption")}
    # Weights of the modular losses (sidm + dism) and of the mask sparsity mean|m|.
    modular_weight: float = 10.0
    sparsity_weight: float = 2.0
    # The fixed inverse temperature of the modular losses.
    modular_temperature: float = 100.0
    # Binary straight-through masks (true) or the soft sigmoid masks (false).
    hard_mask: bool = True
    # Where the mask network looks: "all" context positions (the official code) or the "caption" only [ours].
    mask_positions: str = "all"


@dataclass
class AlignerOptions(MethodConfig):
    """TFLocal / TFGlobal aligners on a frozen backbone: width, depth, heads; loss "infonce" (+ hard-negative
    captions) or "itm" (binary); retrieval re-ranks the frozen-CLIP top-`rerank_k`.

    aligner_negatives: null = every pair of the B x B grid; n = the diagonal plus each image's / text's n most
    similar in-batch partners by frozen cosine (B x (2n+1) pairs instead of B^2).
    """

    CHOICES: ClassVar[Choices] = {"aligner_loss": ("infonce", "itm")}
    # The aligner transformer: width, blocks and attention heads (the paper's 512, 4, 8).
    aligner_width: int = 512
    aligner_layers: int = 4
    aligner_heads: int = 8
    # "infonce" over the pair grid (plus hard-negative captions) or binary "itm".
    aligner_loss: str = "infonce"
    # Retrieval: the aligner re-ranks the frozen CLIP's top k candidates.
    rerank_k: int = 16
    # Pairs scored per step: null = the whole B x B grid; n = the diagonal plus each image's and text's n most
    # similar in-batch partners by frozen cosine.
    aligner_negatives: Optional[int] = None
