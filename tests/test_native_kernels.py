"""CPU kernels of the native module: dequantizers against gguf.quants, matmul against numpy,
batch-width and thread-count exactness, SIMD path choice and thread-pool chunking.

The scalar path is always tested; the AVX2 path wherever the CPU has it. Needs the built module
(`pip install --no-build-isolation -e . -C editable.mode=inplace`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing

# ggml type id -> (elements per block, bytes per block)
GEOMETRY = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 12: (256, 144), 39: (32, 17)}
NAMES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 12: "Q4_K", 39: "MXFP4"}
TYPES = list(GEOMETRY)
PATHS = ["scalar"] + (["avx2"] if T.path_supported("avx2") else [])


def _finite_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random half-precision bit patterns: every sign, zero, subnormals, up to 65504; no inf/NaN."""
    h = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    h = np.where((h & 0x7C00) == 0x7C00, h & 0xBFFF, h).astype(np.uint16)
    h[: min(n, 4)] = [0x0000, 0x8000, 0x0001, 0x7BFF][: min(n, 4)]  # +0, -0, tiny subnormal, max
    return h


def random_raw(t: int, n: int, rng: np.random.Generator, *, tame: bool = False) -> np.ndarray:
    """n elements of random ggml data of type t as uint8.

    tame=False covers the whole legal range (the dequantizer test); tame=True keeps values
    moderate so products can be compared with numpy to a tight tolerance (the matmul tests).
    """
    be, bb = GEOMETRY[t]
    nb = n // be
    if t == 0:
        x = rng.standard_normal(n).astype(np.float32)
        if not tame:
            x[:4] = [0.0, -0.0, 3.0e38, 1.0e-40]
        return x.view(np.uint8)
    if t == 1:
        if tame:
            return (rng.standard_normal(n) * 0.5).astype(np.float16).view(np.uint8)
        h = rng.integers(0, 1 << 16, n, dtype=np.uint16)  # includes +-inf, excludes NaN below
        h = np.where(((h & 0x7C00) == 0x7C00) & ((h & 0x03FF) != 0), h & 0xFC00, h).astype(np.uint16)
        return h.view(np.uint8)
    if t == 30:
        if tame:
            return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        b = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        b = np.where(((b & 0x7F80) == 0x7F80) & ((b & 0x007F) != 0), b & 0xFF80, b).astype(np.uint16)
        return b.view(np.uint8)
    raw = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
    if t == 8:
        d = (rng.uniform(-0.02, 0.02, nb).astype(np.float16).view(np.uint16) if tame else _finite_halves(rng, nb))
        raw[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    elif t == 12:
        if tame:
            dd = np.stack([rng.uniform(0.001, 0.02, nb), rng.uniform(0.0, 0.02, nb)], axis=1).astype(np.float16)
        else:
            dd = _finite_halves(rng, 2 * nb).view(np.float16).reshape(nb, 2)
        raw[:, 0:4] = dd.view(np.uint8).reshape(nb, 4)
    elif t == 39:
        if tame:
            raw[:, 0] = rng.integers(118, 130, nb)
        else:
            raw[: min(nb, 4), 0] = [0, 1, 2, 255][: min(nb, 4)]  # subnormal scales and the largest
    return raw.reshape(-1)


def gguf_ref(t: int, raw: np.ndarray, n: int) -> np.ndarray:
    be, bb = GEOMETRY[t]
    data = raw[: n // be * bb]
    if be > 1:
        data = data.reshape(-1, bb)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(gguf_dequantize(data, Q(t)), dtype=np.float32).reshape(-1)


# --- dequantizers ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_dequantize_bit_identical_to_gguf(t: int, path: str) -> None:
    rng = np.random.default_rng(1000 + t)
    be, _ = GEOMETRY[t]
    n = be * (97 if be > 1 else 4099)  # odd counts: SIMD bodies and scalar tails both run
    raw = random_raw(t, n, rng)
    ref = gguf_ref(t, raw, n)
    got = T.dequantize(t, raw, n, path)
    assert not np.isnan(ref).any()
    mismatch = np.nonzero(got.view(np.uint32) != ref.view(np.uint32))[0]
    assert mismatch.size == 0, (
        f"{NAMES[t]}/{path}: {mismatch.size} elements differ, first at {mismatch[0]}: "
        f"{got[mismatch[0]]!r} vs gguf {ref[mismatch[0]]!r}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", [1, 30], ids=["F16", "BF16"])
def test_every_16_bit_pattern_converts_as_numpy_does(t: int, path: str) -> None:
    # All 65536 patterns: zeros, subnormals, normals, infinities. NaNs must stay NaN (F16C
    # quiets signalling NaNs where numpy keeps the payload; weights never hold NaNs).
    h = np.arange(1 << 16, dtype=np.uint16)
    ref = gguf_ref(t, h.view(np.uint8), h.size)
    got = T.dequantize(t, h.view(np.uint8), h.size, path)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


def test_dequantize_rejects_partial_blocks_and_non_weight_types() -> None:
    raw = np.zeros(34 * 2, dtype=np.uint8)
    with pytest.raises(ValueError, match="whole number"):
        T.dequantize(8, raw, 40)
    with pytest.raises(ValueError, match="not a weight type"):
        T.dequantize(26, raw, 4)
    with pytest.raises(ValueError, match="shorter"):
        T.dequantize(8, raw, 96)


# --- matmul ------------------------------------------------------------------------------------


def _shape(t: int) -> tuple[int, int]:
    # Row widths that are not a multiple of the 256-element decode group (and, for the float
    # types, not of the 8-wide vectors either) exercise every tail.
    return {1: 621, 32: 608, 256: 768}[GEOMETRY[t][0]], 29


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_matmul_matches_numpy(t: int, path: str) -> None:
    rng = np.random.default_rng(2000 + t)
    ne0, ne1 = _shape(t)
    raw = random_raw(t, ne0 * ne1, rng, tame=True)
    w = gguf_ref(t, raw, ne0 * ne1).reshape(ne1, ne0).astype(np.float64)
    x = rng.standard_normal((5, ne0)).astype(np.float32)
    y = T.matmul(t, raw, ne0, ne1, x, 2, path)
    ref = x.astype(np.float64) @ w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T  # the dot products' condition
    assert y.shape == (5, ne1) and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= 1e-5 * scale), f"worst {np.max(np.abs(y - ref) / scale):.3g}"


WIDTHS = list(range(1, 17)) + [17, 33]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_matmul_columns_bit_identical_to_single_column(t: int, path: str) -> None:
    rng = np.random.default_rng(3000 + t)
    ne0, ne1 = _shape(t)
    raw = random_raw(t, ne0 * ne1, rng, tame=True)
    x = rng.standard_normal((max(WIDTHS), ne0)).astype(np.float32)
    single = np.stack([T.matmul(t, raw, ne0, ne1, x[c : c + 1], 1, path)[0] for c in range(max(WIDTHS))])
    for width in WIDTHS:
        # Different column subsets land each column on different positions of the 3/2/1 tiles.
        start = (width * 7) % (max(WIDTHS) - width + 1)
        y = T.matmul(t, raw, ne0, ne1, x[start : start + width], 1, path)
        assert np.array_equal(y.view(np.uint32), single[start : start + width].view(np.uint32)), (
            f"{NAMES[t]}/{path}: width {width} differs from single-column results")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_matmul_identical_across_thread_counts(t: int, path: str) -> None:
    rng = np.random.default_rng(4000 + t)
    for trial in range(3):
        be, _ = GEOMETRY[t]
        ne0 = int(rng.integers(1, 5)) * 256 + (int(rng.integers(0, 8)) * 32 if be != 256 else 0)
        ne0 += int(rng.integers(1, 31)) if be == 1 else 0
        ne1 = int(rng.integers(1, 80))
        ncols = int(rng.integers(1, 18))
        raw = random_raw(t, ne0 * ne1, rng, tame=True)
        x = rng.standard_normal((ncols, ne0)).astype(np.float32)
        y1 = T.matmul(t, raw, ne0, ne1, x, 1, path)
        for threads in (2, 3):
            y = T.matmul(t, raw, ne0, ne1, x, threads, path)
            assert np.array_equal(y.view(np.uint32), y1.view(np.uint32)), (
                f"{NAMES[t]}/{path} trial {trial}: {threads} threads differ from 1")


# --- Q4_K, block-scaled (the avx2 path; ext/cpu/matmul.cpp "Q4_K, block-scaled") ---------------

U = 2.0 ** -24  # fp32 unit roundoff


def _q4k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dl = d*sc and ml = dmin*m of every sub-block of Q4_K blocks [nb, 144], as fp32 [nb, 8]."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 4:16].astype(np.int32)
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 15) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    return d * sc.astype(np.float32), dmin * m.astype(np.float32)


