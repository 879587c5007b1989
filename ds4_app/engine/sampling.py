"""Token sampling on the host: per-request settings, the sampler, and stop-string matching.

Order of operations in ``sample`` (one fixed order so the same seed gives the same tokens):
penalties over the recent history (llama.cpp semantics), then either greedy argmax, or
temperature, top-k, top-p, min-p and one draw from the slot's own generator. The filtering and
the draw run in float64 so that a draw does not depend on float32 rounding of the cumulative sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class SamplerConfig:
    """One request's sampling settings, checked once here.

    temperature 0 is greedy; top_k 0, top_p 1, min_p 0 and repetition_penalty 1 switch those off.
    Penalties look at the last ``penalty_last_n`` tokens of the history (prompt + generated):
    0 disables them, -1 means the whole history (llama.cpp's ``penalty_last_n``).
    seed None draws a random seed; any integer >= 0, including 0, is a real seed.
    max_tokens None means "until the context is full".
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"sampler: {msg}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not _is_int(self.penalty_last_n) or self.penalty_last_n < -1:
            bad(f"penalty_last_n must be an integer >= -1, got {self.penalty_last_n!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            bad(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", stop)  # frozen: normalise a list to a tuple once, here
        if not isinstance(self.ignore_eos, bool):
            bad(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling is a plain argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        """True when any penalty would change a logit."""
        return self.penalty_last_n != 0 and (
            self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0)

    @property
    def argmax_only(self) -> bool:
        """True when the token is the raw logits' argmax: greedy with no penalty (for float32
        logits ``apply_penalties`` is then an exact copy)."""
        return self.temperature == 0 and not self.uses_penalties


def apply_penalties(logits: np.ndarray, cfg: SamplerConfig, history: Sequence[int]) -> np.ndarray:
    """Return a float32 copy of ``logits`` with the repetition, presence and frequency penalties.

    llama.cpp semantics, per token seen ``count`` times in the window: a positive logit is divided
    by the repetition penalty, a non-positive one multiplied; then
    ``count * frequency + presence`` is subtracted.
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if not cfg.uses_penalties or len(history) == 0:
        return out
    window = history if cfg.penalty_last_n == -1 else history[-cfg.penalty_last_n:]
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    keep = (ids >= 0) & (ids < out.shape[0])  # ids the vocabulary has no logit for carry no penalty
    ids, counts = ids[keep], counts[keep]
    seen = out[ids]
    rp = np.float32(cfg.repetition_penalty)
    seen = np.where(seen > 0, seen / rp, seen * rp)
    seen = seen - (counts.astype(np.float32) * np.float32(cfg.frequency_penalty)
                   + np.float32(cfg.presence_penalty))
    out[ids] = seen.astype(np.float32)
    return out


def _top_k_mask(x: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the k largest entries; ties at the boundary go to the lowest ids."""
    kth = np.partition(x, x.shape[0] - k)[x.shape[0] - k]
    mask = x > kth
    tied = np.flatnonzero(x == kth)
    mask[tied[: k - int(mask.sum())]] = True
    return mask


def probabilities(logits: np.ndarray, cfg: SamplerConfig, history: Sequence[int] = ()) -> np.ndarray:
    """The float64 distribution over the vocabulary that ``sample`` draws from.

    Greedy configs give a one-hot vector at the argmax. Tokens removed by top-k, top-p or min-p
    have probability exactly 0; the rest are renormalised to sum to 1.
    """
    x = apply_penalties(logits, cfg, history)
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError("logits must be a non-empty 1-D array")
    probs = np.zeros(x.shape[0], dtype=np.float64)
    if cfg.greedy:
        probs[int(np.argmax(x))] = 1.0  # np.argmax returns the lowest id among ties
        return probs
    z = x.astype(np.float64) / cfg.temperature
    if np.isposinf(z).any():  # +inf logits share all the mass; exp(inf - inf) would give NaN
        z = np.where(np.isposinf(z), 0.0, -np.inf)
    keep = z > -np.inf  # NaN compares False, so NaN logits are never drawn
    if not keep.any():
        raise ValueError("all logits are -inf or NaN")
    z = np.where(keep, z, -np.inf)
    if 0 < cfg.top_k < z.shape[0]:
        keep &= _top_k_mask(z, cfg.top_k)
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    if cfg.top_p < 1:
        # Smallest prefix (by descending probability, ties by lowest id) reaching top_p. Sorting
        # the whole vocabulary costs ~10 ms a token, so sort only the k most likely tokens,
        # growing k until they reach top_p; the prefix is the same as with a full sort.
        n_live = int(keep.sum())
        k = min(64, n_live)
        while True:
            cand = np.flatnonzero(_top_k_mask(p, k))
            order = cand[np.lexsort((cand, -p[cand]))]
            csum = np.cumsum(p[order])
            if csum[-1] >= cfg.top_p or k == n_live:
                break
            k = min(8 * k, n_live)
        n_keep = min(int(np.searchsorted(csum, cfg.top_p, side="left")) + 1, order.shape[0])
        trimmed = np.zeros_like(keep)
        trimmed[order[:n_keep]] = True
        keep &= trimmed
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if cfg.min_p > 0:
        keep &= p >= cfg.min_p * p.max()
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def sample(logits: np.ndarray, cfg: SamplerConfig, rng: np.random.Generator,
           history: Sequence[int] = ()) -> int:
    """Pick the next token id from one row of logits.

    Greedy takes the argmax (lowest id on ties) and does not touch ``rng``; otherwise exactly one
    float64 uniform is drawn from ``rng``, so a slot's stream of draws depends only on its seed.
    """
    if cfg.greedy:
        # What ``probabilities`` would do, without building its one-hot vector: the argmax of
        # the penalised float32 logits (np.argmax: lowest id among ties, the first NaN if any).
        x = apply_penalties(logits, cfg, history)
        if x.ndim != 1 or x.shape[0] == 0:
            raise ValueError("logits must be a non-empty 1-D array")
        return int(np.argmax(x))
    p = probabilities(logits, cfg, history)
    cdf = np.cumsum(p)
    u = rng.random() * cdf[-1]
    idx = int(np.searchsorted(cdf, u, side="right"))
    # u can round up to cdf[-1]; fall back to the last token that has any probability.
    return min(idx, int(np.flatnonzero(p)[-1]))


def sample_rows(logits: np.ndarray, cfgs: Sequence[SamplerConfig], rngs: Sequence[np.random.Generator],
                histories: Sequence[Sequence[int]]) -> list[int]:
    """``sample`` for each row of a step's logits [n, vocab], row i with ``cfgs[i]``, ``rngs[i]``
    and ``histories[i]``; the same ids as calling ``sample`` row by row, in row order.

    Rows that are plain greedy (temperature 0, no penalty) take one argmax over all of them:
    np.argmax along the last axis picks, per row, exactly what it picks for that row alone, and
    for float32 logits ``apply_penalties`` without penalties is an exact copy.
    """
    n = len(cfgs)
    if not (len(rngs) == len(histories) == n) or logits.ndim != 2 or logits.shape[0] != n:
        raise ValueError(f"sample_rows: {n} configs for logits of shape {logits.shape}")
    plain = [i for i, c in enumerate(cfgs) if c.argmax_only]
    if not plain or logits.dtype != np.float32 or logits.shape[1] == 0:
        return [sample(logits[i], cfgs[i], rngs[i], histories[i]) for i in range(n)]
    if len(plain) == n:
        return logits.argmax(axis=1).tolist()  # the method: np.argmax only adds a Python wrapper
    out: list[int] = [0] * n
    for i, tok in zip(plain, logits[plain].argmax(axis=1).tolist()):
        out[i] = tok
    plain_set = set(plain)
    for i in range(n):
        if i not in plain_set:
            out[i] = sample(logits[i], cfgs[i], rngs[i], histories[i])
    return out


class StopMatcher:
    """Finds stop strings in streamed text, across token boundaries, without emitting them.

    ``feed`` returns the text that is safe to show now. Text that could still be the beginning of
    a stop string is held back until the next feed settles it; ``flush`` releases what is held
    when the generation ends for another reason (EOS, length).
    """

    __slots__ = ("_stops", "_buf", "_stopped")

    def __init__(self, stops: Sequence[str] = ()) -> None:
        if isinstance(stops, str):
            stops = (stops,)
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = tuple(stops)
        self._buf = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has been seen; later feeds emit nothing."""
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return ``(text safe to emit, whether a stop string was hit)``."""
        if not self._stops:  # nothing to match: the text as it is (no copy)
            return text, False
        if self._stopped:
            return "", True
        buf = self._buf + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._stopped, self._buf = True, ""
            return buf[: min(hits)], True
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._buf = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release held-back text at the end of a generation that did not hit a stop string."""
        out, self._buf = ("" if self._stopped else self._buf), ""
        return out
