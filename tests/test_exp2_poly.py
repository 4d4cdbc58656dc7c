"""``ptx.exp2_poly``'s algorithm, emulated in float32 on CPU: the magic-number rounding, the cubic and
the exponent-bit add give 2^x within 1e-3 relative, exactly 0 for -inf, and never a negative or
non-finite value on the kernel's input range (x <= 2^(7 + 1.75) in the exp2 domain)."""

import numpy as np

from cute_kernels import ptx

MAGIC = np.float32(1.5 * 2**23)


def emulate(x: np.ndarray) -> np.ndarray:
    c0, c1, c2, c3 = (np.float32(c) for c in ptx._EXP2_POLY)
    xc = np.maximum(x.astype(np.float32), np.float32(-127.0))
    t = xc + MAGIC
    f = xc - (t - MAGIC)
    p = (f * c3 + c2) * f
    p = (p + c1) * f + c0
    bits = p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    return bits.view(np.float32)


def test_exp2_poly_accuracy_and_edges():
    x = np.concatenate([np.linspace(-126.9, 8.75, 100_001, dtype=np.float32), [-np.inf, -1e30, -127.0]])
    with np.errstate(over="ignore", invalid="ignore"):
        got = emulate(x)
    assert np.isfinite(got).all() and (got >= 0).all()
    assert (got[-3:] == 0).all()
    normal = x[:-3] > -120
    want = np.exp2(x[:-3][normal].astype(np.float64))
    assert (np.abs(got[:-3][normal] - want) / want).max() < 1e-3
