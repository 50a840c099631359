"""``DIR/progress.png``: loss and accuracy per round per org.

matplotlib is not a dependency of fedweave, so the plot is drawn here on an RGB raster
and written as a PNG (ISO/IEC 15948: signature, ``IHDR``, one zlib-compressed ``IDAT``
of filter-0 scanlines, ``IEND``; each chunk with its CRC-32). Two panels, loss on the
left and accuracy on the right, one coloured line per org with a dot per round, the
value range printed in a 3x5 pixel font, and a legend of org colours.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["PALETTE", "Canvas", "plot_progress", "png_bytes"]

Color = tuple[int, int, int]
PALETTE: tuple[Color, ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)
_FONT: dict[str, str] = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001001001", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "e": "000111111100111", " ": "000000000000000", "A": "010101111101101",
    "C": "111100100100111", "L": "100100100100111", "O": "111101101101111",
    "R": "110101110101101", "S": "111100111001111", "U": "101101101101111",
    "Y": "101101010010010", "N": "110101101101101", "D": "110101101101110",
    "G": "111100101101111", "o": "000111101101111", "r": "000110101100100",
    "g": "011101011001110",
}  # fmt: skip


def png_bytes(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG of ``width`` x ``height`` pixels from row-major ``rgb`` bytes."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"expected {width * height * 3} bytes of RGB, got {len(rgb)}")

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


class Canvas:
    """A white RGB raster with the few drawing operations the plot needs."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(min(y0, y1), max(y0, y1) + 1):
            for x in range(min(x0, x1), max(x0, x1) + 1):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """Bresenham's line, ``width`` pixels thick."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        r = width // 2
        while True:
            self.rect(x0 - r, y0 - r, x0 + r, y0 + r, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, color: Color = (0, 0, 0), scale: int = 2) -> None:
        for ch in s:
            glyph = _FONT.get(ch, _FONT.get(ch.upper(), _FONT[" "]))
            for i, bit in enumerate(glyph):
                if bit == "1":
                    gx, gy = x + (i % 3) * scale, y + (i // 3) * scale
                    self.rect(gx, gy, gx + scale - 1, gy + scale - 1, color)
            x += 4 * scale

    def png(self) -> bytes:
        return png_bytes(self.width, self.height, self.pixels)


def _label(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.2e}"


def _panel(
    c: Canvas,
    left: int,
    top: int,
    w: int,
    h: int,
    title: str,
    series: Mapping[str, Sequence[tuple[int, float]]],
    colors: Mapping[str, Color],
    rounds: int,
) -> None:
    grey, black = (200, 200, 200), (0, 0, 0)
    c.text(left, top - 22, title)
    c.line(left, top, left, top + h, black)
    c.line(left, top + h, left + w, top + h, black)
    values = [v for pts in series.values() for _, v in pts if math.isfinite(v)]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    for k in range(1, 5):
        y = top + h - k * h // 4
        c.line(left + 1, y, left + w, y, grey)
    c.text(left + 4, top + 4, _label(hi), scale=1)
    c.text(left + 4, top + h - 10, _label(lo), scale=1)
    span = max(rounds, 1)
    for r in range(1, span + 1):
        x = left + r * w // span
        c.line(x, top + h, x, top + h + 4, black)
    c.text(left + w - 40, top + h + 8, f"Round {span}", scale=1)

    def at(r: int, v: float) -> tuple[int, int]:
        return left + r * w // span, top + h - round((v - lo) / (hi - lo) * (h - 8)) - 4

    for org, pts in series.items():
        color = colors[org]
        clean = [(r, v) for r, v in sorted(pts) if math.isfinite(v)]
        for (r0, v0), (r1, v1) in itertools.pairwise(clean):
            c.line(*at(r0, v0), *at(r1, v1), color, width=2)
        for r, v in clean:
            x, y = at(r, v)
            c.rect(x - 2, y - 2, x + 2, y + 2, color)


def plot_progress(
    history: Mapping[str, Mapping[int, Mapping[str, float]]], rounds: int, path: Path
) -> Path:
    """Draw loss (``eval_loss``, else ``train_loss``) and ``eval_accuracy`` per round per
    org from ``history`` (org -> round -> metric -> value) into the PNG ``path``."""
    orgs = sorted(history, key=lambda o: (len(o), o))
    colors = {org: PALETTE[i % len(PALETTE)] for i, org in enumerate(orgs)}
    loss = {
        o: [(r, m.get("eval_loss", m.get("train_loss", math.nan))) for r, m in history[o].items()]
        for o in orgs
    }
    acc = {
        o: [(r, m.get("eval_accuracy", m.get("eval_acc", math.nan))) for r, m in history[o].items()]
        for o in orgs
    }
    c = Canvas(900, 380)
    _panel(c, 50, 40, 360, 260, "LOSS", loss, colors, rounds)
    _panel(c, 500, 40, 360, 260, "ACCURACY", acc, colors, rounds)
    x = 50
    for i, org in enumerate(orgs):
        color = colors[org]
        c.rect(x, 340, x + 12, 352, color)
        digits = "".join(ch for ch in org if ch.isdigit()) or str(i + 1)
        c.text(x + 18, 341, "Org " + digits, scale=2)
        x += 110
    path = Path(path)
    path.write_bytes(c.png())
    return path
