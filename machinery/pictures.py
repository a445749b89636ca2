"""Pictures as (H, W, 3) uint8 arrays, drawn with PIL (about 10 ms each, so they can be drawn at every
evaluation): image grids with captions, the confusion matrix. task.py draws its pictures with these; logs.py
sends them to TensorBoard and writes the saved ones as PNG files.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from machinery.files import write_bytes_atomic


def write_png_atomic(path: str | Path, picture) -> None:
    """A picture (H, W, 3 uint8 array) written whole or not at all, one line on failure."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    write_bytes_atomic(path, buffer.getvalue())


def image_grid(pixels: torch.Tensor, captions: list[str], columns: int = 8):
    """Images (N, C, H, W, values in [0, 1]) side by side, each with its caption underneath. Small images
    are enlarged (nearest neighbour, so pixels stay sharp) and large ones shrunk, to tiles of 64-160 px;
    one channel is shown as gray, other channel counts by their first."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    pixels = pixels.float()
    side = max(pixels.shape[-2:])
    if side < 64:
        pixels = torch.nn.functional.interpolate(pixels, scale_factor=-(-64 // side), mode="nearest")
    elif side > 160:
        size = [round(d * 160 / side) for d in pixels.shape[-2:]]
        pixels = torch.nn.functional.interpolate(pixels, size=size, mode="bilinear", antialias=True)
    pixels = pixels[:, :3] if pixels.shape[1] == 3 else pixels[:, :1].expand(-1, 3, -1, -1)
    tiles = (pixels.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    n, h, w = tiles.shape[:3]
    font, gap, text = ImageFont.load_default(size=11), 4, 14
    columns = min(columns, n)
    rows = -(-n // columns)
    canvas = Image.new("RGB", (columns * (w + gap) + gap, rows * (h + text + gap) + gap), "white")
    draw = ImageDraw.Draw(canvas)
    for i in range(n):
        x, y = gap + (i % columns) * (w + gap), gap + (i // columns) * (h + text + gap)
        canvas.paste(Image.fromarray(tiles[i]), (x, y))
        draw.text((x, y + h + 1), _fitted(captions[i], w, font), fill="black", font=font)
    return np.asarray(canvas)


def confusion_picture(confusion: list[list[int]], names: list[str]):
    """Rows: true class; columns: predicted class; each row normalized to sum to 100%."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    n = len(confusion)
    cell = max(4, min(32, 640 // n))
    font = ImageFont.load_default(size=10 if cell >= 12 else max(cell - 1, 6))
    labels = [_fitted(name, 110, font) for name in names] if cell >= 8 else [""] * n
    margin = 8 + max([int(font.getlength(label)) for label in labels] + [0])
    head = 22
    canvas = Image.new("RGB", (margin + n * cell + 8, head + margin + n * cell + 8), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 4), "rows: true class, columns: predicted, % of each row", fill="black",
              font=ImageFont.load_default(size=11))
    top = Image.new("RGB", (margin, n * cell), "white")  # column labels, drawn across, then turned
    top_draw = ImageDraw.Draw(top)
    for i, (row, label) in enumerate(zip(confusion, labels, strict=True)):
        y = head + margin + i * cell
        draw.text((margin - 4, y + cell / 2), label, fill="black", font=font, anchor="rm")
        top_draw.text((4, i * cell + cell / 2), label, fill="black", font=font, anchor="lm")
        total = sum(row)
        for j, count in enumerate(row):
            share = count / total if total else 0.0
            color = tuple(round(255 - share * (255 - c)) for c in (8, 48, 107))  # white to dark blue
            x = margin + j * cell
            draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=color,
                           outline=(225, 225, 225) if cell >= 12 else None)
            if cell >= 24 and count:
                draw.text((x + cell / 2, y + cell / 2), str(round(100 * share)), font=font, anchor="mm",
                          fill="white" if share > 0.5 else "black")
    canvas.paste(top.rotate(90, expand=True), (margin, head))
    return np.asarray(canvas)


def _fitted(text: str, width: int, font) -> str:
    """`text`, shortened with '..' until it fits `width` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "..") > width:
        text = text[:-1]
    return text + ".."
