"""Attention parts (spec §4): tail RoPE, the compressor, the lightning indexer, attention with sink.

Each function works on one row or on a batch of rows with the same arithmetic per row, so the
incremental (``Reference.step``) and whole-prompt (``Reference.forward_prompt``) paths share them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .numerics import F32, rms_norm

NEG_INF = F32(-np.inf)


# --- RoPE (§4.3) ------------------------------------------------------------------------------

def rope_rotate(x: np.ndarray, pos: int | np.ndarray, inv_freqs: Sequence[float] | np.ndarray,
                inverse: bool = False) -> np.ndarray:
    """Rotate the last 2·len(inv_freqs) dims of ``x`` by angle pos·θ'_k (spec §4.3).

    Interleaved pairs: dims (2k, 2k+1) of the tail form complex number k. ``pos`` broadcasts
    against ``x.shape[:-1]``. Angles are formed in float64 and cos/sin rounded to fp32 (so they do
    not lose precision at large positions); the rotation itself is fp32. ``inverse`` rotates by
    −angle (the conjugate), which undoes the rotation. The leading dims are returned unchanged.
    """
    inv = np.asarray(inv_freqs, dtype=np.float64)
    half = inv.shape[0]
    x = np.array(x, dtype=F32, copy=True)
    ang = np.asarray(pos, dtype=np.float64)[..., None] * inv
    cos = np.cos(ang).astype(F32)
    sin = np.sin(ang).astype(F32)
    if inverse:
        sin = -sin
    tail = x[..., x.shape[-1] - 2 * half:].reshape(*x.shape[:-1], half, 2)
    a, b = tail[..., 0], tail[..., 1]
    rot = np.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    x[..., x.shape[-1] - 2 * half:] = rot.reshape(*x.shape[:-1], 2 * half)
    return x


# --- compressor (§4.4) ------------------------------------------------------------------------

def new_compressor_state(ratio: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Fresh (kv_state, score_state) for a compressor of ``ratio`` m and head width c.

    Overlapping (m = 4): [2m, 2c], slots [0, m) the previous block, [m, 2m) the current one.
    Otherwise [m, c]. kv starts at 0 and scores at −∞.
    """
    rows, cols = (2 * ratio, 2 * width) if ratio == 4 else (ratio, width)
    return np.zeros((rows, cols), F32), np.full((rows, cols), NEG_INF, F32)


def compressor_update(kv_state: np.ndarray, score_state: np.ndarray, kv: np.ndarray,
                      score: np.ndarray, pos: int, ratio: int,
                      ) -> tuple[np.ndarray, np.ndarray] | None:
    """Record token ``pos``'s (k_t, z_t) (z already includes ape) in the state, in place.

    Returns the candidates (kv [n, c], score [n, c]) of the block this token completes, when
    (pos+1) mod ratio == 0, else None. Overlapping compressors pool the previous block's channels
    [0:c] and the current block's [c:2c] (2m candidates); for block 0 the previous half is (0, −∞)
    whatever the state holds (the spec's normative j = 0 rule). After emitting, the block moves to
    the "previous" slots (overlap) and the current slots are reset to (0, −∞), as DS4 does, so the
    state after any prefix is deterministic.
    """
    m = ratio
    slot = pos % m
    overlap = m == 4
    row = m + slot if overlap else slot
    kv_state[row] = kv
    score_state[row] = score
    if (pos + 1) % m:
        return None
    if not overlap:
        cand = kv_state.copy(), score_state.copy()
        kv_state[:] = 0.0
        score_state[:] = NEG_INF
        return cand
    c = kv_state.shape[1] // 2
    prev_kv = kv_state[:m, :c].copy()
    prev_sc = score_state[:m, :c].copy()
    if pos // m == 0:
        prev_kv[:] = 0.0
        prev_sc[:] = NEG_INF
    cand = (np.concatenate([prev_kv, kv_state[m:, c:]]), np.concatenate([prev_sc, score_state[m:, c:]]))
    kv_state[:m] = kv_state[m:]
    score_state[:m] = score_state[m:]
    kv_state[m:] = 0.0
    score_state[m:] = NEG_INF
    return cand


def prompt_blocks(kv: np.ndarray, score: np.ndarray, ratio: int) -> tuple[np.ndarray, np.ndarray]:
    """Whole-prompt form of the candidates: ``kv``/``score`` [T, coff·c] (rows = positions 0..T−1)
    -> candidates [nb, n, c] of the nb = ⌊T/m⌋ complete blocks (same layout as ``compressor_update``)."""
    m = ratio
    nb = kv.shape[0] // m
    kb = kv[:nb * m].reshape(nb, m, kv.shape[1])
    sb = score[:nb * m].reshape(nb, m, score.shape[1])
    if m != 4:
        return kb, sb
    c = kv.shape[1] // 2
    prev_k = np.concatenate([np.zeros((min(nb, 1), m, c), F32), kb[:-1, :, :c]])
    prev_s = np.concatenate([np.full((min(nb, 1), m, c), NEG_INF, F32), sb[:-1, :, :c]])
    return np.concatenate([prev_k, kb[:, :, c:]], axis=1), np.concatenate([prev_s, sb[:, :, c:]], axis=1)


