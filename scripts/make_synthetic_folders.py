"""Write a labelled ImageFolder (OUT/train/<class>/*.png, OUT/val/<class>/*.png) of images drawn
here, offline, whose train/val split is by *source*: no source of a val image made any train
image (issue 58: folders no recipe was tuned on, a check that a method's lead transfers).

    python scripts/make_synthetic_folders.py --kind glyphs   --out runs/folders/glyphs   --seed 0
    python scripts/make_synthetic_folders.py --kind textures --out runs/folders/textures --seed 0
    python scripts/make_synthetic_folders.py --kind shapes   --out runs/folders/shapes   --seed 0

glyphs    classes = 10 characters.  v4 (the default, --glyph-version 4): source = a font
          file of this machine (`fc-list`) drawn one of 4 ways (plain, heavier strokes, slanted,
          both); the letter large and near the centre (its ink's longer side 60 to 80% of the
          frame, shifted by at most 6%, turned by at most 10 degrees), dark ink on light paper
          in one of 4 palettes drawn per image and shared by every source, light noise; split
          by font (no variant of a val font draws a train image).  v3 (--glyph-version 3, the
          runs/sf3 folder, pixel for pixel): source = a font with its own paper and ink grey;
          each image a random size (50 to 80% of the frame's side for the font's size, so the
          ink covers ~13% of the frame), rotation, stroke, position, a jitter of +-12 on the
          source's greys and pixel noise.  Why v4: docs/results.md "Folders of our own".
textures  classes = 10 texture families (stripes, checks, dots, blobs, waves, rings, grid,
          zigzag, speckle, sectors); source = one draw of the generator's hidden parameters
          (two tinted greys, a frequency range, an edge sharpness, a noise level); each image a
          random orientation, phase, frequency within its source's range, its greys in a
          random order.
shapes    classes = 10 shapes (disc, triangle, square, pentagon, hexagon, star, cross, arrow,
          crescent, heart); source = a drawing style (filled / outlined / filled with an
          outline of the inverse grey, the stroke width, the background: flat, a gradient,
          stripes or noise, the noise level).  v4 (the default, --shape-version 4): the shape
          large and near the centre (its radius 30 to 40% of the frame's side, shifted by at
          most 6%, any rotation), dark ink on light paper in one of glyphs v4's 4 palettes drawn
          per image, the background's pattern faint (its second grey 20 levels from the
          paper).  v3 (--shape-version 3, the runs/sf3 folder, pixel for pixel): the style's own
          ink and two paper greys (the second 40 levels off), each image a random shape size
          (radius 22 to 42% of the side), position and rotation.  Why v4: docs/results.md
          "Folders of our own" (on v3 both methods stayed at chance).

The greys belong to the source, not to the image: a random colour per image is shared by the
two augmented views of it and tells the images apart better than their class does, so both
NAC and SimCLR learned the colours and stayed near chance (the first two versions of these
folders, docs/results.md "Folders of our own"; make_image_folder.py's shapes showed the same).
Glyphs v4 draws its greys from 4 palettes common to all sources instead: v3's source greys
named the font (and half the fonts were light on dark).

Every class gets --train-per-class images in train/ (spread evenly over the train sources) and
--val-per-class in val/ (over the val sources); a share --val-sources of the sources (at least
one, leaving at least one for train), chosen by --seed, is val's.  OUT/sources.json says which
source each split has, the classes, the counts and the command.  Images are --size px RGB,
drawn at twice that and reduced (antialiased).  The same arguments give the same pixels.

Writes into a temporary folder beside OUT and renames it into place at the end (no
half-written folder); refuses an OUT that exists and is not an empty folder unless
--overwrite, which replaces it only once the new folder is complete.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import signal
import subprocess
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFont

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nac_fast._files import atomic_folder, check_writable  # noqa: E402

KINDS = ("glyphs", "textures", "shapes")
GLYPHS = tuple("ABEGKMRSWZ")
TEXTURES = ("stripes", "checks", "dots", "blobs", "waves", "rings", "grid", "zigzag", "speckle",
            "sectors")
SHAPES = ("disc", "triangle", "square", "pentagon", "hexagon", "star", "cross", "arrow",
          "crescent", "heart")
N_SOURCES = {"textures": 40, "shapes": 40}  # glyphs: the fonts found
GLYPH_VERSIONS = (3, 4)
SHAPE_VERSIONS = (3, 4)
# Glyphs v4 (docs/results.md "Folders of our own"): each font is drawn 4 ways, 4 sources of it;
# stroke = a thickening of the outline (share of the font size), shear = the italic slant.
GLYPH_VARIANTS = {"plain": {"stroke": 0.0, "shear": 0.0}, "heavy": {"stroke": 0.04, "shear": 0.0},
                  "slanted": {"stroke": 0.0, "shear": 0.25},
                  "heavy-slanted": {"stroke": 0.04, "shear": 0.25}}
# (paper, ink): dark ink on light paper, one drawn per image from the same 4 for every source,
# so the greys say neither the source (v3's greys named it) nor the image (v1's and v2's did)
GLYPH_PALETTES = (((236, 236, 236), (20, 20, 20)), ((214, 204, 184), (62, 42, 36)),
                  ((186, 198, 212), (26, 34, 72)), ((170, 170, 170), (60, 60, 60)))
GLYPH_FILL = (0.6, 0.8)      # the ink's longer side, a share of the frame's side
GLYPH_OFFSET = 0.06          # the letter's shift, at most this share of the frame each way
GLYPH_ROTATE = 10.0          # degrees each way
FONT_EXTENSIONS = (".ttf", ".otf")
SHAPE_MODES = ("fill", "outline", "fill+outline")            # a style's ink (every version)
SHAPE_BACKGROUNDS = ("flat", "gradient", "stripes", "noise")  # a style's background pattern
SHAPE_RADIUS = (0.3, 0.4)   # shapes v4: the shape's radius, a share of the frame's side
SHAPE_OFFSET = 0.06         # shapes v4: its centre's shift, at most this share each way
SHAPE_BG_SHIFT = 20         # shapes v4: the background pattern's second grey, off the paper's
MAX_SIZE = 256


# ----------------------------------------------------------------------------------- sources
def find_fonts() -> list[str]:
    """The font files `fc-list` names (TrueType/OpenType), sorted; [] when there is none or no
    fc-list."""
    try:
        out = subprocess.run(["fc-list", "--format", "%{file}\n"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    files = {line.strip() for line in out.splitlines()}
    return sorted(f for f in files if f.lower().endswith(FONT_EXTENSIONS) and os.path.isfile(f))


def usable_fonts(files, chars=GLYPHS) -> list[str]:
    """The fonts that draw every one of `chars` with some ink (a font without a glyph draws a
    box or nothing, which would put one picture in several classes)."""
    good = []
    for f in files:
        try:
            font = ImageFont.truetype(f, 40)
        except OSError:
            continue
        boxes = []
        for c in chars:
            im = Image.new("L", (64, 64), 0)
            ImageDraw.Draw(im).text((32, 32), c, font=font, fill=255, anchor="mm")
            boxes.append(np.asarray(im).tobytes())
        if all(any(b) for b in boxes) and len(set(boxes)) == len(chars):
            good.append(f)
    return good


def _tinted_grey(rng, tint=25):
    """A grey level tinted by up to +-`tint` per channel."""
    g = int(rng.integers(0, 256))
    return tuple(int(v) for v in np.clip(g + rng.integers(-tint, tint + 1, 3), 0, 255))


def _tinted_greys(rng, contrast=100, tint=25):
    """(paper, ink): two grey levels at least `contrast` apart, each tinted by up to +-`tint`
    per channel.  Fully random colours would give the two views of an image a shared colour
    that tells the images apart better than their class does (the shortcut of the
    make_image_folder.py shapes, docs/results.md): kept faint here."""
    while True:
        g = rng.integers(0, 256, 2)
        if abs(int(g[0]) - int(g[1])) >= contrast:
            break
    return tuple(tuple(int(v) for v in np.clip(int(x) + rng.integers(-tint, tint + 1, 3), 0, 255))
                 for x in g)


def texture_source(seed: int, k: int) -> dict:
    """The hidden parameters of texture source k: a palette of two tinted greys, a frequency
    range (cycles an image), an edge sharpness and a noise level."""
    rng = np.random.default_rng([seed, 101, k])
    f_lo = float(rng.uniform(1.5, 3.5))
    return {"palette": list(_tinted_greys(rng)), "freq": [f_lo, f_lo * float(
        rng.uniform(1.3, 2.0))], "sharp": float(rng.uniform(2.0, 12.0)),
        "noise": float(rng.uniform(0.0, 18.0))}


def shape_source(seed: int, k: int) -> dict:
    """Drawing style k: how the shape is inked, its palette, the background and its palette,
    the size range and the noise level."""
    rng = np.random.default_rng([seed, 202, k])
    return {"mode": str(rng.choice(SHAPE_MODES)),
            "width": int(rng.integers(2, 6)), "ink": [], "paper": [],
            "background": str(rng.choice(SHAPE_BACKGROUNDS)),
            "radius": [float(rng.uniform(0.22, 0.3)), float(rng.uniform(0.32, 0.42))],
            "noise": float(rng.uniform(0.0, 15.0))} | _style_greys(rng)


def shape_source_v4(seed: int, k: int) -> dict:
    """Shapes v4's drawing style k: how the shape is inked, the background's pattern and the
    noise level.  No greys: the paper and ink come from GLYPH_PALETTES, drawn per image."""
    rng = np.random.default_rng([seed, 404, k])
    return {"mode": str(rng.choice(SHAPE_MODES)),
            "width": int(rng.integers(2, 6)),
            "background": str(rng.choice(SHAPE_BACKGROUNDS)),
            "noise": float(rng.uniform(0.0, 8.0))}


def _style_greys(rng) -> dict:
    """A style's ink and its paper's two greys (the second 40 levels from the first)."""
    paper, ink = _tinted_greys(rng)
    shift = 40 if sum(paper) < 3 * 128 else -40
    return {"ink": [ink], "paper": [paper, tuple(int(min(255, max(0, v + shift)))
                                                 for v in paper)]}


def glyph_source(seed: int, k: int, font_file: str) -> dict:
    """Font k's file and its paper and ink greys."""
    paper, ink = _tinted_greys(np.random.default_rng([seed, 303, k]))
    return {"font": font_file, "paper": paper, "ink": ink}


