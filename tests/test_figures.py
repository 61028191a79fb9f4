"""Explanation figures (the explain command's PNG, the monitor's overlays): what each panel draws, where."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colors import to_rgb

from evaluation.figures import (HEAT_COLORMAP, KIND_COLOURS, LAYOUT, UNKNOWN_KIND_COLOUR, TextPanel,
                                explanation_figure, figure_pixels, greyscale)

TOKENS = ["a", "red", "square", "left", "of", "a", "blue", "circle"]
KINDS = ["other", "attribute", "object", "relation", "relation", "other", "attribute", "object"]


def panel(label: str, kinds=None, tokens=TOKENS) -> TextPanel:
    rng = np.random.default_rng(0)
    return TextPanel(" ".join(tokens), 0.25, tokens, list(rng.random(len(tokens))), rng.random((8, 12)), kinds, label)


@pytest.fixture
def image() -> np.ndarray:
    return np.random.default_rng(1).random((8, 12, 3))


def images_of(figure) -> list:
    return [(axes, picture) for axes in figure.axes for picture in axes.get_images()]


def test_the_image_in_its_own_colours_beside_a_uniform_heat_map_over_grey_with_a_colour_bar(image):
    figure = explanation_figure(image, [[panel("caption", KINDS)]], "attention", "single")
    pictures = [picture for _, picture in images_of(figure)]
    assert len(pictures) == 3
    plain, grey, heat = pictures
    assert np.array_equal(plain.get_array(), image)  # untouched: no colour map, no blending
    assert np.allclose(grey.get_array(), greyscale(image)) and grey.get_cmap().name == "gray"
    assert heat.get_cmap().name == HEAT_COLORMAP == "inferno" and 0 < heat.get_alpha() < 1  # perceptually uniform
    assert heat.get_clim() == (0, 1)
    assert [axes.get_title() for axes in figure.axes[:2]] == ["image", "Grad-ECLIP image map, single-head"]
    colour_bars = [axes for axes in figure.axes if axes.get_ylabel() == "relevance (min-max)"]
    assert len(colour_bars) == 1
    texts = [text.get_text() for text in figure.texts]
    assert texts == ['caption: "a red square left of a blue circle"\nS(I,T) = 0.2500']


def test_token_bars_are_coloured_by_word_kind_with_a_legend_and_plain_when_unparsed(image):
    figure = explanation_figure(image, [[panel("caption", KINDS), panel("hard negative")]], "gradient", "multi")
    bar_charts = [axes for axes in figure.axes if axes.get_title() == "text attribution: gradient"]
    assert len(bar_charts) == 2
    parsed, unparsed = bar_charts
    def colours(bars) -> list:
        return [tuple(np.round(bar.get_facecolor()[:3], 3)) for bar in bars]

    assert colours(parsed.patches) == [tuple(np.round(to_rgb(KIND_COLOURS[kind]), 3)) for kind in KINDS]
    assert set(colours(unparsed.patches)) == {tuple(np.round(to_rgb(UNKNOWN_KIND_COLOUR), 3))}
    assert [t.get_text() for t in parsed.get_legend().get_texts()] == ["object", "attribute", "relation", "other"]
    assert unparsed.get_legend() is None
    assert [label.get_text() for label in parsed.get_xticklabels()] == TOKENS


def test_panels_side_by_side_and_rows_set_the_size_and_long_captions_widen_them(image):
    dpi = 50
    side_by_side = figure_pixels(explanation_figure(image, [[panel("a"), panel("b")]], "attention", "single", dpi))
    assert side_by_side.shape == (round(LAYOUT.height * dpi), round(2 * LAYOUT.min_width * dpi), 3)
    rows = figure_pixels(explanation_figure(image, [[panel("a")], [panel("b")]], "attention", "single", dpi))
    assert rows.shape == (round(2 * LAYOUT.height * dpi), round(LAYOUT.min_width * dpi), 3)
    long_tokens = TOKENS * 4  # 32 tokens: wider than the 14 of the narrowest panel
    wide = explanation_figure(image, [[panel("a", tokens=long_tokens)]], "attention", "single", dpi)
    assert wide.get_size_inches()[0] == pytest.approx(LAYOUT.min_width + (32 - 14) * LAYOUT.inches_per_token)


def test_a_map_without_positive_relevance_says_so(image):
    blank = panel("caption")
    blank.heat_map = np.zeros((8, 12))
    figure = explanation_figure(image, [[blank]], "attention", "multi")
    assert figure.axes[1].get_title() == "Grad-ECLIP image map, multi-head\n(no positive relevance)"


def test_a_capped_width_narrows_the_bars_of_a_long_caption_and_keeps_every_text_legible(image):
    """The monitor's figures must stay within TensorBoard's image card (shown at their own size, not shrunk): a long
    caption narrows its bars, with upright labels, instead of widening the figure; no text under 8 pixels."""
    from matplotlib.text import Text

    from lightning_modules.monitor import CARD_WIDTH_PX, FIGURE_DPI

    long_tokens = TOKENS * 4  # 32 tokens: unbounded, the panel would be 11 inches wide
    rows = [[panel("caption", KINDS * 4, long_tokens)], [panel("hard negative", tokens=long_tokens)]]
    figure = explanation_figure(image, rows, "attention", "single", FIGURE_DPI, max_width=CARD_WIDTH_PX / FIGURE_DPI)
    assert figure_pixels(figure).shape[1] == CARD_WIDTH_PX
    bar_charts = [axes for axes in figure.axes if axes.get_title() == "text attribution: attention"]
    assert len(bar_charts) == 2
    assert {label.get_rotation() for axes in bar_charts for label in axes.get_xticklabels()} == {90.0}
    titles = sorted(figure.texts, key=lambda text: -text.get_position()[1])
    assert [text.get_text().split(":")[0] for text in titles] == ["caption", "hard negative"]  # one above the other
    sizes = [text.get_fontsize() * FIGURE_DPI / 72 for text in figure.findobj(Text) if text.get_text()]
    assert min(sizes) >= 8
    short = explanation_figure(image, [[panel("a")]], "attention", "single", FIGURE_DPI, max_width=20.0)
    assert short.get_size_inches()[0] == pytest.approx(LAYOUT.min_width)  # a cap never widens a panel