def _q4k_nibbles(blocks: np.ndarray) -> np.ndarray:
    """The 4-bit quants of Q4_K blocks in element order, [nb, 256] (sub-block 2c: low nibbles of
    bytes 32c..32c+31, 2c+1: their high nibbles)."""
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 256).astype(np.int32)


def _q4k_cancelling(rng: np.random.Generator, nb: int, frac: float) -> np.ndarray:
    """Tame Q4_K blocks in which a fraction frac of the sub-blocks has dmin*m == d*sc*q0 exactly and
    quants q0 - 1 .. q0 + 1: weights of 0 or +-d*sc built from terms up to 15*d*sc apart."""
    blocks = random_raw(12, nb * 256, rng, tame=True).reshape(nb, 144)
    dd = blocks[:, 0:4].copy().view(np.float16)
    ratio = rng.choice([1.0, 0.5, 0.25], nb)  # dmin/d, a power of two: the products are exact
    dd[:, 1] = dd[:, 0] * ratio.astype(np.float16)
    blocks[:, 0:4] = dd.view(np.uint8)
    pick = rng.random((nb, 8)) < frac
    q0 = rng.integers(1, 16, (nb, 8))
    cap = np.floor(63 * ratio[:, None] / q0)  # the largest sc whose m = sc*q0/ratio fits 6 bits
    sc = np.where(pick, 1 + (rng.random((nb, 8)) * cap).astype(np.int64), rng.integers(1, 64, (nb, 8)))
    m = np.where(pick, np.round(sc * q0 / ratio[:, None]).astype(np.int64), rng.integers(0, 64, (nb, 8)))
    packed = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    blocks[:, 4:16] = packed.astype(np.uint8)
    near = np.clip(q0[:, :, None] + rng.integers(-1, 2, (nb, 8, 32)), 0, 15)
    nib = np.where(pick[:, :, None], near, _q4k_nibbles(blocks).reshape(nb, 8, 32)).reshape(nb, 4, 2, 32)
    blocks[:, 16:] = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(nb, 128).astype(np.uint8)
    return blocks.reshape(-1)