def pool_block(kv: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Per-channel softmax pooling: candidates [..., n, c] -> [..., c], C[ch] = Σ_t softmax_t(z[ch]) k_t[ch]."""
    # channels first so the reductions run over a contiguous last axis of fixed length n
    zt = np.ascontiguousarray(np.swapaxes(np.asarray(score, F32), -1, -2))
    kt = np.ascontiguousarray(np.swapaxes(np.asarray(kv, F32), -1, -2))
    e = np.exp(zt - np.max(zt, axis=-1, keepdims=True))
    p = e / np.sum(e, axis=-1, keepdims=True)
    return np.sum(p * kt, axis=-1)


def compress_block(kv: np.ndarray, score: np.ndarray, norm_weight: np.ndarray,
                   block_pos: int | np.ndarray, inv_freqs: Sequence[float] | np.ndarray,
                   eps: float = 1e-6) -> np.ndarray:
    """One compressed row per block (spec §4.4): pool, weighted RMSNorm, RoPE at ``block_pos``.

    ``block_pos`` is the block's first position j·m. The storage rounding (FP8/FP4 under QAT,
    then f16) is applied by the caller.
    """
    return rope_rotate(rms_norm(pool_block(kv, score), norm_weight, eps), block_pos, inv_freqs)


# --- lightning indexer (§4.5) -----------------------------------------------------------------

def indexer_scores(q: np.ndarray, w: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """I(t, s) = Σ_h w_h · ReLU(q_h · K_s). ``q`` [..., Hi, di], ``w`` [..., Hi] (already scaled by
    1/√(di·Hi)), ``keys`` [S, di] -> [..., S]. Heads are added in order 0..Hi−1."""
    q = np.asarray(q, F32)
    dots = np.sum(q[..., :, None, :] * np.asarray(keys, F32)[..., None, :, :], axis=-1)
    r = np.maximum(dots, F32(0.0))
    acc = w[..., 0, None] * r[..., 0, :]
    for h in range(1, r.shape[-2]):
        acc = acc + w[..., h, None] * r[..., h, :]
    return acc


def indexer_select(scores: np.ndarray, n_visible: int, top_k: int) -> np.ndarray:
    """Indices (ascending) of the compressed rows a query attends: the top ``top_k`` by score
    among the visible rows s < n_visible (= ⌊(t+1)/4⌋); all of them when they fit.

    Ties go to the lower index (a stable sort on −score), so the choice is deterministic; only the
    set matters to attention, and it is returned in ascending order.
    """
    k = min(top_k, n_visible)
    if k == n_visible:
        return np.arange(n_visible)
    order = np.argsort(-np.asarray(scores[:n_visible], F32), kind="stable")[:k]
    return np.sort(order)


# --- attention with sink (§4.7) ---------------------------------------------------------------

def attend_with_sink(q: np.ndarray, keys: np.ndarray, sink: np.ndarray, *, scale: float,
                     mask: np.ndarray | None = None) -> np.ndarray:
    """o_h = Σ_s e^{ℓ_s−M} k_s / (Σ_s e^{ℓ_s−M} + e^{σ_h−M}), ℓ_s = scale·q_h·k_s, K = V (spec §4.7).

    ``q`` [..., H, D]; ``keys`` [S, D] (or [..., S, D]); ``sink`` [H]; ``mask`` [..., S] (True =
    attend) or None for all keys. M = max(max_s ℓ_s, σ_h). The sink is a softmax column with a
    zero value: it only enlarges the denominator. Sums over keys run sequentially in key order, so
    masked keys (exact zeros) change nothing and a gathered key list gives the same bits as a
    masked full one.
    """
    q = np.asarray(q, F32)
    keys = np.asarray(keys, F32)
    kk = keys[..., None, :, :]  # [..., 1, S, D]
    logits = np.sum(q[..., :, None, :] * kk, axis=-1) * F32(scale)  # [..., H, S]
    n_keys = logits.shape[-1]
    if mask is not None:
        logits = np.where(mask[..., None, :], logits, NEG_INF)
        # keys no query of the batch sees add exact zeros: skipping them changes no bit
        live = np.nonzero(np.reshape(mask, (-1, n_keys)).any(axis=0))[0]
    else:
        live = range(n_keys)
    mx = np.maximum(np.max(logits, axis=-1), sink)  # [..., H]
    e = np.exp(logits - mx[..., None])
    den = np.zeros(mx.shape, F32)
    num = np.zeros(q.shape, F32)
    for s in live:
        den = den + e[..., s]
        num = num + e[..., s, None] * keys[..., s, None, :]
    return num / (den + np.exp(sink - mx))[..., None]


def window_positions(pos: int, window: int) -> np.ndarray:
    """Raw positions a query at ``pos`` sees, oldest first: max(0, pos−window+1) … pos (spec §4.6)."""
    return np.arange(max(0, pos - window + 1), pos + 1)


__all__ = [
    "rope_rotate", "new_compressor_state", "compressor_update", "prompt_blocks", "pool_block",
    "compress_block", "indexer_scores", "indexer_select", "attend_with_sink", "window_positions",
]
