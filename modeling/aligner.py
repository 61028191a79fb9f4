"""The TFLocal / TFGlobal aligner: a plain `nn.Module` transformer over [CLS; text tokens; image tokens].

`lightning_modules/methods/tflocal.py` trains it and `evaluation/aligner.py` scores benchmarks with it; it lives
below both so that an export can be scored without the training package.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

TEXT, IMAGE = 0, 1  # rows of the modality embedding


class TokenAligner(nn.Module):
    """Scores (image, text) pairs with a transformer over [CLS; text tokens; image tokens].

    Args:
        embed_dim: D, the CLIP joint embedding size of the input tokens.
        width, layers, heads: the transformer (d = 512, 4 layers, 8 heads is ~13M parameters at D = 512).
        text_positions, image_positions: the longest token sets (context length; 1 + P), 1 and 1 for TFGlobal.
        score_bias: a bias on the output score (for the ITM loss).
    """

    def __init__(self, embed_dim: int, width: int = 512, layers: int = 4, heads: int = 8, text_positions: int = 77,
                 image_positions: int = 50, score_bias: bool = False):
        super().__init__()
        self.config = dict(embed_dim=embed_dim, width=width, layers=layers, heads=heads,
                           text_positions=text_positions, image_positions=image_positions, score_bias=score_bias)
        # CLIP's projected tokens have no fixed scale (patch norms differ from EOS norms): normalise first.
        self.input_norm = nn.LayerNorm(embed_dim)
        self.input_proj = nn.Linear(embed_dim, width)
        self.cls = nn.Parameter(0.02 * torch.randn(width))
        self.modality = nn.Parameter(0.02 * torch.randn(2, width))
        self.text_position = nn.Parameter(0.02 * torch.randn(text_positions, width))
        self.image_position = nn.Parameter(0.02 * torch.randn(image_positions, width))
        # Dropout 0 [ours]: the paper gives none, and a deterministic forward keeps train-mode parity tests exact.
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(width), enable_nested_tensor=False)
        # InfoNCE is invariant to a shift of all scores, so a final bias would never receive a gradient: only
        # the binary ITM loss (which calibrates an absolute threshold) has one.
        self.head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1, bias=score_bias))

    def embed(self, tokens: Tensor, modality: int) -> Tensor:
        """Input tokens [N, T, D] -> [N, T, d] with position and modality embeddings (once per item, not pair)."""
        positions = self.text_position if modality == TEXT else self.image_position
        if tokens.shape[1] > positions.shape[0]:
            raise ValueError(f"{tokens.shape[1]} tokens, but the aligner has {positions.shape[0]} positions")
        x = self.input_proj(self.input_norm(tokens.to(self.input_proj.weight.dtype)))
        return x + positions[:tokens.shape[1]] + self.modality[modality]

    def score_pairs(self, text: Tensor, text_mask: Tensor, image: Tensor, text_index: Tensor,
                    image_index: Tensor) -> Tensor:
        """Scores float32 [n] of the pairs (image[image_index[n]], text[text_index[n]]) of embedded token sets.

        The token sets are expanded per pair (gathered), so the cost is one transformer forward per pair;
        padded text positions are masked out of the attention keys.
        """
        count = text_index.shape[0]
        cls = self.cls.to(text.dtype).expand(count, 1, -1)
        sequence = torch.cat([cls, text[text_index], image[image_index]], dim=1)
        real = torch.ones(count, 1, dtype=torch.bool, device=text.device)
        keep = torch.cat([real, text_mask[text_index], real.expand(count, image.shape[1])], dim=1)
        x = self.encoder(sequence, src_key_padding_mask=~keep)
        return self.head(x[:, 0]).squeeze(-1).float()