def _fma32(a, b, c) -> np.ndarray:
    """fp32 fma(a, b, c), one rounding: a*b is exact in float64 and TwoSum gives the error of s =
    a*b + c, which decides the rounding only where s falls on a tie between two floats."""
    a64, b64, c64 = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a64 * b64
    s = p + c64
    bv = s - p
    e = (p - (s - bv)) + (c64 - bv)  # s + e == a*b + c exactly
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, np.inf, -np.inf).astype(np.float32))
    tie = (s != r64) & (2 * s == r64 + other.astype(np.float64))
    return np.where(tie & (e * (s - r64) > 0), other, r)


def _reduce8(a: np.ndarray) -> np.ndarray:
    u = a[..., :4] + a[..., 4:]
    return (u[..., 0] + u[..., 2]) + (u[..., 1] + u[..., 3])


def _q4k_block_scaled(raw: np.ndarray, ne0: int, ne1: int, x: np.ndarray) -> np.ndarray:
    """matmul.cpp's block-scaled Q4_K product, operation for operation in fp32: [ncols, ne1]."""
    blocks = raw.reshape(-1, 144)
    J = ne0 // 32
    dl, ml = (v.reshape(ne1, J) for v in _q4k_scales(blocks))
    q = _q4k_nibbles(blocks).astype(np.float32).reshape(1, ne1, J, 32)
    xs = x.reshape(-1, 1, J, 32)
    p = _fma32(q[..., 16:], xs[..., 16:], q[..., :16] * xs[..., :16])  # [ncols, ne1, J, 16]
    acc = np.zeros(p.shape[:2] + (16,), np.float32)
    for j in range(J):
        acc = _fma32(p[:, :, j], dl[None, :, j, None], acc)
    s = xs[:, 0, :, :16] + xs[:, 0, :, 16:]
    t = s[..., :8] + s[..., 8:]
    sx = ((t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])) + ((t[..., 4] + t[..., 5]) + (t[..., 6] + t[..., 7]))
    macc = np.zeros(p.shape[:2] + (8,), np.float32)
    for b in range(J // 8):
        macc = _fma32(ml[None, :, 8 * b : 8 * b + 8], sx[:, None, 8 * b : 8 * b + 8], macc)
    return _reduce8(acc[..., :8] + acc[..., 8:]) - _reduce8(macc)


@pytest.mark.skipif("avx2" not in PATHS, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_q4k_avx2_path_is_the_block_scaled_arithmetic_bit_for_bit(frac: float) -> None:
    # The 512-bit kernels where the CPU has them (the twin test ties the 256-bit ones to these),
    # 8 columns: tiles of 8 (AVX-512) or 3 + 3 + 2.
    rng = np.random.default_rng(8000 + int(10 * frac))
    ne0, ne1 = 768, 29
    raw = _q4k_cancelling(rng, ne0 * ne1 // 256, frac)
    x = rng.standard_normal((8, ne0)).astype(np.float32)
    y = T.matmul(12, raw, ne0, ne1, x, 1, "avx2")
    want = _q4k_block_scaled(raw, ne0, ne1, x)
    diff = np.argwhere(y.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"{len(diff)} results differ, first [col, row] {diff[0]}: {y[tuple(diff[0])]!r} vs {want[tuple(diff[0])]!r}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_q4k_matmul_error_against_float64(frac: float, path: str) -> None:
    """|y - y_exact| <= 4u (A + M) with A = sum |dl q x| and M = sum |ml x| over the row.

    The block-scaled sum adds the terms dl*q*x and ml*x, never w*x = (dl*q - ml)*x, so A + M is
    its condition number: where dl*q and ml cancel (w near 0; frac of the sub-blocks here, up to
    all of them), the error does not shrink with sum |w x| as it does for decoded weights. The
    worst case is (J + 6)u A + (B + 8)u M, J = ne0/32 and B = ne0/256 (30u A here: each of a lane's
    J FMAs rounds by u of its partial sum); on random data the roundings partly cancel and the
    worst observed is under 0.8u (A + M) on both paths. 4u leaves 5x room and fails for anything
    that loses 3 bits: a weight, scale or sum in fp16 (2^-11), a dropped term, a wrong scale.
    """
    rng = np.random.default_rng(8100 + int(10 * frac))
    ne0, ne1 = 768, 64
    raw = _q4k_cancelling(rng, ne0 * ne1 // 256, frac)
    blocks = raw.reshape(-1, 144)
    dl, ml = (np.repeat(v.reshape(ne1, -1).astype(np.float64), 32, axis=1) for v in _q4k_scales(blocks))
    q = _q4k_nibbles(blocks).reshape(ne1, ne0)
    x = rng.standard_normal((8, ne0)).astype(np.float32)
    ax = np.abs(x).astype(np.float64)
    exact = x.astype(np.float64) @ (dl * q - ml).T
    am = ax @ (dl * q).T + ax @ ml.T
    if frac == 1.0:  # the data does cancel: terms much larger than the weights
        assert np.median(am / (ax @ np.abs(dl * q - ml).T)) > 8
    y = T.matmul(12, raw, ne0, ne1, x, 1, path)
    err = np.abs(y - exact)
    assert np.all(err <= 4 * U * am), f"worst {np.max(err / am) / U:.2f}u"


def test_matmul_rejects_bad_shapes() -> None:
    raw = np.zeros(34 * 4, dtype=np.uint8)
    with pytest.raises(ValueError):
        T.matmul(8, raw, 48, 2, np.zeros((1, 48), np.float32))  # not whole Q8_0 blocks
    with pytest.raises(ValueError):
        T.matmul(8, raw, 64, 2, np.zeros((1, 32), np.float32))  # X width mismatch
    with pytest.raises(ValueError):
        T.matmul(8, raw, 64, 3, np.zeros((1, 64), np.float32))  # data too short
    with pytest.raises(ValueError):
        T.matmul(8, raw, 64, 2, np.zeros((1, 64), np.float32), 1, "sse9")


# --- SIMD path choice --------------------------------------------------------------------------


def test_simd_path_is_fixed_per_process_and_default_is_the_best_supported() -> None:
    assert native.simd_path() in ("scalar", "avx2")
    if os.environ.get("DS4_SIMD", "auto") in ("auto", ""):
        assert native.simd_path() == ("avx2" if T.path_supported("avx2") else "scalar")


def test_ds4_simd_scalar_forces_the_scalar_path_for_the_whole_process() -> None:
    code = (
        "import numpy as np, ds4_app.engine._native as n\n"
        "T = n._testing\n"
        "rng = np.random.default_rng(5)\n"
        "raw = rng.standard_normal(64 * 300).astype(np.float16).view(np.uint8)\n"
        "x = rng.standard_normal((3, 300)).astype(np.float32)\n"
        "same = np.array_equal(T.matmul(1, raw, 300, 64, x, 2), T.matmul_scalar(1, raw, 300, 64, x, 2))\n"
        "print(n.simd_path(), same)\n"
    )
    env = dict(os.environ, DS4_SIMD="scalar")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["scalar", "True"]


@pytest.mark.skipif("avx2" not in PATHS, reason="no AVX2 on this CPU")
def test_avx2_and_scalar_paths_are_distinct_computations() -> None:
    # FMA rounds once where the scalar path rounds twice: over many rows some result must differ.
    # (If they never differed, the "avx2" path would not be running its own kernel.)
    rng = np.random.default_rng(6)
    ne0, ne1 = 1000, 64
    raw = rng.standard_normal(ne0 * ne1).astype(np.float32).view(np.uint8)
    x = rng.standard_normal((2, ne0)).astype(np.float32)
    assert not np.array_equal(T.matmul(0, raw, ne0, ne1, x, 1, "avx2"), T.matmul_scalar(0, raw, ne0, ne1, x, 1))


def _cpu_has_avx512() -> bool:
    """AVX-512 F/BW/VL/DQ per /proc/cpuinfo: where the avx2 path runs its 512-bit matmul kernels."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags)


_AVX512_CASES = """
import hashlib, sys
import numpy as np
sys.path.insert(0, "tests")
import test_native_kernels as tk
T = tk.T
for t in tk.TYPES:
    for width in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17):
        rng = np.random.default_rng(7000 + 31 * t + width)
        ne0 = {1: 640, 32: 608, 256: 768}[tk.GEOMETRY[t][0]]  # whole 32s: the fused kernels
        ne1 = 37
        raw = tk.random_raw(t, ne0 * ne1, rng, tame=True)
        x = rng.standard_normal((width, ne0)).astype(np.float32)
        for threads in (1, 2):
            y = T.matmul(t, raw, ne0, ne1, x, threads, "avx2")
            print(t, width, threads, hashlib.sha256(y.tobytes()).hexdigest()[:16])
"""


@pytest.mark.skipif("avx2" not in PATHS or not _cpu_has_avx512(), reason="no AVX-512 on this CPU")
def test_avx512_matmul_kernels_are_bit_identical_to_the_256_bit_ones() -> None:
    # The avx2 path runs 512-bit twins of its fused kernels where the CPU has AVX-512 (the same
    # lanes, order and reduction); DS4_AVX512=0 keeps the 256-bit ones. Every type, 1-17 columns
    # (the twins tile up to 8, the 256-bit kernels 3 or 6), 1 and 2 threads: the same bits.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for env in (dict(os.environ, DS4_AVX512="0"), {k: v for k, v in os.environ.items() if k != "DS4_AVX512"}):
        out = subprocess.run([sys.executable, "-c", _AVX512_CASES], env=env, cwd=root, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.splitlines())
    assert len(runs[0]) == len(TYPES) * 11 * 2
    assert runs[0] == runs[1], next(f"{a} != {b}" for a, b in zip(*runs) if a != b)


_AVX512_ENGINE = """
import hashlib, sys
import numpy as np
from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine.plan import StepPlan
from ds4_app.engine.synth import synthesize
import ds4_app.engine._native as native
path = sys.argv[1]
mf = ModelFile.open(path)
tensors = [(t.name, t.ggml_type, t.ne, t.offset) for t in mf.tensors.values()]
h = hashlib.sha256()
rng = np.random.default_rng(0)
for lanes, threads in ((1, 2), (3, 2)):  # 1 lane: heads split between threads; 3: slots in parallel
    eng = native.Engine(mf.config, path, tensors, max_slots=3, max_ctx=256, n_pages=6, max_rows=16,
                        n_threads=threads)
    tables = {s: [2 * s, 2 * s + 1] for s in range(lanes)}
    for t in range(140):
        plan = [(s, int(rng.integers(0, mf.config.n_vocab)), t, True) for s in range(lanes)]
        h.update(eng.step(StepPlan.build(plan, tables, 2)).tobytes())
print(h.hexdigest())
"""


@pytest.mark.skipif("avx2" not in PATHS or not _cpu_has_avx512(), reason="no AVX-512 on this CPU")
def test_avx512_engine_steps_are_bit_identical_to_the_256_bit_ones(tmp_path) -> None:
    # The engine with every AVX-512 twin (matmul, attention) against DS4_AVX512=0: 140 steps of
    # 1 and 3 lanes, past the CSA/HCA emissions and the indexer's choice, logits bit for bit.
    from ds4_app.engine.synth import synthesize

    path = tmp_path / "tiny.gguf"
    synthesize("tiny", path, seed=2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digests = []
    for env in (dict(os.environ, DS4_AVX512="0"), {k: v for k, v in os.environ.items() if k != "DS4_AVX512"}):
        out = subprocess.run([sys.executable, "-c", _AVX512_ENGINE, str(path)], env=env, cwd=root,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        digests.append(out.stdout.strip())
    assert len(digests[0]) == 64 and digests[0] == digests[1]


# --- thread pool -------------------------------------------------------------------------------


@pytest.mark.parametrize("threads,n,grain", [(2, 100, 1), (3, 10, 1), (4, 7, 1), (2, 100, 60), (3, 1, 1),
                                             (2, 5, 100), (4, 1000, 3)])
def test_parallel_for_static_contiguous_chunks(threads: int, n: int, grain: int) -> None:
    chunks = T.pool_chunks(threads, n, grain)
    k = min(threads, -(-n // grain))
    expected = [(i * n // k, (i + 1) * n // k) for i in range(k)]
    assert chunks == [c for c in expected if c[0] < c[1]]


def test_physical_cores_is_positive_and_bounded_by_the_cpu_count() -> None:
    cores = native.physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)


@pytest.mark.parametrize("bad", [0, 5, 9])
def test_parallel_for_rethrows_a_chunk_error_and_the_pool_stays_usable(bad: int) -> None:
    # The C++ exception arrives as RuntimeError (except +) after a second job ran every index.
    with pytest.raises(RuntimeError, match="rethrown after a second job covered 10"):
        T.pool_throw(3, 10, bad)


@pytest.mark.parametrize("k", [1, 7, 8, 16, 17, 64])
def test_indexer_topk_picks_the_best_by_score_then_index(k) -> None:
    """Both ways of ds4::indexer_topk (one pass for k <= 16, nth_element above) pick the k best
    entries by (score descending, index ascending), with many ties, returned ascending."""
    rng = np.random.default_rng(k)
    for n in (k, k + 1, 150, 301):
        for scores in (rng.integers(0, 5, n).astype(np.float32), rng.standard_normal(n).astype(np.float32),
                       np.arange(n, dtype=np.float32), -np.arange(n, dtype=np.float32), np.zeros(n, np.float32)):
            want = np.sort(np.lexsort((np.arange(n), -scores))[:k])
            assert np.array_equal(native._testing.indexer_topk(scores, k), want), (n, k)
