"""Explanation figures: an image, the Grad-ECLIP heat map of a caption over it and the caption's per-token text
attribution. The explain command writes them as PNG files; the attribution monitor logs them to TensorBoard.

One panel per (image, caption) pair:

    "caption as text"    S(I,T) = 0.2731
    [ the image in its own colours ] [ the heat map over the image in grey ] [colour bar]
    [ per-token attribution bars, coloured by the token's word kind when it is known ]

The heat map uses a perceptually uniform colour map (equal steps of relevance look like equal steps of colour,
which jet's bands do not) drawn half-transparent over a grey copy of the image: the heat colours then never mix
with the colours the captions speak of, which the image beside it shows as they are. Panels are laid out on a grid:
the explain command and the monitor put one text per row (the monitor: a caption, and below it its hard negative).
A maximum width keeps a figure readable where it is shown scaled to a fixed width (TensorBoard's image cards): the
token bars then narrow instead of the panel widening, and their labels stand upright.
"""
from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

HEAT_COLORMAP = "inferno"
HEAT_ALPHA = 0.6
# Word kinds of the scene-graph parser (the monitor's probe knows them; a free text of the explain command does not).
KIND_COLOURS = {"object": "#3b75af", "attribute": "#e1812c", "relation": "#3a923a", "other": "#9a9a9a"}
UNKNOWN_KIND_COLOUR = "#4d5b6b"  # tokens of a text whose words were not parsed
CAPTION_WRAP = 64  # characters per line of the caption shown above a panel
SMALL_FONT = 8  # points: tick labels and legends (the titles are 9); at the monitor's 80 dpi about 9 pixels tall


@dataclass(frozen=True)
class PanelLayout:
    """A panel's geometry in inches (a fixed layout: matplotlib's constrained layout would triple the drawing time,
    which the monitor pays during training). The bar chart widens with the number of tokens."""

    min_width: float = 5.6
    height: float = 4.8
    inches_per_token: float = 0.3
    tokens_at_min_width: int = 14
    title: float = 0.7  # the caption and S(I,T) above everything
    image_title: float = 0.25
    image: float = 1.5  # side of the two image axes
    image_left: float = 0.45
    image_gap: float = 0.45
    colour_bar: float = 0.1
    bar_title: float = 0.4
    bar_left: float = 0.6
    bar_bottom: float = 0.75  # room for the token labels
    legend: float = 1.1  # right of the bars, for the word-kind legend

    def width(self, tokens: int) -> float:
        return self.min_width + max(0, tokens - self.tokens_at_min_width) * self.inches_per_token


LAYOUT = PanelLayout()


@dataclass
class TextPanel:
    """What one panel shows: a text, its similarity to the image, its token attribution and image heat map."""

    text: str
    similarity: float  # S(I, T), cosine of the L2-normalised embeddings
    tokens: Sequence[str]  # the caption's content tokens (SOT and EOS excluded)
    attributions: Sequence[float]  # one per token
    heat_map: np.ndarray  # [H, W] in 0..1, the image's size
    kinds: Optional[Sequence[str]] = None  # per token, a key of KIND_COLOURS; None: not parsed
    label: str = ""  # shown before the text, e.g. "hard negative"


