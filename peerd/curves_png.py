"""``peerd swarm --plot FILE.png``: the peers' training curves as a PNG, with no plotting library.

matplotlib would be a heavy dependency (and a slow import) for one picture at the end of a run, so
this draws two stacked panels itself, training loss above and the held-out metric below (accuracy,
or bits per byte for text tasks), one coloured line per peer over the run's seconds, each panel with
its range written in a small bitmap font, and encodes the pixels as a PNG with ``zlib`` alone.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Curve", "write_curves_png", "PEER_COLOURS"]

Curve = Sequence[tuple[float, float]]  # (seconds since the start, value)
RGB = tuple[int, int, int]

WIDTH, PANEL_HEIGHT = 800, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 22, 18  # margins of a panel: labels go there
SCALE = 2  # font pixels per glyph pixel
PEER_COLOURS: tuple[RGB, ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
)  # fmt: skip
BACKGROUND, GRID, AXIS, TEXT = (255, 255, 255), (225, 225, 225), (0, 0, 0), (40, 40, 40)

# 3x5 glyphs, one string of 0/1 per row: digits and the letters the labels use.
_GLYPHS = {
    "0": "111 101 101 101 111", "1": "010 110 010 010 111", "2": "111 001 111 100 111",
    "3": "111 001 111 001 111", "4": "101 101 111 001 001", "5": "111 100 111 001 111",
    "6": "111 100 111 101 111", "7": "111 001 001 001 001", "8": "111 101 111 101 111",
    "9": "111 101 111 001 111", ".": "000 000 000 000 010", "-": "000 000 111 000 000",
    "/": "001 001 010 100 100", " ": "000 000 000 000 000", "a": "000 111 001 111 111",
    "b": "100 100 111 101 111", "c": "000 111 100 100 111", "d": "001 001 111 101 111",
    "e": "111 101 111 100 111", "h": "100 100 111 101 101", "i": "010 000 010 010 010",
    "l": "110 010 010 010 111", "o": "000 111 101 101 111", "p": "111 101 111 100 100",
    "r": "000 111 100 100 100", "s": "011 100 010 001 110", "t": "010 111 010 010 011",
    "u": "000 101 101 101 111", "y": "101 101 111 001 111", "n": "000 110 101 101 101",
}  # fmt: skip


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(BACKGROUND) * (width * height))

    def dot(self, x: int, y: int, colour: RGB) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            at = 3 * (y * self.width + x)
            self.pixels[at : at + 3] = bytes(colour)

    def line(self, x0: int, y0: int, x1: int, y1: int, colour: RGB, thick: int = 1) -> None:
        """Bresenham's line, ``thick`` pixels wide."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        while True:
            for offset in range(thick):
                self.dot(x0, y0 + offset, colour)
                self.dot(x0 + offset, y0, colour)
            if x0 == x1 and y0 == y1:
                return
            doubled = 2 * error
            if doubled >= dy:
                error += dy
                x0 += sx
            if doubled <= dx:
                error += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, colour: RGB = TEXT) -> None:
        for char in text.lower():
            rows = _GLYPHS.get(char, _GLYPHS[" "]).split()
            for row, bits in enumerate(rows):
                for column, bit in enumerate(bits):
                    if bit == "1":
                        for dy in range(SCALE):
                            for dx in range(SCALE):
                                self.dot(x + column * SCALE + dx, y + row * SCALE + dy, colour)
            x += 4 * SCALE

    def png(self) -> bytes:
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (
            b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
        )


def _label(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def _panel(canvas: _Canvas, top: int, title: str, curves: Mapping[int, Curve], seconds: float) -> None:
    x0, x1 = LEFT, canvas.width - RIGHT
    y0, y1 = top + TOP, top + PANEL_HEIGHT - BOTTOM
    values = [v for curve in curves.values() for _, v in curve if math.isfinite(v)]
    low, high = (min(values), max(values)) if values else (0.0, 1.0)
    if high - low < 1e-9:
        low, high = low - 0.5, high + 0.5
    for step in range(5):  # grid lines at quarters of the range
        y = y1 - round(step * (y1 - y0) / 4)
        canvas.line(x0, y, x1, y, GRID)
    canvas.line(x0, y0, x0, y1, AXIS)
    canvas.line(x0, y1, x1, y1, AXIS)
    canvas.text(x0, top + 4, title)
    x = x1
    for peer in sorted(curves, reverse=True):  # the legend, right-aligned: each peer in its colour
        name = f"peer {peer}"
        x -= (len(name) + 1) * 4 * SCALE
        canvas.text(x, top + 4, name, PEER_COLOURS[peer % len(PEER_COLOURS)])
    canvas.text(4, y0, _label(high))
    canvas.text(4, y1 - 5 * SCALE, _label(low))
    end = f"{seconds:.0f} s"
    canvas.text(x1 - len(end) * 4 * SCALE, y1 + 4, end)
    span = max(seconds, 1e-9)
    for peer, curve in sorted(curves.items()):
        colour = PEER_COLOURS[peer % len(PEER_COLOURS)]
        points = [
            (x0 + round((t / span) * (x1 - x0)), y1 - round((v - low) / (high - low) * (y1 - y0)))
            for t, v in curve
            if math.isfinite(v)
        ]
        for (ax, ay), (bx, by) in zip(points, points[1:], strict=False):
            canvas.line(ax, ay, bx, by, colour, thick=2)
        if len(points) == 1:  # one point: a dash, so that it shows
            x, y = points[0]
            canvas.line(x - 2, y, x + 2, y, colour, thick=2)


def write_curves_png(
    path: str | Path, loss: Mapping[int, Curve], held_out: Mapping[int, Curve], held_out_title: str, seconds: float
) -> None:
    """Write the two panels to ``path``: ``loss`` and ``held_out`` map a peer's index to its
    ``(seconds, value)`` points; a peer's line has its colour (``PEER_COLOURS``) in both."""
    canvas = _Canvas(WIDTH, 2 * PANEL_HEIGHT)
    _panel(canvas, 0, "loss", loss, seconds)
    _panel(canvas, PANEL_HEIGHT, held_out_title, held_out, seconds)
    Path(path).write_bytes(canvas.png())
