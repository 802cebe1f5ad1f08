"""The recipe's parameters, crop windows and batched ops against torchvision's definitions; the
evaluation's centre crop (pil_center_crop) against its definition, with no huge intermediate
image for a very elongated one."""
import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image

from nac_fast.data import augment as A
from nac_fast.data.augment import pil_center_crop, to_uint8_chw
from nac_fast.data.order import ShardedOrder, uniform

from _images import random_image as _img


def test_uniforms_are_counter_based():
    a = uniform(0, 1, np.array([5, 9, 5]), stream=1, n=4)
    assert a.shape == (3, 4) and np.array_equal(a[0], a[2]) and not np.array_equal(a[0], a[1])
    assert not np.array_equal(a, uniform(0, 1, np.array([5, 9, 5]), stream=2, n=4))
    big = uniform(7, 0, np.arange(20000), stream=1, n=2)
    assert 0 <= big.min() and big.max() < 1 and abs(big.mean() - 0.5) < 0.01


def test_view_params_follow_the_recipe():
    r = A.make_recipe("imagenet", 224)
    p = A.view_params(r, 0, 0, np.arange(20000), view=0)
    jit = p["brightness"] != 1
    assert abs(jit.mean() - 0.8) < 0.02 and abs(p["flip"].mean() - 0.5) < 0.02
    assert abs(p["gray"].mean() - 0.2) < 0.02 and abs((p["sigma"] > 0).mean() - 0.5) < 0.02
    for k, s in (("brightness", 0.4), ("contrast", 0.4), ("saturation", 0.4)):
        assert p[k].min() >= 1 - s and p[k].max() <= 1 + s
    assert np.abs(p["hue"]).max() <= 0.1
    assert p["sigma"][p["sigma"] > 0].min() >= 0.1 and p["sigma"].max() <= 2.0
    q = A.view_params(r, 0, 0, np.arange(20000), view=1)
    assert not np.array_equal(p["area"], q["area"])          # the views are independent
    assert A.make_recipe("auto", 32).blur_p == 0 and A.make_recipe("auto", 224).blur_p == 0.5


def test_crop_windows_match_torchvision_statistics():
    """Windows lie inside the image, area/aspect follow RandomResizedCrop's distribution."""
    r = A.make_recipe("small", 224)
    H, W = 300, 400
    p = A.view_params(r, 1, 0, np.arange(20000), view=0)
    win = A.crop_windows(p, H, W, r.ratio).astype(np.float64)
    x0, y0, w, h = win.T
    assert (x0 >= 0).all() and (y0 >= 0).all()
    assert (x0 + w <= W + 1e-3).all() and (y0 + h <= H + 1e-3).all()
    frac, asp = w * h / (H * W), w / h
    assert frac.min() >= 0.08 - 1e-4 and asp.min() >= 0.75 - 1e-4 and asp.max() <= 4 / 3 + 1e-4
    torch.manual_seed(0)
    img = torch.zeros(3, H, W)
    tv = np.array([torchvision_params(img) for _ in range(20000)], dtype=np.float64)
    tv_frac = tv[:, 2] * tv[:, 3] / (H * W)
    assert abs(np.median(frac) - np.median(tv_frac)) < 0.02
    assert abs(frac.mean() - tv_frac.mean()) < 0.01