def greyscale(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] RGB in 0..1 -> [H, W] luma (ITU-R BT.601 weights)."""
    return image @ np.array([0.299, 0.587, 0.114])


def panel_title(panel: TextPanel) -> str:
    label = f"{panel.label}: " if panel.label else ""
    text = textwrap.fill(f'{label}"{panel.text}"', CAPTION_WRAP)
    return f"{text}\nS(I,T) = {panel.similarity:.4f}"


class PanelPlace:
    """Where a panel lies on the figure: rectangles given in inches from the panel's lower left corner become
    figure fractions."""

    def __init__(self, figure: Figure, left: float, bottom: float, width: float):
        self.figure, self.left, self.bottom, self.width = figure, left, bottom, width

    def rect(self, x: float, y: float, width: float, height: float) -> List[float]:
        figure_width, figure_height = self.figure.get_size_inches()
        return [(self.left + x) / figure_width, (self.bottom + y) / figure_height, width / figure_width,
                height / figure_height]

    def axes(self, x: float, y: float, width: float, height: float) -> Axes:
        return self.figure.add_axes(self.rect(x, y, width, height))

    def text(self, x: float, y: float, text: str, **options) -> None:
        left, bottom, _, _ = self.rect(x, y, 0, 0)
        self.figure.text(left, bottom, text, **options)


def draw_images(place: PanelPlace, image: np.ndarray, panel: TextPanel, heads: str) -> None:
    """The image as it is, and its heat map over a grey copy with a colour bar."""
    top = LAYOUT.height - LAYOUT.title - LAYOUT.image_title
    bottom = top - LAYOUT.image
    plain = place.axes(LAYOUT.image_left, bottom, LAYOUT.image, LAYOUT.image)
    plain.imshow(image)
    plain.set_title("image", fontsize=9)
    heat_left = LAYOUT.image_left + LAYOUT.image + LAYOUT.image_gap
    heat = place.axes(heat_left, bottom, LAYOUT.image, LAYOUT.image)
    heat.imshow(greyscale(image), cmap="gray", vmin=0, vmax=1)
    heat.imshow(panel.heat_map, cmap=HEAT_COLORMAP, alpha=HEAT_ALPHA, vmin=0, vmax=1)
    # Grad-ECLIP keeps the positive relevance only (a ReLU): a map with none is blank, and says so.
    blank = "" if panel.heat_map.max() > 0 else "\n(no positive relevance)"
    heat.set_title(f"Grad-ECLIP image map, {heads}-head{blank}", fontsize=9)
    for axes in (plain, heat):
        axes.axis("off")
    # The bar of an opaque mappable: the heat map's own transparency would fade the bar's colours.
    bar_axes = place.axes(heat_left + LAYOUT.image + 0.1, bottom, LAYOUT.colour_bar, LAYOUT.image)
    bar = place.figure.colorbar(ScalarMappable(Normalize(0, 1), HEAT_COLORMAP), cax=bar_axes)
    bar.set_label("relevance (min-max)", fontsize=8)
    bar.ax.tick_params(labelsize=SMALL_FONT)


def draw_bars(place: PanelPlace, panel: TextPanel, method: str) -> None:
    """Per-token attribution bars; coloured by word kind (with a legend) when the kinds are known."""
    top = LAYOUT.height - LAYOUT.title - LAYOUT.image_title - LAYOUT.image - LAYOUT.bar_title
    axes = place.axes(LAYOUT.bar_left, LAYOUT.bar_bottom, place.width - LAYOUT.bar_left - LAYOUT.legend,
                      top - LAYOUT.bar_bottom)
    positions = np.arange(len(panel.tokens))
    kinds = panel.kinds or [None] * len(panel.tokens)
    axes.bar(positions, panel.attributions, color=[KIND_COLOURS.get(kind, UNKNOWN_KIND_COLOUR) for kind in kinds])
    many = len(panel.tokens) > 8
    # Bars narrower than a panel of its own width would give them (a capped width): upright labels, side by side.
    crowded = (place.width - LAYOUT.bar_left - LAYOUT.legend) / max(len(panel.tokens), 1) < LAYOUT.inches_per_token
    rotation = 90 if crowded else 45 if many else 0
    axes.set_xticks(positions, panel.tokens, rotation=rotation, ha="right" if rotation == 45 else "center",
                    va="top", rotation_mode="anchor" if rotation == 45 else "default", fontsize=SMALL_FONT)
    axes.set_xlim(-0.6, max(len(panel.tokens), 1) - 0.4)
    axes.set_ylabel("attribution", fontsize=8)
    axes.tick_params(axis="y", labelsize=SMALL_FONT)
    axes.set_title(f"text attribution: {method}", fontsize=9)
    if panel.kinds:
        present = [kind for kind in KIND_COLOURS if kind in set(panel.kinds)]
        axes.legend(handles=[Patch(color=KIND_COLOURS[kind], label=kind) for kind in present], fontsize=SMALL_FONT,
                    loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def draw_panel(place: PanelPlace, image: np.ndarray, panel: TextPanel, method: str, heads: str) -> None:
    place.text(place.width / 2, LAYOUT.height - 0.08, panel_title(panel), ha="center", va="top", fontsize=9)
    draw_images(place, image, panel, heads)
    draw_bars(place, panel, method)


def explanation_figure(image: np.ndarray, panels: Sequence[Sequence[TextPanel]], method: str, heads: str,
                       dpi: int = 100, max_width: Optional[float] = None) -> Figure:
    """A grid of panels (rows of columns) explaining texts about one image (Agg figure, no pyplot state).

    Args:
        image: the pixels the model saw, [H, W, 3] in 0..1.
        panels: rows of panels; a row may have fewer panels than the widest (its other places stay empty).
        method: the text attribution's name, for the bar chart's title.
        heads: the Grad-ECLIP image map's heads ("single" or "multi"), for its title.
        max_width: at most this many inches per panel (never below the narrowest panel): long captions narrow
            their bars instead of widening the figure. None: as wide as the longest caption needs.
    """
    columns = max(len(row) for row in panels)
    width = LAYOUT.width(max(len(panel.tokens) for row in panels for panel in row))
    if max_width is not None:
        width = max(LAYOUT.min_width, min(width, max_width))
    figure = Figure(figsize=(width * columns, LAYOUT.height * len(panels)), dpi=dpi)
    FigureCanvasAgg(figure)
    for row_index, row in enumerate(panels):
        bottom = (len(panels) - 1 - row_index) * LAYOUT.height
        for column, panel in enumerate(row):
            draw_panel(PanelPlace(figure, column * width, bottom, width), image, panel, method, heads)
    return figure


def png_bytes(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=figure.dpi)
    return buffer.getvalue()


def figure_pixels(figure: Figure) -> np.ndarray:
    """The rendered figure as [H, W, 3] uint8 RGB (what TensorBoard's image tab shows)."""
    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
