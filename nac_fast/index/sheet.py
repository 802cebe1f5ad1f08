"""The contact sheet of a search: one row per query, the query first (blue frame), then its
neighbours nearest first with the Hamming distance and the label under each; a neighbour whose
label differs from the query's has a red frame and a red label.  Drawn with PIL only.

    draw_contact_sheet(rows, "neighbours.png", title="...")
    sheet = contact_sheet(rows, title="...")       # the PIL image, to write it yourself
    rows = [{"query": path, "label": str or None,
             "results": [{"path": str, "distance": int, "label": str or None}, ...]}, ...]
"""
from __future__ import annotations

from .._files import atomic_write

__all__ = ["draw_contact_sheet", "contact_sheet", "sheet_size", "MAX_PIXELS"]

THUMB = 96          # pixels of the longer side of a thumbnail
PAD = 6
TEXT_H = 30
CELL_W, CELL_H = THUMB + 2 * PAD, THUMB + 2 * PAD + TEXT_H   # a thumbnail and its two lines
HEAD_H = 44         # the title and the legend
MAX_PIXELS = 100_000_000  # 300 MB of RGB in memory: past it a sheet is refused, not drawn
BLUE, RED, GREEN, GREY = (40, 90, 220), (215, 30, 30), (30, 140, 60), (110, 110, 110)


def _font(size: int):
    from PIL import ImageFont
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size
        return ImageFont.load_default()


def _thumb(path):
    """The image as an RGB thumbnail (nearest-neighbour when enlarged a lot, so 28-pixel images
    stay sharp), or None when it cannot be read."""
    from PIL import Image
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            scale = THUMB / max(im.width, im.height)
            size = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
            return im.resize(size, Image.NEAREST if scale >= 2 else Image.LANCZOS)
    except Exception:
        return None


def _short(s, n=15):
    s = "-" if s is None else str(s)
    return s if len(s) <= n else s[:n - 1] + "~"


def draw_contact_sheet(rows, out_path: str, *, title: str | None = None) -> None:
    """Draw ``rows`` (module docstring) to ``out_path`` (PNG, written atomically)."""
    sheet = contact_sheet(rows, title=title)
    atomic_write(out_path, lambda f: sheet.save(f, format="PNG"))


def sheet_size(n_queries: int, k: int) -> tuple:
    """(width, height) in pixels of the sheet of ``n_queries`` rows of a query and ``k``
    neighbours, not counting the heading's own width (a short row is widened to show it)."""
    return (1 + k) * CELL_W + 2 * PAD, HEAD_H + n_queries * CELL_H + PAD


def check_sheet_size(n_queries: int, k: int) -> None:
    """ValueError when the sheet of ``n_queries`` x ``k`` would exceed MAX_PIXELS: it is held in
    memory whole (1000 queries x top 100 would be 4.5 GB)."""
    w, h = sheet_size(n_queries, k)
    if w * h > MAX_PIXELS:
        raise ValueError(f"a contact sheet of {n_queries} queries x {k} neighbours would be "
                         f"{w} x {h} pixels ({3 * w * h / 1e9:.1f} GB in memory), more than "
                         f"{MAX_PIXELS:,} pixels: draw it for fewer queries or a smaller k")


def contact_sheet(rows, *, title: str | None = None):
    """The contact sheet of ``rows`` (module docstring) as an RGB PIL image.  ValueError when
    there are no rows, or when the sheet would exceed MAX_PIXELS (`check_sheet_size`)."""
    from PIL import Image, ImageDraw
    if not rows:
        raise ValueError("no rows to draw")
    ncol = 1 + max(len(r["results"]) for r in rows)
    check_sheet_size(len(rows), ncol - 1)
    cell_w, cell_h = CELL_W, CELL_H
    f_small, f_title = _font(11), _font(13)
    heading = ([(title, "black", f_title)] if title else []) + [
        ("query (blue) | neighbours by Hamming distance, nearest first; red: label differs from "
         "the query's", GREY, f_small)]
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    text_w = max(measure.textlength(text, font=font) for text, _, font in heading)
    head_h = 4 + 20 * len(heading)
    W = max(ncol * cell_w, int(text_w) + 1) + 2 * PAD  # a short row still shows the whole heading
    H = head_h + len(rows) * cell_h + PAD
    sheet = Image.new("RGB", (W, H), "white")
    draw = ImageDraw.Draw(sheet)
    for k, (text, fill, font) in enumerate(heading):
        draw.text((PAD, 4 + 20 * k), text, fill=fill, font=font)
    for i, row in enumerate(rows):
        top = head_h + i * cell_h
        q_label = row.get("label")
        cells = [(row["query"], "query", q_label, BLUE)]
        for r in row["results"]:
            mismatch = q_label is not None and r.get("label") != q_label
            colour = RED if mismatch else (GREEN if q_label is not None else GREY)
            cells.append((r["path"], f"d={r['distance']}", r.get("label"), colour))
        for j, (path, line1, label, colour) in enumerate(cells):
            left = PAD + j * cell_w
            im = _thumb(path) if path else None
            box = (left + 2, top + 2, left + cell_w - 3, top + THUMB + 2 * PAD - 3)
            if im is None:
                draw.rectangle(box, fill=(235, 235, 235))
                draw.text((left + PAD, top + THUMB // 2), "unreadable", fill=RED, font=f_small)
            else:
                sheet.paste(im, (left + PAD + (THUMB - im.width) // 2,
                                 top + PAD + (THUMB - im.height) // 2))
            if j == 0 or colour == RED:
                draw.rectangle(box, outline=colour, width=3)
            draw.text((left + PAD, top + THUMB + 2 * PAD), line1,
                      fill=BLUE if j == 0 else "black", font=f_small)
            draw.text((left + PAD, top + THUMB + 2 * PAD + 13), _short(label), fill=colour,
                      font=f_small)
    return sheet