def glyph_source_v4(font_file: str, variant: str) -> dict:
    """Glyphs v4: a font file drawn one of GLYPH_VARIANTS' ways.  No greys: v4's paper and ink
    come from GLYPH_PALETTES, drawn per image, shared by every source."""
    return {"font": font_file, "variant": variant} | dict(GLYPH_VARIANTS[variant])


def sources_of(kind: str, seed: int, fonts=None, glyph_version: int = 4,
               shape_version: int = 4) -> list:
    """[(name, parameters)] of the kind's sources (glyphs v4: font-major, font f's variant v is
    source f * len(GLYPH_VARIANTS) + v)."""
    if kind == "glyphs" and glyph_version == 4:
        return [(f"{os.path.splitext(os.path.basename(f))[0]}-{v}", glyph_source_v4(f, v))
                for f in fonts for v in GLYPH_VARIANTS]
    if kind == "glyphs":
        return [(os.path.splitext(os.path.basename(f))[0], glyph_source(seed, k, f))
                for k, f in enumerate(fonts)]
    make = (texture_source if kind == "textures" else
            shape_source_v4 if shape_version == 4 else shape_source)
    return [(f"{kind[:-1]}-style-{k:02d}", make(seed, k)) for k in range(N_SOURCES[kind])]


def split_fonts(n_fonts: int, n_variants: int, frac: float, seed: int) -> tuple[list[int],
                                                                              list[int]]:
    """(train, val) source indices of glyphs v4: split_sources over the fonts, every variant of a
    font on its font's side, so no val image is drawn with a font (in any variant) of train."""
    tr, va = split_sources(n_fonts, frac, seed)
    return ([f * n_variants + v for f in tr for v in range(n_variants)],
            [f * n_variants + v for f in va for v in range(n_variants)])


