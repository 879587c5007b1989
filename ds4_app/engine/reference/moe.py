"""MoE FFN parts (spec §5): sqrt-softplus router, hash / biased top-k, clamped SwiGLU experts."""

from __future__ import annotations

import numpy as np

from .numerics import F32, linear, seq_sum, silu, softplus

ROUTER_DENOM_MIN = 6.103515625e-5  # DS4 / llama.cpp clamp of the renormalization denominator


def route(x: np.ndarray, gate_w: np.ndarray, *, n_used: int, bias: np.ndarray | None = None,
          tid2eid: np.ndarray | None = None, tokens: int | np.ndarray | None = None,
          scale: float = 1.0, normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Router of one MoE layer (spec §5.1) for ``x`` [..., d]: (expert ids [..., k], weights [..., k]).

    Scores s = √softplus(W_g·x). Hash layers (``tid2eid`` given, [vocab, k]) take
    tid2eid[token]; otherwise the top ``n_used`` of s + bias, ties to the lower expert id, in
    descending order. Weights come from s alone: s_sel / max(Σ s_sel, 6.1035e-5) when
    ``normalize``, then × ``scale``.
    """
    s = np.sqrt(softplus(linear(gate_w, x)))
    if tid2eid is not None:
        if tokens is None:
            raise ValueError("hash routing needs the token ids")
        ids = np.asarray(tid2eid)[np.asarray(tokens)].astype(np.int64)
    else:
        sel = s if bias is None else s + bias
        ids = np.argsort(-sel, axis=-1, kind="stable")[..., :n_used]
    w = np.take_along_axis(s, ids, axis=-1)
    if normalize:
        w = w / np.maximum(seq_sum(w, axis=-1), F32(ROUTER_DENOM_MIN))[..., None]
    return ids, w * F32(scale)


def expert_ffn(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
               clamp: float) -> np.ndarray:
    """SwiGLU expert (spec §5.2): W2 · (SiLU(min(W1·x, L)) · clamp(W3·x, −L, L)).

    The gate is clamped only from above, the up projection on both sides; ``clamp`` ≤ 0 means
    no clamp (llama.cpp's convention). Routed experts are weighted by the caller after W2.
    """
    g = linear(w_gate, x)
    u = linear(w_up, x)
    if clamp > 0:
        u = np.clip(u, F32(-clamp), F32(clamp))
        g = np.minimum(g, F32(clamp))
    return linear(w_down, silu(g) * u)


def combine_experts(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Σ_i w_i · y_i over the routed slots in selection order: ``y`` [..., k, d], ``w`` [..., k]."""
    acc = y[..., 0, :] * w[..., 0, None]
    for i in range(1, y.shape[-2]):
        acc = acc + y[..., i, :] * w[..., i, None]
    return acc
