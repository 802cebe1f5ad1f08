"""Stage 3 of the data path: what a view does to an image.  The recipe, its per-view parameters,
and its three implementations (batched tensors, PIL, DALI), side by side.

sources -> order -> AUGMENT -> loaders.  Imports only order (for the counter-based uniforms).

One recipe, three executors.  `view_params` turns counter-based uniforms (order.uniform) into
per-sample parameters; the in-memory tensor loader, the torchvision ImageFolder loader and the DALI
pipelines all consume exactly these parameters, so they agree on which crop, flip, jitter factors,
grayscale and blur each (seed, epoch, image, view) gets:
  tensor (in-memory sources; the colour stage of the ImageFolder loader): resized_crop_flip,
      colour_blur, normalize -> augment_batch; eval view center_resize;
  PIL (ImageFolder decode workers): pil_crop_flip_views; eval view pil_center_crop;
  DALI (ImageFolder, inside the pipeline graph): dali_param_batch feeds dali_views.

Semantics (docs/math.md [M:recipe], the NAC paper's Experimental Details = SimCLR/MoCo-v2
augmentations; each image gives the two views of [M:notation]):
  random resized crop, area scale (0.08, 1) (configurable: train.py --crop-scale; the ImageNet
      recipes' 0.2), aspect ratio (3/4, 4/3); torchvision's
      algorithm (10 attempts, then a whole-image fallback) but with sub-pixel windows (no rounding:
      DALI's resize takes float ROIs, PIL's resize takes a float box, grid_sample is continuous);
  horizontal flip p=0.5;
  colour jitter p=0.8: brightness, contrast, saturation 0.4, hue 0.1, applied in the fixed order
      brightness -> contrast -> saturation -> hue (torchvision draws a random order; DALI cannot,
      so every loader uses the fixed one; solo-learn's DALI pipeline does the same).  Contrast
      blends towards the grayscale mean of the view, as torchvision does.  1-channel images get
      brightness and contrast only;
  grayscale p=0.2 (a no-op for 1-channel images);
  Gaussian blur p=0.5, sigma in [0.1, 2], kernel ~10% of the view (23 px at 224): "imagenet"
      recipe only; the "small" recipe (CIFAR, Fashion-MNIST) has none, as in the paper.
Deviation of the DALI executor: DALI's hue rotates in the YIQ linear model, torchvision shifts HSV
hue exactly; over the full recipe the views differ by 0.10-0.19 (mean |diff|, normalised units, at
224-48 px) against ~0.007 with hue off, where the DALI and torchvision loaders agree to ~1 uint8
level (tested).
Eval views (no augmentation: the fixed features of docs/math.md [M:linear-probe], [M:knn]):
in-memory images resized whole, ImageFolder images resized to size/0.875 on the short side and
centre-cropped (224 <- 256).
Timings of these implementations on the development machine: bench/results/data_timings.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from .order import uniform

CROP_ATTEMPTS = 10          # torchvision RandomResizedCrop tries 10 windows before falling back
_GRAY = (0.299, 0.587, 0.114)   # ITU-R 601 luma, torchvision's rgb_to_grayscale weights


@dataclass(frozen=True)
class Recipe:
    name: str = "small"
    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3.0 / 4.0, 4.0 / 3.0)
    flip_p: float = 0.5
    jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.4
    hue: float = 0.1
    gray_p: float = 0.2
    blur_p: float = 0.0
    blur_sigma: tuple = (0.1, 2.0)

    def blur_kernel(self, image_size: int) -> int:
        """Odd kernel of ~10% of the view (SimCLR): 23 at 224, 3 at 32."""
        return max(3, int(0.1 * image_size) // 2 * 2 + 1)


def make_recipe(recipe="auto", image_size: int = 224, scale=None) -> Recipe:
    """`recipe`: "small" (no blur, the paper's CIFAR recipe), "imagenet" (+ blur p=0.5), "auto"
    (imagenet for views of >= 96 px, small below), or a Recipe.  `scale` overrides the crop scale."""
    if isinstance(recipe, Recipe):
        r = recipe
    elif recipe == "auto":
        r = Recipe("imagenet", blur_p=0.5) if image_size >= 96 else Recipe("small")
    elif recipe == "small":
        r = Recipe("small")
    elif recipe == "imagenet":
        r = Recipe("imagenet", blur_p=0.5)
    else:
        raise ValueError(f"recipe must be 'auto', 'small', 'imagenet' or a Recipe, got {recipe!r}")
    if scale is not None:
        lo, hi = (float(v) for v in scale)
        if not 0.0 < lo <= hi <= 1.0:
            raise ValueError(f"scale must satisfy 0 < lo <= hi <= 1, got {scale!r}")
        r = replace(r, scale=(lo, hi))
    return r


# --------------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------------
_NUM_UNIFORMS = 2 * CROP_ATTEMPTS + 11


def view_params(recipe: Recipe, seed: int, epoch: int, index, view: int) -> dict:
    """Per-sample parameters of view `view` (0 or 1) for dataset indices `index` (float32 numpy).

    Keys: area, ratio (B, K) crop attempts; ux, uy crop position; flip (bool); brightness,
    contrast, saturation, hue (identity values where jitter is not applied); gray (bool);
    sigma (0 where no blur).
    """
    u = uniform(seed, epoch, index, stream=1 + view, n=_NUM_UNIFORMS)
    K = CROP_ATTEMPTS
    lo, hi = recipe.scale
    lr = np.log(np.asarray(recipe.ratio, dtype=np.float64))
    p = {
        "area": (lo + (hi - lo) * u[:, :K]),
        "ratio": np.exp(lr[0] + (lr[1] - lr[0]) * u[:, K:2 * K]),
        "ux": u[:, 2 * K], "uy": u[:, 2 * K + 1],
        "flip": u[:, 2 * K + 2] < recipe.flip_p,
    }
    jit = u[:, 2 * K + 3] < recipe.jitter_p

    def factor(strength, col):
        f = 1.0 - strength + 2.0 * strength * u[:, col]
        return np.where(jit, f, 1.0)

    p["brightness"] = factor(recipe.brightness, 2 * K + 4)
    p["contrast"] = factor(recipe.contrast, 2 * K + 5)
    p["saturation"] = factor(recipe.saturation, 2 * K + 6)
    p["hue"] = np.where(jit, recipe.hue * (2.0 * u[:, 2 * K + 7] - 1.0), 0.0)
    p["gray"] = u[:, 2 * K + 8] < recipe.gray_p
    s_lo, s_hi = recipe.blur_sigma
    p["sigma"] = np.where(u[:, 2 * K + 9] < recipe.blur_p,
                          s_lo + (s_hi - s_lo) * u[:, 2 * K + 10], 0.0)
    return {k: (v if v.dtype == bool else v.astype(np.float32)) for k, v in p.items()}


def crop_windows(params: dict, height, width, ratio_range) -> np.ndarray:
    """(B, 4) float32 windows x0, y0, w, h for images of size (height, width) (arrays or scalars).

    torchvision's RandomResizedCrop: the first of the K attempts that fits, else the whole image
    with its aspect ratio clamped to `ratio_range`.  Computed in float32 like the DALI graph.
    """
    B = params["area"].shape[0]
    H = np.broadcast_to(np.asarray(height, dtype=np.float32), (B,))[:, None]
    W = np.broadcast_to(np.asarray(width, dtype=np.float32), (B,))[:, None]
    area = H * W * params["area"]
    w = np.sqrt(area * params["ratio"])
    h = np.sqrt(area / params["ratio"])
    valid = (w <= W) & (h <= H)
    first = valid.argmax(axis=1)
    rows = np.arange(B)
    anyv = valid.any(axis=1)
    rmin, rmax = (np.float32(v) for v in ratio_range)
    H, W = H[:, 0], W[:, 0]
    wc = np.where(anyv, w[rows, first], np.minimum(W, H * rmax))
    hc = np.where(anyv, h[rows, first], np.minimum(H, W / rmin))
    x0 = params["ux"] * (W - wc)
    y0 = params["uy"] * (H - hc)
    return np.stack([x0, y0, wc, hc], axis=1).astype(np.float32)


class one_cpu_thread:
    """Run CPU tensor ops single-threaded, then restore the caller's thread count.

    Why: the batches are small and with several intra-op threads on a busy host the threads spin
    at every op's barrier (figures: bench/results/data_timings.md).  A no-op on other devices.
    """

    def __init__(self, device):
        self.active = torch.device(device).type == "cpu"

    def __enter__(self):
        if self.active:
            self.prev = torch.get_num_threads()
            if self.prev != 1:
                torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        if self.active and self.prev != 1:
            torch.set_num_threads(self.prev)
        return False


# --------------------------------------------------------------------------------------------
# batched tensor ops (in-memory sources on CPU or GPU; colour stage of the torchvision loader)
# --------------------------------------------------------------------------------------------
def _t(a, device, dtype=torch.float32):
    return torch.as_tensor(np.ascontiguousarray(a), device=device).to(dtype)


def resized_crop_flip(images: torch.Tensor, windows, flip, size: int) -> torch.Tensor:
    """Batched crop + bilinear resize + flip of same-sized float images (B,C,H,W) via one
    grid_sample, instead of a per-sample torchvision RandomResizedCrop loop (far slower:
    bench/results/data_timings.md)."""
    B, _, H, W = images.shape
    win = _t(windows, images.device)
    fl = _t(flip, images.device)
    x0, y0, w, h = win.unbind(1)
    theta = torch.zeros(B, 2, 3, device=images.device)
    theta[:, 0, 0] = (w / W) * (1.0 - 2.0 * fl)
    theta[:, 0, 2] = (2.0 * x0 + w) / W - 1.0
    theta[:, 1, 1] = h / H
    theta[:, 1, 2] = (2.0 * y0 + h) / H - 1.0
    grid = F.affine_grid(theta, [B, images.shape[1], size, size], align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _gray(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 1:
        return x
    r, g, b = x.unbind(1)
    return (_GRAY[0] * r + _GRAY[1] * g + _GRAY[2] * b).unsqueeze(1)


def _shift_hue(x: torch.Tensor, hue: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_hue (RGB -> HSV, h += hue mod 1, -> RGB) for per-sample `hue` (B,),
    with the closed-form HSV->RGB  c_n = V - (V - min) * clamp(min(k, 4 - k), 0, 1),
    k = (n + 6h) mod 6, n = 5, 3, 1 for R, G, B: ~10 whole-tensor ops instead of torchvision's
    ~40 (hue dominated the torchvision loader's colour stage; bench/results/data_timings.md)."""
    maxc, arg = x.max(dim=1, keepdim=True)
    minc = x.amin(dim=1, keepdim=True)
    cr = maxc - minc
    d = (maxc - x) / torch.where(cr > 0, cr, torch.ones_like(cr))      # rc, gc, bc
    rc, gc, bc = d.unbind(1)
    a = arg.squeeze(1)
    h = torch.where(a == 0, bc - gc, torch.where(a == 1, 2.0 + rc - bc, 4.0 + gc - rc)).unsqueeze(1)
    h = torch.remainder(h / 6.0 + hue.view(-1, 1, 1, 1), 1.0)
    n = torch.tensor([5.0, 3.0, 1.0], device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    k = torch.remainder(n + 6.0 * h, 6.0)
    return maxc - cr * torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0)


def _gray_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean of the grayscale image, (B,1,1,1): the luma of the channel means (linear)."""
    m = x.mean(dim=(2, 3))
    if x.shape[1] == 3:
        m = m @ torch.tensor(_GRAY, device=x.device, dtype=x.dtype).view(3, 1)
    return m.view(-1, 1, 1, 1)


def colour_blur(x: torch.Tensor, params: dict, recipe: Recipe) -> torch.Tensor:
    """Jitter (fixed order b, c, s, h), grayscale and blur on float images in [0, 1] (B,C,S,S),
    in place, torchvision's formulas with per-sample factors."""
    dev = x.device
    col = lambda k: _t(params[k], dev).view(-1, 1, 1, 1)  # noqa: E731
    x.mul_(col("brightness")).clamp_(0.0, 1.0)
    c = col("contrast")
    m = _gray_mean(x)                          # before the in-place scaling below
    x.mul_(c).add_((1.0 - c) * m).clamp_(0.0, 1.0)
    if x.shape[1] == 3:
        s = col("saturation")
        g = _gray(x)
        x.mul_(s).add_((1.0 - s) * g).clamp_(0.0, 1.0)
        sel = np.flatnonzero(params["hue"])
        if sel.size:
            t = torch.as_tensor(sel, device=dev)
            x[t] = _shift_hue(x[t], _t(params["hue"][sel], dev))
        gsel = np.flatnonzero(params["gray"])
        if gsel.size:
            t = torch.as_tensor(gsel, device=dev)
            x[t] = _gray(x[t]).expand(-1, 3, -1, -1)
    bsel = np.flatnonzero(params["sigma"])
    if bsel.size:
        t = torch.as_tensor(bsel, device=dev)
        sig = params["sigma"][bsel]
        x[t] = gaussian_blur(x[t], sig, blur_window(recipe, x.shape[-1], sig))
    return x


def blur_window(recipe: Recipe, size: int, sigma) -> int:
    """torchvision's ~10% kernel, cut to 2*ceil(3*max sigma)+1 taps: 13 instead of 23 at 224 px
    for sigma <= 2; the dropped taps weigh < 0.3% (the DALI pipeline cuts the same way)."""
    return int(min(recipe.blur_kernel(size), 2 * np.ceil(3 * float(np.max(sigma))) + 1))


def gaussian_blur(x: torch.Tensor, sigma, ksize: int) -> torch.Tensor:
    """Separable per-sample Gaussian blur with reflect padding (torchvision's GaussianBlur)."""
    B, C, H, W = x.shape
    half = ksize // 2
    pos = torch.arange(-half, half + 1, device=x.device, dtype=x.dtype)
    sig = _t(sigma, x.device, x.dtype).view(-1, 1)
    k = torch.exp(-0.5 * (pos / sig) ** 2)
    k = (k / k.sum(1, keepdim=True)).repeat_interleave(C, 0)          # (B*C, k)
    y = F.pad(x.reshape(1, B * C, H, W), (half, half, half, half), mode="reflect")
    y = F.conv2d(y, k.view(B * C, 1, 1, ksize), groups=B * C)
    y = F.conv2d(y, k.view(B * C, 1, ksize, 1), groups=B * C)
    return y.view(B, C, H, W)


def normalize(x: torch.Tensor, mean, std, dtype, channels_last: bool) -> torch.Tensor:
    m = torch.as_tensor(mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.as_tensor(std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
    x = ((x - m) / s).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x.contiguous()


def augment_batch(images_u8: torch.Tensor, index, seed: int, epoch: int, view: int, recipe: Recipe,
                  size: int, mean, std, dtype=torch.float32, channels_last=False) -> torch.Tensor:
    """One view of a batch of same-sized uint8 images (B,C,H,W), on images_u8.device."""
    p = view_params(recipe, seed, epoch, index, view)
    _, _, H, W = images_u8.shape
    win = crop_windows(p, H, W, recipe.ratio)
    x = resized_crop_flip(images_u8.float().div_(255.0), win, p["flip"], size)
    x = colour_blur(x, p, recipe)
    return normalize(x, mean, std, dtype, channels_last)


def center_resize(images_u8: torch.Tensor, size: int) -> torch.Tensor:
    """Eval view of same-sized uint8 images: float in [0, 1], whole image resized to `size`
    (identity at the natural size)."""
    x = images_u8.float().div_(255.0)
    if x.shape[-1] != size or x.shape[-2] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x



# --------------------------------------------------------------------------------------------
# PIL (ImageFolder loader workers: decode, crop and flip per image; the colour stage is batched).
# PIL is imported in the functions: the in-memory path runs without Pillow installed.
# --------------------------------------------------------------------------------------------
def to_uint8_chw(img) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


def pil_crop_flip_views(img, recipe: Recipe, seed: int, epoch: int, index: int, size: int):
    """Both views' crop and flip of one decoded PIL image: PIL resize with a float box (the window
    of crop_windows, antialiased), then the flip.  Two uint8 (C, size, size) tensors."""
    from PIL import Image
    views = []
    for view in (0, 1):
        p = view_params(recipe, seed, epoch, np.array([index]), view)
        x0, y0, w, h = crop_windows(p, img.height, img.width, recipe.ratio)[0].tolist()
        v = img.resize((size, size), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
        if p["flip"][0]:
            v = v.transpose(Image.FLIP_LEFT_RIGHT)
        views.append(to_uint8_chw(v))
    return views[0], views[1]


def pil_center_crop(img, size: int) -> torch.Tensor:
    """Eval view of one decoded PIL image: short side resized to size/0.875, centre crop; uint8
    CHW.

    An image whose resized whole would exceed 16 crops (aspect ratio over about 16) is cropped in
    the source image's coordinates and resized in one step (PIL's resize with a float `box`):
    the same sampling grid and filter as resizing the whole image to (w, h) and cropping it
    (within one level of rounding), without making that whole image, which for a very elongated
    image (a 2 x 60000 strip: 256 x 7.7M pixels) took gigabytes and tens of seconds."""
    from PIL import Image
    short = round(size / 0.875)          # 256 -> 224, the ImageNet convention
    scale = short / min(img.width, img.height)
    w, h = max(size, round(img.width * scale)), max(size, round(img.height * scale))
    left, top = (w - size) // 2, (h - size) // 2
    if w * h <= 16 * size * size:  # the usual image: resize, then crop (the same bits as before)
        img = img.resize((w, h), Image.BILINEAR)
        return to_uint8_chw(img.crop((left, top, left + size, top + size)))
    sx, sy = img.width / w, img.height / h        # source pixels per pixel of the (w, h) image
    box = (left * sx, top * sy, (left + size) * sx, (top + size) * sy)
    return to_uint8_chw(img.resize((size, size), Image.BILINEAR, box=box))


# --------------------------------------------------------------------------------------------
# DALI (inside the ImageFolder pipeline graph; `dali` is the nvidia.dali module, imported by the
# DALI loader only)
# --------------------------------------------------------------------------------------------
DALI_PARAMS = ("area", "ratio", "ux", "uy", "flip", "brightness", "contrast", "saturation", "hue",
               "jitter", "gray", "sigma", "window")


def dali_param_batch(recipe: Recipe, seed: int, epoch: int, idx, view: int, size: int) -> list:
    """External-source arrays for one view of one batch: for each name in DALI_PARAMS, a list of
    one numpy array per sample (float32; the flags bool, the blur window int32)."""
    p = view_params(recipe, seed, epoch, idx, view)
    p["jitter"] = ((p["brightness"] != 1) | (p["contrast"] != 1) | (p["saturation"] != 1)
                   | (p["hue"] != 0))
    p["hue"] = p["hue"] * np.float32(360.0)                 # DALI takes degrees
    p["flip"] = p["flip"].astype(np.float32)
    p["window"] = np.minimum(2 * np.ceil(3 * p["sigma"]) + 1,
                             recipe.blur_kernel(size)).astype(np.int32)
    return [[np.ascontiguousarray(p[k][i]).reshape(np.shape(p[k][i]) or (1,))
             for i in range(len(idx))] for k in DALI_PARAMS]


def dali_views(dali, images, hw, params, recipe: Recipe, size: int, mean, std, out_dtype,
               nhwc: bool, gpu: bool, arithmetic_contrast: bool) -> list:
    """The two views of decoded `images` as DALI graph nodes (call inside a pipeline_def with
    enable_conditionals=True).  hw: the images' (H, W) as FLOAT nodes; params: the 2 x
    len(DALI_PARAMS) external-source nodes of dali_param_batch (view 0, then view 1).

    The crop window (torchvision's 10-attempt RandomResizedCrop, as crop_windows) is evaluated in
    the graph because the image size is only known there; resize with a float ROI (flip = reversed
    x ROI), brightness and contrast about the view's grayscale mean (torchvision's contrast), hue
    and saturation in one fn.hsv, grayscale as a second (saturation 0 = luma, exact in DALI's YIQ
    colour model), Gaussian blur (imagenet recipe), and normalise to NHWC (channels-last: what the
    model eats without a transpose) or NCHW float16/float32.  arithmetic_contrast: the GPU graph's
    contrast by arithmetic (forced on the CPU by a test)."""
    fn, types, dmath = dali.fn, dali.types, dali.math
    rmin, rmax = (float(v) for v in recipe.ratio)
    order = np.arange(CROP_ATTEMPTS, 0, -1, dtype=np.float32)    # attempt k scores K - k
    H, W = hw[0], hw[1]

    def on_dev(x):            # a per-sample CPU scalar as an operand of GPU image arithmetic
        return x.gpu() if gpu else x

    outs = []
    n = len(DALI_PARAMS)
    for view in (0, 1):
        (area, ratio, ux, uy, flip, bright, contr, sat, hue, jitter, gray, sigma,
         window) = params[n * view:n * view + n]
        blur = sigma > 0
        # torchvision RandomResizedCrop: first fitting attempt, else clamped whole image
        a = H * W * area
        w = dmath.sqrt(a * ratio)
        h = dmath.sqrt(a / ratio)
        valid = (w <= W) & (h <= H)
        score = valid * types.Constant(order)
        best = fn.reductions.max(score)
        first = (score == best) & valid
        anyv = best > 0
        wc = anyv * fn.reductions.sum(w * first) + (1 - anyv) * dmath.min(W, H * rmax)
        hc = anyv * fn.reductions.sum(h * first) + (1 - anyv) * dmath.min(H, W / rmin)
        y0 = uy[0] * (H - hc)
        x0 = ux[0] * (W - wc)
        f = flip[0]
        roi_start = fn.stack(y0, x0 + f * wc)
        roi_end = fn.stack(y0 + hc, x0 + (1 - f) * wc)
        v = fn.resize(images, size=[size, size], roi_start=roi_start, roi_end=roi_end,
                      interp_type=types.INTERP_LINEAR, antialias=True)
        # Conditionals (per-sample `if`): the 20% of views without jitter, the 80% without
        # grayscale and the 50% without blur skip those ops; fn.hsv is the costliest CPU op
        # here (one hsv pass for the jitter, not two: bench/results/data_timings.md).
        if jitter[0]:
            # torchvision: brightness, clamp, then contrast toward the grayscale mean of the
            # brightened view (that clamp matters for bright images: without it the p99
            # difference to torchvision was 0.25 normalised units, with it ~1 uint8 level)
            v = fn.brightness_contrast(v, brightness=bright[0])
            m = fn.reductions.mean(fn.cast(v, dtype=types.FLOAT), axes=[0, 1])
            gray_mean = 0.299 * m[0] + 0.587 * m[1] + 0.114 * m[2]
            if arithmetic_contrast:
                # on the GPU the mean is a GPU value, and argument inputs (contrast_center)
                # must live on the CPU: blend by arithmetic there
                c = on_dev(contr[0])
                v = fn.cast(dmath.clamp(c * v + (1.0 - c) * gray_mean, 0.0, 255.0),
                            dtype=types.UINT8)          # cast rounds to nearest
            else:   # cheaper on the CPU than the arithmetic (bench/results/data_timings.md)
                v = fn.brightness_contrast(v, contrast=contr[0], contrast_center=gray_mean)
            v = fn.hsv(v, hue=hue[0], saturation=sat[0])
        if gray[0]:
            # its own op, after the jitter's clamp to [0, 255] as in torchvision (folding it
            # into the jitter's saturation left 0.12 p99 differences); saturation 0 = luma
            v = fn.hsv(v, saturation=0.0)
        if blur[0]:
            # window min(torchvision's ~10% kernel, 2*ceil(3 sigma)+1): 3..13 taps at 224 px
            # instead of 23; the dropped taps weigh < 0.3%
            v = fn.gaussian_blur(v, sigma=sigma[0], window_size=window[0])
        v = fn.crop_mirror_normalize(
            v, dtype=out_dtype, output_layout="HWC" if nhwc else "CHW",
            mean=[255.0 * x for x in mean], std=[255.0 * x for x in std])
        outs.append(v)
    return outs