def split_sources(n: int, frac: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) source indices: a seeded permutation, its first round(frac n) (at least one,
    at most n - 1) for val."""
    if n < 2:
        raise ValueError(f"a split by source needs at least 2 sources, got {n}")
    n_val = min(n - 1, max(1, int(round(frac * n))))
    perm = np.random.default_rng([seed, 7]).permutation(n)
    return sorted(int(i) for i in perm[n_val:]), sorted(int(i) for i in perm[:n_val])


# ----------------------------------------------------------------------------------- drawing
def _noise(im: Image.Image, sigma: float, rng) -> Image.Image:
    if sigma <= 0:
        return im
    x = np.asarray(im, dtype=np.float32) + rng.normal(0, sigma, (im.height, im.width, 3))
    return Image.fromarray(np.uint8(np.clip(x + 0.5, 0, 255)))


def _jitter(colour, rng, amount=12):
    return tuple(int(v) for v in np.clip(np.asarray(colour) + rng.integers(-amount, amount + 1, 3),
                                         0, 255))


def draw_glyph(c: str, src: dict, size: int, rng) -> Image.Image:
    big = 2 * size
    paper, ink = _jitter(src["paper"], rng), _jitter(src["ink"], rng)
    font = ImageFont.truetype(src["font"], int(rng.uniform(0.5, 0.8) * big))
    layer = Image.new("L", (big, big), 0)
    stroke = int(rng.integers(0, 3))
    ImageDraw.Draw(layer).text((big / 2, big / 2), c, font=font, fill=255, anchor="mm",
                               stroke_width=stroke, stroke_fill=255)
    layer = layer.rotate(float(rng.uniform(-20, 20)), resample=Image.BILINEAR,
                         translate=tuple(float(v) for v in rng.uniform(-0.1, 0.1, 2) * big))
    im = Image.composite(Image.new("RGB", (big, big), ink), Image.new("RGB", (big, big), paper),
                         layer)
    return _noise(im.resize((size, size), Image.LANCZOS), float(rng.uniform(0, 10)), rng)


def glyph_layer(c: str, src: dict, px: int = 96) -> Image.Image:
    """Glyphs v4: the character alone, white on black ("L"), drawn at `px` px in the source's
    variant (its stroke thickening, then its shear), cropped to its ink.  The same for every
    image of a (character, source): drawn once (the callers do not modify it)."""
    return _glyph_layer(c, src["font"], float(src["stroke"]), float(src["shear"]), px)


@functools.lru_cache(maxsize=None)
def _glyph_layer(c: str, font_file: str, stroke: float, shear: float, px: int) -> Image.Image:
    font = ImageFont.truetype(font_file, px)
    n = 3 * px
    layer = Image.new("L", (n, n), 0)
    ImageDraw.Draw(layer).text((n / 2, n / 2), c, font=font, fill=255, anchor="mm",
                               stroke_width=int(round(stroke * px)), stroke_fill=255)
    if shear:  # x' = x + shear (n/2 - y): the top leans right, the centre stays
        k = shear
        layer = layer.transform((n, n), Image.AFFINE, (1, k, -k * n / 2, 0, 1, 0),
                                resample=Image.BILINEAR)
    return layer.crop(layer.getbbox())


def draw_glyph_v4(c: str, src: dict, size: int, rng) -> Image.Image:
    """Glyphs v4: the letter large and near the centre (its ink's longer side GLYPH_FILL of the
    frame, offset by at most GLYPH_OFFSET of it, turned by at most GLYPH_ROTATE degrees), dark
    on light in a palette of GLYPH_PALETTES drawn per image (shared by every source), light
    noise."""
    big = 2 * size
    letter = glyph_layer(c, src)
    scale = float(rng.uniform(*GLYPH_FILL)) * big / max(letter.size)
    w, h = (max(1, int(round(v * scale))) for v in letter.size)
    letter = letter.resize((w, h), Image.LANCZOS)
    layer = Image.new("L", (big, big), 0)
    layer.paste(letter, ((big - w) // 2, (big - h) // 2))
    layer = layer.rotate(float(rng.uniform(-GLYPH_ROTATE, GLYPH_ROTATE)), resample=Image.BILINEAR,
                         translate=tuple(float(v) for v in
                                         rng.uniform(-GLYPH_OFFSET, GLYPH_OFFSET, 2) * big))
    paper, ink = GLYPH_PALETTES[int(rng.integers(len(GLYPH_PALETTES)))]
    paper, ink = _jitter(paper, rng, 6), _jitter(ink, rng, 6)
    im = Image.composite(Image.new("RGB", (big, big), ink), Image.new("RGB", (big, big), paper),
                         layer)
    return _noise(im.resize((size, size), Image.LANCZOS), float(rng.uniform(0, 6)), rng)


def texture_field(family: str, n: int, f: float, rng) -> np.ndarray:
    """A field in [-1, 1] (roughly) of the family on an n x n grid; f cycles per image."""
    y, x = np.mgrid[0:n, 0:n] / n
    th = rng.uniform(0, math.pi)
    u = x * math.cos(th) + y * math.sin(th)
    v = -x * math.sin(th) + y * math.cos(th)
    ph = rng.uniform(0, 2 * math.pi, 2)
    tau = 2 * math.pi
    if family == "stripes":
        return np.sin(tau * f * u + ph[0])
    if family == "checks":
        return np.sin(tau * f * u + ph[0]) * np.sin(tau * f * v + ph[1]) * 2
    if family == "dots":
        du = (f * u + ph[0] / tau) % 1 - 0.5
        dv = (f * v + ph[1] / tau) % 1 - 0.5
        return 1.0 - 2 * (np.hypot(du, dv) / 0.25)
    if family == "blobs":
        g = rng.normal(size=(max(3, int(f * 1.5)) + 1,) * 2)
        up = np.asarray(Image.fromarray(np.float32(g)).resize((n, n), Image.BICUBIC))
        return up / (np.abs(up).max() + 1e-6) * 1.5
    if family == "waves":
        return np.sin(tau * f * (u + 0.08 * np.sin(tau * 2.0 * v + ph[1])) + ph[0])
    if family == "rings":
        cx, cy = rng.uniform(0.2, 0.8, 2)
        return np.sin(tau * f * np.hypot(x - cx, y - cy) + ph[0])
    if family == "grid":
        a = np.abs(np.sin(math.pi * f * u + ph[0]))
        b = np.abs(np.sin(math.pi * f * v + ph[1]))
        return 1.0 - 2 * np.minimum(a, b) / 0.35
    if family == "zigzag":
        tri = 2 * np.abs((f * v + ph[1] / tau) % 1 - 0.5) - 0.5
        return np.sin(tau * f * (u + 0.5 * tri / f) + ph[0])
    if family == "speckle":
        g = rng.normal(size=(n // 2, n // 2))
        return np.asarray(Image.fromarray(np.float32(g)).resize((n, n), Image.NEAREST))
    if family == "sectors":
        cx, cy = rng.uniform(0.3, 0.7, 2)
        k = max(3, int(round(f * 1.5)))
        return np.sin(k * np.arctan2(y - cy, x - cx) + ph[0])
    raise ValueError(f"family {family!r}: not one of {TEXTURES}")


def draw_texture(family: str, src: dict, size: int, rng) -> Image.Image:
    big = 2 * size
    f = float(rng.uniform(*src["freq"]))
    field = texture_field(family, big, f, rng)
    t = 1 / (1 + np.exp(-src["sharp"] * field))  # 0..1, hard edges at high sharpness
    i, j = rng.choice(len(src["palette"]), 2, replace=False)
    c0, c1 = (np.asarray(src["palette"][k], dtype=np.float32) for k in (i, j))
    if np.abs(c0 - c1).sum() < 120:  # too alike to see the texture: darken one
        c1 = c1 * 0.35
    rgb = c0 + (c1 - c0) * t[..., None]
    im = Image.fromarray(np.uint8(np.clip(rgb + 0.5, 0, 255)))
    return _noise(im.resize((size, size), Image.LANCZOS), src["noise"], rng)


def shape_points(kind: str, cx, cy, r, angle) -> list:
    """The polygon of a shape of radius r about (cx, cy), turned by angle."""
    tau = 2 * math.pi

    def ring(k, rad=1.0, off=-math.pi / 2):
        return [(rad * math.cos(off + tau * i / k), rad * math.sin(off + tau * i / k))
                for i in range(k)]
    if kind == "disc":
        pts = ring(48)
    elif kind == "triangle":
        pts = ring(3)
    elif kind == "square":
        pts = ring(4, 1.0, math.pi / 4)
    elif kind == "pentagon":
        pts = ring(5)
    elif kind == "hexagon":
        pts = ring(6)
    elif kind == "star":
        pts = [(p[0] * (1 if i % 2 == 0 else 0.4), p[1] * (1 if i % 2 == 0 else 0.4))
               for i, p in enumerate(ring(10))]
    elif kind == "cross":
        w = 0.33
        pts = [(-w, -1), (w, -1), (w, -w), (1, -w), (1, w), (w, w), (w, 1), (-w, 1), (-w, w),
               (-1, w), (-1, -w), (-w, -w)]
    elif kind == "arrow":
        pts = [(-1, -0.3), (0.2, -0.3), (0.2, -0.75), (1, 0), (0.2, 0.75), (0.2, 0.3), (-1, 0.3)]
    elif kind == "crescent":
        outer = [(math.cos(t), math.sin(t)) for t in np.linspace(-math.pi / 2, math.pi / 2, 24)]
        inner = [(0.35 * math.cos(t), math.sin(t))
                 for t in np.linspace(math.pi / 2, -math.pi / 2, 24)]
        pts = outer + inner
    elif kind == "heart":
        t = np.linspace(0, tau, 48, endpoint=False)
        hx = 16 * np.sin(t) ** 3
        hy = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
        pts = list(zip(hx / 17, (hy + 2.5) / 17))
    else:
        raise ValueError(f"shape {kind!r}: not one of {SHAPES}")
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + r * (c * px - s * py), cy + r * (s * px + c * py)) for px, py in pts]


def _background(src: dict, big: int, rng) -> Image.Image:
    i, j = rng.choice(len(src["paper"]), 2, replace=False)
    a, b = (np.asarray(src["paper"][k], dtype=np.float32) for k in (i, j))
    y, x = np.mgrid[0:big, 0:big] / big
    kind = src["background"]
    if kind == "flat":
        t = np.zeros((big, big))
    elif kind == "gradient":
        th = rng.uniform(0, 2 * math.pi)
        t = (x * math.cos(th) + y * math.sin(th)) % 1.0
    elif kind == "stripes":
        th = rng.uniform(0, math.pi)
        t = (np.sin(2 * math.pi * rng.uniform(3, 6) * (x * math.cos(th) + y * math.sin(th)))
             > 0).astype(np.float64) * 0.5
    else:
        g = rng.normal(size=(8, 8))
        t = np.asarray(Image.fromarray(np.float32(g)).resize((big, big), Image.BICUBIC))
        t = np.clip(0.5 + 0.25 * t, 0, 1)
    rgb = a + (b - a) * t[..., None]
    return Image.fromarray(np.uint8(np.clip(rgb + 0.5, 0, 255)))


def draw_shape(kind: str, src: dict, size: int, rng) -> Image.Image:
    big = 2 * size
    im = _background(src, big, rng)
    mean_bg = tuple(int(v) for v in np.asarray(im).reshape(-1, 3).mean(0))
    ink = src["ink"][int(rng.integers(len(src["ink"])))]
    if sum(abs(a - b) for a, b in zip(ink, mean_bg)) < 150:  # the style's ink on its paper
        ink = tuple(255 - v for v in mean_bg)
    r = float(rng.uniform(*src["radius"])) * big
    cx, cy = rng.uniform(r, big - r, 2)
    return _ink_shape(im, kind, src, ink, (ink, tuple(255 - v for v in ink)), cx, cy, r, size,
                      rng)


def draw_shape_v4(kind: str, src: dict, size: int, rng) -> Image.Image:
    """Shapes v4: the shape large and near the centre (radius SHAPE_RADIUS of the frame, centre
    shifted by at most SHAPE_OFFSET of it, any rotation), dark on light in a palette of
    GLYPH_PALETTES drawn per image (shared by every source), the style's background pattern
    between the paper and a grey SHAPE_BG_SHIFT levels darker; "fill+outline" fills with the
    grey halfway between ink and paper inside an outline of ink (v3's outline, the inverse of
    a dark ink, would vanish into light paper)."""
    big = 2 * size
    paper, ink = GLYPH_PALETTES[int(rng.integers(len(GLYPH_PALETTES)))]
    paper, ink = _jitter(paper, rng, 6), _jitter(ink, rng, 6)
    second = tuple(max(0, v - SHAPE_BG_SHIFT) for v in paper)
    im = _background(src | {"paper": [paper, second]}, big, rng)
    r = float(rng.uniform(*SHAPE_RADIUS)) * big
    cx, cy = big / 2 + rng.uniform(-SHAPE_OFFSET, SHAPE_OFFSET, 2) * big
    mid = tuple((a + b) // 2 for a, b in zip(ink, paper))
    return _ink_shape(im, kind, src, ink, (mid, ink), cx, cy, r, size, rng)


def _ink_shape(im, kind, src, ink, both, cx, cy, r, size, rng) -> Image.Image:
    """Draw shape `kind` of radius r about (cx, cy), at a random rotation, on the background im
    (2 size px) in the style's mode ("fill", "outline": ink; "fill+outline": both = (fill,
    outline)); reduce to size px and add the style's noise."""
    pts = shape_points(kind, cx, cy, r, float(rng.uniform(0, 2 * math.pi)))
    draw = ImageDraw.Draw(im)
    w = 2 * src["width"]
    if src["mode"] == "fill":
        draw.polygon(pts, fill=ink)
    elif src["mode"] == "outline":
        draw.polygon(pts, outline=ink, width=w)
    else:
        draw.polygon(pts, fill=both[0], outline=both[1], width=w)
    return _noise(im.resize((size, size), Image.LANCZOS), src["noise"], rng)


