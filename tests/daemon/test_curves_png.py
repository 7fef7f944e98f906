"""``peerd swarm --plot``: the PNG is valid and shows each peer's curve where its values say."""

from __future__ import annotations

import math

from peerd.curves_png import BACKGROUND, PEER_COLOURS, WIDTH, write_curves_png
from tests.support.png_reader import read_png


def test_each_peer_is_drawn_in_its_colour_in_both_panels(tmp_path):
    loss = {i: [(t, 2.3 * math.exp(-t / 30) + 0.1 * i) for t in range(0, 91)] for i in range(3)}
    accuracy = {i: [(t, 1 - math.exp(-t / 20) - 0.05 * i) for t in range(5, 91, 5)] for i in range(3)}
    accuracy[3] = [(45.0, 0.5)]  # a peer with a single evaluation still shows
    accuracy[0].append((50.0, math.nan))  # a peer's NaN is skipped, not drawn
    write_curves_png(tmp_path / "c.png", loss, accuracy, "held-out accuracy", seconds=90)
    width, height, pixels = read_png(tmp_path / "c.png")
    assert width == WIDTH and height > 0
    top, bottom = range(0, height // 2), range(height // 2, height)

    def columns_with(colour, rows) -> set[int]:
        return {x for y in rows for x in range(60, width - 16) if pixels[y][x] == colour}

    for peer in range(3):
        # a line across the whole time axis, not a few dots
        assert len(columns_with(PEER_COLOURS[peer], top)) > 0.8 * (width - 60 - 16), peer
        assert len(columns_with(PEER_COLOURS[peer], bottom)) > 0.6 * (width - 60 - 16), peer
    assert columns_with(PEER_COLOURS[3], bottom)
    # falling loss: peer 0's line is higher (smaller y) at the start than at the end
    first = min(y for y in top for x in range(60, 80) if pixels[y][x] == PEER_COLOURS[0])
    last = min(y for y in top for x in range(width - 40, width - 17) if pixels[y][x] == PEER_COLOURS[0])
    assert first < last
    assert pixels[height // 4][width // 2 + 1] in (BACKGROUND, (225, 225, 225), *PEER_COLOURS)


def test_no_points_still_makes_a_picture(tmp_path):
    write_curves_png(tmp_path / "empty.png", {}, {}, "bits/byte", seconds=0)
    width, height, _ = read_png(tmp_path / "empty.png")
    assert (width, height) == (WIDTH, height)