def torchvision_params(img):
    from torchvision.transforms import RandomResizedCrop
    i, j, h, w = RandomResizedCrop.get_params(img, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
    return j, i, w, h


def _params(B, **kw):
    base = dict(brightness=np.ones(B), contrast=np.ones(B), saturation=np.ones(B),
                hue=np.zeros(B), gray=np.zeros(B, bool), sigma=np.zeros(B))
    base.update(kw)
    return {k: (v if v.dtype == bool else v.astype(np.float32)) for k, v in base.items()}


@pytest.mark.parametrize("op", ["brightness", "contrast", "saturation", "hue", "gray"])
def test_colour_ops_equal_torchvision(op):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 3, 16, 16, generator=g)
    vals = {"brightness": [0.6, 1.4, 1.0, 0.8], "contrast": [0.6, 1.4, 1.0, 1.2],
            "saturation": [0.6, 1.4, 0.0, 1.1], "hue": [-0.1, 0.1, 0.05, 0.0]}
    if op == "gray":
        p = _params(4, gray=np.array([True, False, True, False]))
        ref = torch.stack([TF.rgb_to_grayscale(x[i], 3) if p["gray"][i] else x[i] for i in range(4)])
    else:
        p = _params(4, **{op: np.array(vals[op])})
        fn = {"brightness": TF.adjust_brightness, "contrast": TF.adjust_contrast,
              "saturation": TF.adjust_saturation, "hue": TF.adjust_hue}[op]
        ref = torch.stack([fn(x[i], float(vals[op][i])) for i in range(4)])
    out = A.colour_blur(x.clone(), p, A.make_recipe("small", 16))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_blur_equals_torchvision():
    x = torch.rand(3, 3, 40, 40)
    sig = np.array([0.1, 1.0, 2.0], dtype=np.float32)
    out = A.gaussian_blur(x, sig, 5)
    ref = torch.stack([TF.gaussian_blur(x[i], [5, 5], [float(s), float(s)]) for i, s in enumerate(sig)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_resized_crop_matches_torchvision_inside_the_window():
    """grid_sample crop+resize = torchvision resized_crop (bilinear) away from the window border
    (the border differs only because grid_sample sees the pixels outside the window)."""
    x = torch.rand(1, 3, 32, 32)
    win = np.array([[4, 6, 16, 12]], dtype=np.float32)      # x0, y0, w, h
    out = A.resized_crop_flip(x, win, np.array([False]), 32)
    ref = TF.resized_crop(x[0], 6, 4, 12, 16, [32, 32], antialias=False)
    torch.testing.assert_close(out[0, :, 3:-3, 3:-3], ref[:, 3:-3, 3:-3], atol=1e-5, rtol=0)
    outf = A.resized_crop_flip(x, win, np.array([True]), 32)
    torch.testing.assert_close(outf[0].flip(-1), out[0], atol=1e-5, rtol=0)


def test_sharded_order_arguments():
    with pytest.raises(ValueError, match="world_size"):
        ShardedOrder(100, 10, 0, 0, 0)
    with pytest.raises(TypeError, match="seed"):
        ShardedOrder(100, 10, 0, 1, 0.5)
    o = ShardedOrder(1000, 10, 1, 4, 0)
    assert o.num_batches == 25 and o.rank_indices(0).shape == (25, 10)
    assert o.rank_indices(0, start_batch=25).shape == (0, 10)


def test_center_crop_of_a_very_elongated_image_makes_no_huge_intermediate(monkeypatch):
    """A 2 x 4000 strip was resized whole to 256 x 512000 pixels before the crop (a 2 x 60000
    one took 8.7 GB and 42 s); the crop is now resized from the source in one step."""
    real = Image.Image.resize
    made = []

    def resize(self, size, *a, **kw):
        made.append(size[0] * size[1])
        if size[0] * size[1] > 4 * 224 * 224:
            raise AssertionError(f"an intermediate image of {size} pixels")
        return real(self, size, *a, **kw)

    monkeypatch.setattr(Image.Image, "resize", resize)
    x = pil_center_crop(Image.new("RGB", (2, 4000), (10, 20, 30)), 224)
    assert x.shape == (3, 224, 224) and x.dtype == torch.uint8
    assert (x[:, 100, 100].tolist() == [10, 20, 30]) and max(made) == 224 * 224
    monkeypatch.setattr(Image.Image, "resize", real)
    # the same view as resizing the short side to size / 0.875 and cropping the centre
    # (an ordinary image exactly; one elongated past 16 crops, from the source, within a level)
    for w, h, size, tol in ((90, 60, 48, 0), (61, 97, 32, 0), (300, 41, 24, 0),
                            (700, 20, 24, 1), (13, 900, 32, 1)):
        im = _img(w, h)
        short = round(size / 0.875)
        s = short / min(w, h)
        W, H = max(size, round(w * s)), max(size, round(h * s))
        big = im.resize((W, H), Image.BILINEAR)
        left, top = (W - size) // 2, (H - size) // 2
        want = to_uint8_chw(big.crop((left, top, left + size, top + size))).int()
        assert (pil_center_crop(im, size).int() - want).abs().max() <= tol, (w, h, size)
