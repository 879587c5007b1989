"""mHC, manifold-constrained hyper-connections (spec §3): hc_pre, hc_post, hc_head, Sinkhorn.

State X has shape [..., n_hc, d] (stream-major, as the spec flattens it). All fp32.
"""

from __future__ import annotations

import numpy as np

from .numerics import F32, linear, seq_sum, sigmoid


def _row_sums(c: np.ndarray) -> np.ndarray:
    return seq_sum(c, axis=-1)


def _col_sums(c: np.ndarray) -> np.ndarray:
    return seq_sum(c, axis=-2)


def sinkhorn(c0: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """The exact DS4 Sinkhorn sequence on [..., n, n] logits (spec §3.1 step 5).

    Row softmax, + eps, column normalize; then (iters − 1) × (row normalize, column normalize).
    ``iters`` counts the first pass. Normalizations divide by (sum + eps). C[j, k]: row j is the
    source stream, column k the destination (see ``hc_post``).
    """
    c0 = np.asarray(c0, dtype=F32)
    eps = F32(eps)
    e = np.exp(c0 - np.max(c0, axis=-1, keepdims=True))
    c = e / _row_sums(e)[..., :, None] + eps
    c = c / (_col_sums(c)[..., None, :] + eps)
    for _ in range(iters - 1):
        c = c / (_row_sums(c)[..., :, None] + eps)
        c = c / (_col_sums(c)[..., None, :] + eps)
    return c


def _mix(x: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
    """m = rsqrt(mean(x̂²) + eps) · (fn · x̂) with x̂ the flattened streams."""
    n, d = x.shape[-2:]
    flat = np.ascontiguousarray(x, dtype=F32).reshape(*x.shape[:-2], n * d)
    rho = F32(1.0) / np.sqrt(np.sum(flat * flat, axis=-1, keepdims=True) / F32(n * d) + F32(norm_eps))
    return linear(fn, flat) * rho


def _weighted_streams(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Σ_i w_i · X[i], streams added in order 0..n−1."""
    acc = w[..., 0, None] * x[..., 0, :]
    for i in range(1, x.shape[-2]):
        acc = acc + w[..., i, None] * x[..., i, :]
    return acc


def hc_pre(x: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, *,
           norm_eps: float = 1e-6, hc_eps: float = 1e-6, sinkhorn_iters: int = 20,
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spec §3.1. ``x`` [..., n, d]; ``fn`` [(2+n)·n, n·d]; ``scale`` [3]; ``base`` [(2+n)·n].

    Returns (u [..., d], post [..., n], comb [..., n, n]) with pre = σ(·) + hc_eps (not
    normalized), post = 2σ(·), comb = Sinkhorn of the row-major n×n block, u = Σ_i pre_i X[i].
    """
    x = np.asarray(x, dtype=F32)
    n = x.shape[-2]
    m = _mix(x, fn, norm_eps)
    pre = sigmoid(scale[0] * m[..., :n] + base[:n]) + F32(hc_eps)
    post = F32(2.0) * sigmoid(scale[1] * m[..., n:2 * n] + base[n:2 * n])
    c0 = (scale[2] * m[..., 2 * n:] + base[2 * n:]).reshape(*m.shape[:-1], n, n)
    comb = sinkhorn(c0, sinkhorn_iters, hc_eps)
    return _weighted_streams(pre, x), post, comb


def hc_post(y: np.ndarray, x: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """Spec §3.2: X_new[k] = post_k · y + Σ_j C[j, k] · X[j] (new stream k uses column k of C).

    ``y`` [..., d], ``x`` [..., n, d], ``post`` [..., n], ``comb`` [..., n, n] -> [..., n, d].
    """
    out = post[..., :, None] * y[..., None, :]
    for j in range(x.shape[-2]):
        out = out + comb[..., j, :, None] * x[..., j, None, :]
    return out


def hc_head(x: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, *,
            norm_eps: float = 1e-6, hc_eps: float = 1e-6) -> np.ndarray:
    """Spec §3.3: h = Σ_i (σ(scale·m_i + base_i) + hc_eps) · X[i]; ``fn`` [n, n·d], ``scale`` [1]."""
    x = np.asarray(x, dtype=F32)
    m = _mix(x, fn, norm_eps)
    w = sigmoid(scale[0] * m + base) + F32(hc_eps)
    return _weighted_streams(w, x)
