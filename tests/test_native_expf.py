"""exp_exact (ext/cpu/expf_exact.h) and the vectorized swiglu against libm's expf, bit for bit.

The engine's exps must give glibc's expf bits (the engine's outputs are compared by hash), so the
truth here is the C library's ``expf`` itself, called through ctypes, never numpy's exp. The
exhaustive proof over all 2^32 inputs is ext/cpu/tools/expf_exhaustive.cpp; this is its quick
sample: every 4096th bit pattern (with varied low bits), the special inputs and the ranges whose
results are subnormal or overflow.
"""

import ctypes
import ctypes.util

import numpy as np
import pytest

from ds4_app.engine._native import _testing

_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_libm_expf = _libm.expf
_libm_expf.restype = ctypes.c_float
_libm_expf.argtypes = [ctypes.c_float]
_libc = ctypes.CDLL(None)
_libc.gnu_get_libc_version.restype = ctypes.c_char_p
GLIBC = _libc.gnu_get_libc_version().decode()

PATHS = _testing.expf_paths()


def libm_exp(x: np.ndarray) -> np.ndarray:
    """libm's expf of each element (float32 in, float32 out, exact through c_float)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    return np.fromiter(map(_libm_expf, x.tolist()), np.float32, x.shape[0])


def f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def special_inputs() -> np.ndarray:
    """Zeros, infinities, NaNs, the |x| >= 88 branch points with their neighbours, and the
    underflow range where results are subnormal (every 16th pattern there)."""
    hexes = ["0x1.62e42ep6", "-0x1.9fe368p6", "-0x1.9d1d9ep6"]  # overflow, underflow, may-underflow
    edges = np.array([88.0, -88.0, *map(float.fromhex, hexes), -87.33654, -103.27893,
                      1.0, -1.0, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                      np.finfo(np.float32).tiny, -np.finfo(np.float32).tiny], dtype=np.float32)
    around = (edges.view(np.uint32)[:, None].astype(np.int64) + np.arange(-3, 4)).reshape(-1)
    named = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # ±0, ±inf
             0x7FC00000, 0xFFC00000, 0x7FA00001, 0x7F800001, 0xFFFFFFFF,  # quiet, signaling, payloads
             0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF]  # subnormal inputs
    lo, hi = np.float32(-104.5).view(np.uint32), np.float32(-86.5).view(np.uint32)
    subnormal_results = np.arange(hi, lo, 16, dtype=np.int64)  # negative floats: bits grow as x falls
    return f32(np.concatenate([around, named, subnormal_results]).astype(np.uint32))


def dense_inputs() -> np.ndarray:
    """Every 4096th bit pattern of all 2^32, the low 12 bits varied from sample to sample."""
    i = np.arange(1 << 20, dtype=np.uint64)
    low = (i * np.uint64(2654435761)) >> np.uint64(7) & np.uint64(4095)
    return f32((i << np.uint64(12) | low).astype(np.uint32))


@pytest.fixture(scope="module")
def sample() -> tuple[np.ndarray, np.ndarray]:
    x = np.concatenate([dense_inputs(), special_inputs()])
    return x, libm_exp(x)


def assert_same_bits(got: np.ndarray, want: np.ndarray, x: np.ndarray, what: str) -> None:
    """Bitwise equality; a NaN result only has to be a NaN (ctypes quiets signaling inputs)."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN results differ"
    bad = np.flatnonzero(got.view(np.uint32)[~nan] != want.view(np.uint32)[~nan])
    if bad.size:
        xs, gs, ws = x[~nan][bad[:5]], got[~nan][bad[:5]], want[~nan][bad[:5]]
        shown = ", ".join(f"x={a!r} got={g!r} libm={w!r}" for a, g, w in zip(xs.tolist(), gs.tolist(), ws.tolist()))
        pytest.fail(f"{what}: {bad.size} results differ from the reference (glibc {GLIBC}'s expf): {shown}")


@pytest.mark.parametrize("path", PATHS)
def test_expf_matches_libm(sample, path):
    x, want = sample
    assert x.shape[0] > (1 << 20)
    assert_same_bits(_testing.expf(x, path), want, x, f"exp on the {path} path")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16, 17, 31, 33])
def test_expf_tails(path, n):
    # Short arrays: the vector forms' remainders (AVX2: scalar tail; AVX-512: masked lanes).
    x = np.linspace(-110.0, 90.0, n, dtype=np.float32)
    assert_same_bits(_testing.expf(x, path), libm_exp(x), x, f"exp of {n} on the {path} path")


def test_expf_rejects_unknown_path():
    with pytest.raises(ValueError, match="unknown exp path"):
        _testing.expf(np.zeros(4, np.float32), "sse9")


def swiglu_reference(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    """The scalar loop of ext/engine/moe.cpp in float32 with libm's expf: the clamps as
    std::min/std::max evaluate them, then g / (1 + exp(-g)) * u."""
    lim = np.float32(limit)
    if lim > 0:
        g = np.where(lim < g, lim, g)
        u = np.where(u < -lim, -lim, u)
        u = np.where(lim < u, lim, u)
    with np.errstate(all="ignore"):
        return g / (np.float32(1.0) + libm_exp(-g)) * u


def swiglu_inputs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * rng.choice([0.5, 4.0, 40.0], n)).astype(np.float32)
    u = (rng.standard_normal(n) * rng.choice([0.5, 4.0, 40.0], n)).astype(np.float32)
    # Exact clamp limits, signed zeros, infinities and huge values (exp overflows to inf) at fixed spots.
    for k, v in enumerate([10.0, -10.0, 0.0, -0.0, np.inf, -np.inf, 120.0, -120.0, 1e30, -1e30]):
        g[(7 * k) % n] = v
        u[(11 * k + 3) % n] = v
    return g, u


@pytest.mark.parametrize("path", [None, *PATHS])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu_matches_scalar_formula(path, limit):
    for n, seed in [(1037, 0), (5, 1), (16, 2), (23, 3)]:
        g, u = swiglu_inputs(n, seed)
        want = swiglu_reference(g, u, limit)
        got = _testing.swiglu(g, u, limit, path)
        assert_same_bits(got, want, g, f"swiglu n={n} limit={limit} on the {path or 'dispatched'} path")


def test_swiglu_shape_mismatch():
    with pytest.raises(ValueError, match="same number of elements"):
        _testing.swiglu(np.zeros(4, np.float32), np.zeros(5, np.float32), 10.0)