# ----------------------------------------------------------------------------------- the folder
def plan(kind: str, seed: int, train_per_class: int, val_per_class: int, val_frac: float,
         fonts=None, glyph_version: int = 4, shape_version: int = 4) -> dict:
    """What the folder holds: classes, sources, the split of the sources, the counts.  Glyphs
    v4 splits the fonts (split_fonts); v3 and the other kinds split the sources."""
    if glyph_version not in GLYPH_VERSIONS:
        raise ValueError(f"glyph_version must be one of {GLYPH_VERSIONS}, got {glyph_version!r}")
    if shape_version not in SHAPE_VERSIONS:
        raise ValueError(f"shape_version must be one of {SHAPE_VERSIONS}, got {shape_version!r}")
    classes = {"glyphs": GLYPHS, "textures": TEXTURES, "shapes": SHAPES}[kind]
    srcs = sources_of(kind, seed, fonts, glyph_version, shape_version)
    if kind == "glyphs" and glyph_version == 4:
        train_idx, val_idx = split_fonts(len(fonts), len(GLYPH_VARIANTS), val_frac, seed)
    else:
        train_idx, val_idx = split_sources(len(srcs), val_frac, seed)
    p = {"kind": kind, "seed": seed, "classes": list(classes), "sources": srcs,
         "train_sources": train_idx, "val_sources": val_idx,
         "per_class": {"train": train_per_class, "val": val_per_class}}
    if kind == "glyphs":
        p["glyph_version"] = glyph_version
    if kind == "shapes":
        p["shape_version"] = shape_version
    return p


