"""evaluation.drift: PSNR and SSIM against hand-computed values and their defining properties."""
import math

import numpy as np
import pytest
import torch

from core.errors import InputError
from evaluation.drift import compare, psnr, ssim


def _img(seed=0, shape=(2, 48, 40, 3)):
    return np.random.RandomState(seed).randint(0, 256, size=shape, dtype=np.uint8)


def test_identical_images_are_infinitely_close():
    a = _img()
    assert psnr(a, a.copy()) == math.inf
    assert ssim(a, a.copy()) == pytest.approx(1.0, abs=1e-12)
    c = compare(a, a.copy())
    assert c["max_abs"] == 0 and c["finite"] and c["data_range"] == 255.0


def test_psnr_of_a_known_error():
    a = np.full((1, 16, 16, 3), 100, np.uint8)
    b = a.copy()
    b[..., 0] += 3                   # one channel off by 3: mse = 9 / 3 = 3
    expected = 10 * math.log10(255 ** 2 / 3)
    assert psnr(a, b) == pytest.approx(expected, rel=1e-12)
    # floats in [0, 1] default to a data range of 1
    assert psnr(a / 255.0, b / 255.0) == pytest.approx(expected, rel=1e-9)
    # [-1, 1] images: the caller states the range
    assert psnr(a / 127.5 - 1, b / 127.5 - 1, data_range=2.0) == pytest.approx(expected, rel=1e-9)


def test_ssim_orders_degradations_and_is_symmetric():
    a = _img(1).astype(np.float64)
    rs = np.random.RandomState(2)
    light = np.clip(a + rs.normal(0, 4, a.shape), 0, 255)
    heavy = np.clip(a + rs.normal(0, 40, a.shape), 0, 255)
    s_light, s_heavy = ssim(a, light, data_range=255), ssim(a, heavy, data_range=255)
    assert 1 > s_light > s_heavy > 0
    assert ssim(light, a, data_range=255) == pytest.approx(s_light, rel=1e-12)
    # a pure brightness shift keeps structure: SSIM stays high while PSNR drops
    shifted = np.clip(a + 10, 0, 255)
    assert ssim(a, shifted, data_range=255) > s_heavy


def test_layouts_and_tensor_inputs_agree():
    a, b = _img(3), _img(4)
    nhwc = compare(a, b)
    nchw = compare(a.transpose(0, 3, 1, 2), b.transpose(0, 3, 1, 2), layout="NCHW")
    tens = compare(torch.from_numpy(a), torch.from_numpy(b), layout="NHWC")
    for k in ("psnr_db", "ssim", "mean_abs"):
        assert nhwc[k] == pytest.approx(nchw[k], rel=1e-12) == tens[k]
    single = compare(a[0], b[0])
    assert single["psnr_db"] == pytest.approx(psnr(a[:1], b[:1]), rel=1e-12)


def test_non_finite_candidates_report_nan_not_a_number_that_looks_fine():
    a = np.zeros((1, 3, 16, 16), np.float32)
    b = a.copy()
    b[0, 0, 3, 3] = np.nan
    c = compare(a, b, layout="NCHW")
    assert math.isnan(c["psnr_db"]) and math.isnan(c["ssim"]) and c["finite"] is False


def test_bad_inputs_raise_input_errors():
    with pytest.raises(InputError, match="differ in shape"):
        psnr(_img(shape=(1, 8, 8, 3)), _img(shape=(1, 8, 9, 3)))
    with pytest.raises(InputError, match="uint8 or floating"):
        psnr(np.zeros((4, 4), np.int32), np.zeros((4, 4), np.int32))
    with pytest.raises(InputError, match="layout"):
        psnr(_img(), _img(), layout="HWCN")
    with pytest.raises(InputError, match="data_range"):
        psnr(_img(), _img(), data_range=0)


def test_ssim_of_flat_images_is_the_luminance_term():
    # no variance: the contrast/structure term is c2/c2 = 1, SSIM = (2 μa μb + c1) / (μa² + μb² + c1)
    a = np.full((1, 20, 20, 3), 100, np.uint8)
    b = np.full((1, 20, 20, 3), 110, np.uint8)
    c1 = (0.01 * 255) ** 2
    assert ssim(a, b) == pytest.approx((2 * 100 * 110 + c1) / (100 ** 2 + 110 ** 2 + c1), rel=1e-12)


def test_difference_map_is_black_where_images_agree_and_bright_where_they_differ():
    from evaluation.drift import difference_map

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, size=(32, 48, 3), dtype=np.uint8)
    same, gain = difference_map(a, a.copy())
    assert same.shape == (32, 48, 3) and same.dtype == np.uint8
    assert (same == same[0, 0]).all() and same[0, 0].sum() < 10 and gain == 1.0   # all black, no gain
    b = a.copy()
    b[10:20, 5:15] = 255 - b[10:20, 5:15]                                         # one changed block
    heat, gain = difference_map(a, b)
    inside, outside = heat[10:20, 5:15].astype(int).sum(-1), heat[:8].astype(int).sum(-1)
    assert inside.mean() > 300 and outside.max() < 10
    assert gain >= 1.0


def test_difference_map_amplifies_small_drift_and_reports_the_gain():
    from evaluation.drift import difference_map

    a = np.full((16, 16, 3), 0.5, dtype=np.float32)
    b = a.copy()
    b[4:8, 4:8] += 0.002                                        # invisible without amplification
    heat, gain = difference_map(a, b)
    assert 400 < gain <= 1000                                   # 0.002 of the range -> about 500x
    assert heat[4:8, 4:8].astype(int).sum(-1).min() > 500 and heat[12:, 12:].astype(int).sum(-1).max() < 10
    fixed, g = difference_map(a, b, gain=1.0)
    assert g == 1.0 and fixed.astype(int).sum(-1).max() < 40    # unamplified: nearly black
    with pytest.raises(InputError, match="gain"):
        difference_map(a, b, gain=0)
