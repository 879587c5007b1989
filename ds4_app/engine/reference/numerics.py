"""Shared numeric primitives of the reference: projections, norms, activations, storage rounding.

Everything is fp32 (design.md §3). Two rules make the incremental and the whole-prompt paths of
the reference agree bit for bit, which is what lets tests compare them at 1e-6 even though KV rows
are rounded to f16 (and FP8/FP4 under QAT), where one differing ulp upstream would flip a rounding:

* every function here is *row-invariant*: the value computed for one token does not depend on how
  many other tokens are in the batch (projections call one matrix-vector product per row; sums run
  over a contiguous last axis of fixed length, or sequentially in a fixed order);
* sums whose length differs between the two paths (attention over keys) are sequential, so masked
  entries (exact zeros) leave them unchanged.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def linear(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = W·x over the last axis of ``x`` (W is [out, in], numpy order), fp32, row-invariant.

    One matrix-vector product per row (a stacked matmul), so a row's result is the same bits
    whether it is computed alone (incremental decode) or among many (whole prompt).
    """
    x = np.ascontiguousarray(x, dtype=F32)
    lead = x.shape[:-1]
    y = np.matmul(w, x.reshape(-1, x.shape[-1], 1))[..., 0]
    return y.reshape(*lead, w.shape[0])


def grouped_linear(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per-group y_g = W[g]·x_g: ``w`` [G, out, in], ``x`` [..., G, in] -> [..., G, out]."""
    x = np.ascontiguousarray(x, dtype=F32)
    lead = x.shape[:-2]
    g, n_in = x.shape[-2:]
    y = np.matmul(w, x.reshape(-1, g, n_in, 1))[..., 0]
    return y.reshape(*lead, g, w.shape[1])


def seq_sum(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Sum along ``axis`` strictly left to right (a fixed order, independent of batch shape)."""
    x = np.moveaxis(np.asarray(x, dtype=F32), axis, 0)
    acc = x[0].copy()
    for i in range(1, x.shape[0]):
        acc = acc + x[i]
    return acc


def rms_norm(x: np.ndarray, weight: np.ndarray | None = None, eps: float = 1e-6) -> np.ndarray:
    """x · rsqrt(mean(x²) + eps) over the last axis, times ``weight`` when given (spec §2)."""
    x = np.ascontiguousarray(x, dtype=F32)
    ms = np.sum(x * x, axis=-1, keepdims=True) / F32(x.shape[-1])
    y = x * (F32(1.0) / np.sqrt(ms + F32(eps)))
    if weight is not None:
        y = y * weight
    return y


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(−x)) in fp32 (exp overflow to inf gives exactly 0)."""
    with np.errstate(over="ignore"):
        return F32(1.0) / (F32(1.0) + np.exp(-np.asarray(x, dtype=F32)))


def silu(x: np.ndarray) -> np.ndarray:
    """x · σ(x), written x / (1 + exp(−x))."""
    x = np.asarray(x, dtype=F32)
    with np.errstate(over="ignore"):
        return x / (F32(1.0) + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), stable: x itself above 20 (as DS4 does)."""
    x = np.asarray(x, dtype=F32)
    return np.where(x > F32(20.0), x, np.log1p(np.exp(np.minimum(x, F32(20.0)))))


def round_f16(x: np.ndarray) -> np.ndarray:
    """Round to float16 (nearest, ties to even) and back: how raw, compressed and indexer rows are stored."""
    return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


# --- spec §7: quantization round trips -------------------------------------------------------

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0


def _pow2_ceil(r: np.ndarray) -> np.ndarray:
    """2^⌈log2 r⌉ for positive fp32 r, exactly (no log2 rounding: frexp decides)."""
    m, e = np.frexp(r)
    e = np.where(m == F32(0.5), e - 1, e)
    return np.ldexp(F32(1.0), e).astype(F32)


def _round_minifloat(y: np.ndarray, mant_bits: int, min_exp: int) -> np.ndarray:
    """Round fp32 ``y`` (already inside the format's range) to the nearest value of a minifloat
    with ``mant_bits`` mantissa bits and smallest normal exponent ``min_exp``, ties to the even
    mantissa (= even multiple of the local spacing, which np.rint gives)."""
    _, e = np.frexp(y)  # |y| = m·2^e, m in [0.5, 1): floor(log2|y|) = e − 1
    sp = np.ldexp(F32(1.0), np.maximum(e - 1 - mant_bits, min_exp - mant_bits)).astype(F32)
    return (np.rint(y / sp) * sp).astype(F32)


def round_e4m3(y: np.ndarray) -> np.ndarray:
    """Nearest float8_e4m3fn value (finite-only, max 448), ties to even; input clamped to ±448."""
    y = np.clip(np.asarray(y, dtype=F32), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return _round_minifloat(y, 3, -6)


def round_e2m1(y: np.ndarray) -> np.ndarray:
    """Nearest FP4 e2m1 value {0, .5, 1, 1.5, 2, 3, 4, 6} (signed), ties to the even code."""
    y = np.clip(np.asarray(y, dtype=F32), -FP4_E2M1_MAX, FP4_E2M1_MAX)
    return _round_minifloat(y, 1, 0)


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    if x.shape[-1] % block:
        raise ValueError(f"last axis {x.shape[-1]} is not a multiple of the block size {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_e4m3_roundtrip(x: np.ndarray, block: int = 64) -> np.ndarray:
    """Spec §7 item 1 on the last axis, per block of ``block`` values: s = 2^⌈log2(amax/448)⌉ with
    amax = max(max|x|, 1e-4); x ← e4m3(clamp(x/s, ±448))·s."""
    xb = _blocks(x, block)
    amax = np.maximum(np.max(np.abs(xb), axis=-1, keepdims=True), F32(1e-4))
    s = _pow2_ceil(amax / F32(FP8_E4M3_MAX))
    return (round_e4m3(xb / s) * s).reshape(np.shape(x)).astype(F32)


def fp4_roundtrip(x: np.ndarray, block: int = 32) -> np.ndarray:
    """Spec §7 item 2 on the last axis, per block of ``block`` values: s = 2^⌈log2(amax/6)⌉ with
    amax = max(max|x|, 6·2⁻¹²⁶); x ← e2m1(clamp(x/s, ±6))·s."""
    xb = _blocks(x, block)
    amax = np.maximum(np.max(np.abs(xb), axis=-1, keepdims=True), F32(6.0 * 2.0 ** -126))
    s = _pow2_ceil(amax / F32(FP4_E2M1_MAX))
    return (round_e2m1(xb / s) * s).reshape(np.shape(x)).astype(F32)


def hadamard(x: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh–Hadamard transform of the last axis (power of two n), natural (Sylvester)
    order: y = H·x with H[i,j] = (−1)^popcount(i AND j)/√n. Butterflies, then one scale."""
    x = np.asarray(x, dtype=F32)
    n = x.shape[-1]
    if n & (n - 1) or n == 0:
        raise ValueError(f"hadamard needs a power-of-two length, got {n}")
    lead = x.shape[:-1]
    y = x
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = np.stack([a + b, a - b], axis=-2)
        h *= 2
    return y.reshape(*lead, n) * F32(1.0 / np.sqrt(n))