def images(p: dict, size: int):
    """(split, class, source index, i, image) for every image of plan p, in a fixed order; the
    image's random draws come from its own seed (seed, split, class, i), so one image does not
    depend on how many others are drawn."""
    glyph = draw_glyph_v4 if p.get("glyph_version") == 4 else draw_glyph
    shape = draw_shape_v4 if p.get("shape_version") == 4 else draw_shape
    draw = {"glyphs": lambda c, s, r: glyph(c, s, size, r),
            "textures": lambda c, s, r: draw_texture(c, s, size, r),
            "shapes": lambda c, s, r: shape(c, s, size, r)}[p["kind"]]
    for si, split in enumerate(("train", "val")):
        idx = p[f"{split}_sources"]
        for ci, c in enumerate(p["classes"]):
            for i in range(p["per_class"][split]):
                k = idx[i % len(idx)]
                rng = np.random.default_rng([p["seed"], si, ci, i])
                yield split, c, k, i, draw(c, p["sources"][k][1], rng)


def write_folder(p: dict, size: int, out: str, overwrite: bool, command: str,
                 progress: bool = True) -> dict:
    """Write plan p's images into a temporary folder beside `out`, then rename it into place
    (an `out` already there is replaced only with `overwrite`, once the new one is complete).
    Returns the counts."""
    from tqdm import tqdm
    counts = {"train": {}, "val": {}}
    total = len(p["classes"]) * (p["per_class"]["train"] + p["per_class"]["val"])
    with atomic_folder(out) as tmp:
        for split, c, k, i, im in tqdm(images(p, size), total=total, disable=not progress,
                                       desc=f"{p['kind']} -> {os.path.basename(out)}",
                                       unit="img"):
            d = os.path.join(tmp, split, c)
            os.makedirs(d, exist_ok=True)
            im.save(os.path.join(d, f"s{k:02d}-{i:05d}.png"))
            counts[split][c] = counts[split].get(c, 0) + 1
        names = [n for n, _ in p["sources"]]
        split_by = "source: no source of a val image made any train image"
        if p.get("glyph_version") == 4:
            split_by += " (nor any variant of its font)"
        meta = {"kind": p["kind"]}
        for key in ("glyph_version", "shape_version"):
            if key in p:
                meta[key] = p[key]
        meta |= {"seed": p["seed"], "size": size, "classes": p["classes"], "split_by": split_by,
                "sources": {"train": {f"s{k:02d}": names[k] for k in p["train_sources"]},
                            "val": {f"s{k:02d}": names[k] for k in p["val_sources"]}},
                "counts": counts, "command": command}
        meta["source_parameters"] = {  # the hidden parameters of each source
            f"s{k:02d}": {n: (os.path.basename(v) if n == "font" else v) for n, v in src.items()}
            for k, (_, src) in enumerate(p["sources"])}
        with open(os.path.join(tmp, "sources.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="the folder to create")
    ap.add_argument("--kind", required=True, choices=KINDS)
    ap.add_argument("--seed", type=int, default=0, help="sources, their split and every image")
    ap.add_argument("--size", type=int, default=32, help="image side in pixels")
    ap.add_argument("--train-per-class", type=int, default=1400, help="train images per class")
    ap.add_argument("--val-per-class", type=int, default=250, help="val images per class")
    ap.add_argument("--val-sources", type=float, default=0.25,
                    help="share of the sources (glyphs v4: of the fonts) whose images go to "
                    "val/ (and none to train/)")
    ap.add_argument("--glyph-version", type=int, choices=GLYPH_VERSIONS, default=None,
                    help="--kind glyphs only: 4 (the default) draws the letter large and centred "
                    "in palettes shared by every source, 4 variants of each font as sources, "
                    "split by font; 3 gives the v3 folder (runs/sf3/glyphs) pixel for pixel")
    ap.add_argument("--shape-version", type=int, choices=SHAPE_VERSIONS, default=None,
                    help="--kind shapes only: 4 (the default) draws the shape large and centred "
                    "in palettes shared by every source, its background faint; 3 gives the v3 "
                    "folder (runs/sf3/shapes) pixel for pixel")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace OUT if it exists (once the new folder is complete)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if not 8 <= args.size <= MAX_SIZE:
        ap.error(f"--size must lie in [8, {MAX_SIZE}], got {args.size}")
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")
    for flag in ("train_per_class", "val_per_class"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 < args.val_sources < 1:
        ap.error(f"--val-sources must lie in (0, 1), got {args.val_sources}")
    if args.glyph_version is not None and args.kind != "glyphs":
        ap.error(f"--glyph-version: only for --kind glyphs, not --kind {args.kind}")
    if args.shape_version is not None and args.kind != "shapes":
        ap.error(f"--shape-version: only for --kind shapes, not --kind {args.kind}")
    out = os.path.abspath(args.out)
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        if not args.overwrite:
            ap.error(f"--out {args.out}: exists and is not an empty folder; pass --overwrite to "
                     "replace it")
        if not os.path.isdir(out):
            ap.error(f"--out {args.out}: is a file, not a folder")
    try:
        check_writable("--out", os.path.join(out, "x"))
    except ValueError as exc:
        ap.error(str(exc))
    fonts = None
    if args.kind == "glyphs":
        fonts = usable_fonts(find_fonts())
        if len(fonts) < 2:
            ap.error(f"--kind glyphs: needs at least 2 fonts that draw {''.join(GLYPHS)} "
                     f"(`fc-list` lists the fonts), found {len(fonts)}")
    p = plan(args.kind, args.seed, args.train_per_class, args.val_per_class, args.val_sources,
             fonts, 4 if args.glyph_version is None else args.glyph_version,
             4 if args.shape_version is None else args.shape_version)
    command = " ".join(["python", "scripts/make_synthetic_folders.py"] +
                       [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])
    # a kill (SIGTERM) unwinds like an error, so the temporary folder goes with it
    before = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        counts = write_folder(p, args.size, out, args.overwrite, command,
                              progress=not args.no_progress)
    finally:
        signal.signal(signal.SIGTERM, before)
    n_tr, n_va = sum(counts["train"].values()), sum(counts["val"].values())
    print(f"{out}: {n_tr} train / {n_va} val images, {len(p['classes'])} classes, {args.size} "
          f"px; sources {len(p['train_sources'])} train / {len(p['val_sources'])} val")
    return 0


if __name__ == "__main__":
    sys.exit(main())
