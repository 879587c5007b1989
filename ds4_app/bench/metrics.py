"""Per-level bench metrics from request timelines (serving_notes §4 definitions).

All times are client-side seconds on one monotonic clock. A level runs as waves; each wave's
requests start together. Per wave:

- wall = last end - first start;  window = last end - earliest first output;
- prefill window = latest first output - first start.

Per level (sums over waves, so the harness's own pause between waves is never counted):

- aggregate tok/s = completion tokens / sum of walls (queueing, prefill and decode included);
- output-window tok/s = completion tokens / sum of windows (decode-facing);
- prompt tok/s to first = prompt tokens / sum of prefill windows;
- TTFT = first output - start, per request: p50, p95, max (linear-interpolated percentiles);
- request decode tok/s = median over requests of (completion - 1) / (end - first output);
- native prefill tok/s = median over requests of the engine's (prompt - cached) / prefill time;
- exactness: SHA-256 of each output's content and reasoning, and one over the level's outputs
  in (wave, lane) order (``output_set_sha256``), likewise for the prompts sent.

A rate whose time base is zero or empty is ``None``, never a made-up number.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence


def sha256_text(text: str) -> str:
    """SHA-256 hex digest of ``text`` as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def set_sha256(digests: Iterable[str]) -> str:
    """One digest over an ordered list of digests (newline-joined)."""
    return sha256_text("\n".join(digests))


@dataclass(slots=True)
class RequestRecord:
    """The client-side timeline and result of one request of a wave.

    ``t_first`` is when the first output text arrived (None if none did); the ``native_*`` fields
    are the engine's own timings from ``Usage`` (0 where the target does not report them).
    """

    wave: int
    lane: int
    prompt_id: str
    prompt_sha256: str
    t_start: float
    t_first: float | None
    t_end: float
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    content: str = ""
    reasoning: str = ""
    error: str | None = None
    cached_tokens: int = 0
    native_queue_s: float = 0.0
    native_ttft_s: float = 0.0
    native_prefill_s: float = 0.0
    native_decode_s: float = 0.0
    content_sha256: str = field(init=False, default="")
    reasoning_sha256: str = field(init=False, default="")
    output_sha256: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.content_sha256 = sha256_text(self.content)
        self.reasoning_sha256 = sha256_text(self.reasoning)
        self.output_sha256 = sha256_text(f"{self.content_sha256}:{self.reasoning_sha256}")

    @property
    def ttft_s(self) -> float | None:
        """Client-side time to first output."""
        return None if self.t_first is None else self.t_first - self.t_start

    @property
    def decode_tok_s(self) -> float | None:
        """(completion - 1) / (end - first output); None with fewer than 2 tokens or no time."""
        if self.t_first is None or self.completion_tokens < 2 or self.t_end <= self.t_first:
            return None
        return (self.completion_tokens - 1) / (self.t_end - self.t_first)

    @property
    def native_prefill_tok_s(self) -> float | None:
        """The engine's prefill rate for this request (new prompt tokens / prefill time)."""
        if self.native_prefill_s <= 0:
            return None
        return (self.prompt_tokens - self.cached_tokens) / self.native_prefill_s

    def to_dict(self, t0: float = 0.0) -> dict:
        """JSON-ready dict; times relative to ``t0``; texts left out (they go to outputs.jsonl)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("content", "reasoning")}
        d["t_start"] = self.t_start - t0
        d["t_end"] = self.t_end - t0
        d["t_first"] = None if self.t_first is None else self.t_first - t0
        d["ttft_s"] = self.ttft_s
        d["decode_tok_s"] = self.decode_tok_s
        return d


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default, Hyndman-Fan type 7); None for no values."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


@dataclass(frozen=True, slots=True)
class WaveMetrics:
    """Timing of one wave (see the module docstring for the definitions)."""

    wave: int
    requests: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    window_s: float | None
    prefill_window_s: float | None
    aggregate_tok_s: float | None
    output_window_tok_s: float | None


def wave_metrics(wave: int, records: Sequence[RequestRecord]) -> WaveMetrics:
    """Metrics of one wave's requests (all sharing one start barrier)."""
    if not records:
        raise ValueError("a wave needs at least one request")
    start = min(r.t_start for r in records)
    end = max(r.t_end for r in records)
    firsts = [r.t_first for r in records if r.t_first is not None]
    completion = sum(r.completion_tokens for r in records)
    window = end - min(firsts) if firsts else None
    return WaveMetrics(
        wave=wave, requests=len(records), prompt_tokens=sum(r.prompt_tokens for r in records),
        completion_tokens=completion, wall_s=end - start, window_s=window,
        prefill_window_s=max(firsts) - start if firsts else None,
        aggregate_tok_s=_rate(completion, end - start),
        output_window_tok_s=_rate(completion, window) if window is not None else None)


@dataclass(frozen=True, slots=True)
class LevelMetrics:
    """Everything the bench reports for one concurrency level."""

    concurrency: int
    waves: int
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    wall_s: float
    output_window_s: float | None
    aggregate_tok_s: float | None
    output_window_tok_s: float | None
    aggregate_tok_s_median_wave: float | None
    output_window_tok_s_median_wave: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_max_s: float | None
    request_decode_tok_s: float | None
    prompt_tok_s_to_first: float | None
    native_prefill_tok_s: float | None
    native_ttft_p50_s: float | None
    finish_reasons: dict[str, int]
    valid: bool
    invalid_reasons: tuple[str, ...]
    prompt_set_sha256: str
    output_set_sha256: str
    per_wave: tuple[WaveMetrics, ...]

    def to_dict(self) -> dict:
        """JSON-ready dict (tuples become lists)."""
        d = asdict(self)
        d["invalid_reasons"] = list(self.invalid_reasons)
        d["per_wave"] = [asdict(w) for w in self.per_wave]
        return d


def level_metrics(concurrency: int, records: Sequence[RequestRecord], *, max_tokens: int | None,
                  ignore_eos: bool) -> LevelMetrics:
    """Aggregate one level's request records (any order) into its metrics.

    A level is valid when no request failed or was cancelled and, with ``ignore_eos``, every
    completion reached exactly ``max_tokens`` (a short output would inflate tok/s comparisons).
    """
    if not records:
        raise ValueError("a level needs at least one request")
    ordered = sorted(records, key=lambda r: (r.wave, r.lane))
    by_wave: dict[int, list[RequestRecord]] = {}
    for r in ordered:
        by_wave.setdefault(r.wave, []).append(r)
    waves = tuple(wave_metrics(w, rs) for w, rs in sorted(by_wave.items()))

    completion = sum(r.completion_tokens for r in ordered)
    prompt = sum(r.prompt_tokens for r in ordered)
    wall = sum(w.wall_s for w in waves)
    windows = [w.window_s for w in waves if w.window_s is not None]
    # A wave with no output at all has no window: the level window is then undefined, not shorter.
    window = sum(windows) if len(windows) == len(waves) else None
    prefill_windows = [w.prefill_window_s for w in waves if w.prefill_window_s is not None]
    prefill_window = sum(prefill_windows) if len(prefill_windows) == len(waves) else None

    ttfts = [r.ttft_s for r in ordered if r.ttft_s is not None]
    decode = [x for x in (r.decode_tok_s for r in ordered) if x is not None]
    native_prefill = [x for x in (r.native_prefill_tok_s for r in ordered) if x is not None]
    native_ttft = [r.native_ttft_s for r in ordered if r.native_ttft_s > 0]
    reasons = Counter(r.finish_reason for r in ordered)

    invalid: list[str] = []
    errors = sum(1 for r in ordered if r.finish_reason in ("error", "cancelled"))
    if errors:
        first = next(r for r in ordered if r.finish_reason in ("error", "cancelled"))
        invalid.append(f"{errors} request(s) failed or were cancelled (first: {first.error or first.finish_reason})")
    if ignore_eos and max_tokens is not None:
        short = [r for r in ordered if r.completion_tokens != max_tokens]
        if short:
            invalid.append(f"{len(short)} of {len(ordered)} completions are not exactly {max_tokens} tokens "
                           f"(e.g. wave {short[0].wave} lane {short[0].lane}: {short[0].completion_tokens})")

    return LevelMetrics(
        concurrency=concurrency, waves=len(waves), requests=len(ordered), errors=errors,
        prompt_tokens=prompt, completion_tokens=completion,
        cached_tokens=sum(r.cached_tokens for r in ordered),
        wall_s=wall, output_window_s=window,
        aggregate_tok_s=_rate(completion, wall),
        output_window_tok_s=_rate(completion, window) if window is not None else None,
        aggregate_tok_s_median_wave=_median([w.aggregate_tok_s for w in waves if w.aggregate_tok_s is not None]),
        output_window_tok_s_median_wave=_median(
            [w.output_window_tok_s for w in waves if w.output_window_tok_s is not None]),
        ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
        ttft_max_s=max(ttfts) if ttfts else None,
        request_decode_tok_s=_median(decode),
        prompt_tok_s_to_first=_rate(prompt, prefill_window) if prefill_window is not None else None,
        native_prefill_tok_s=_median(native_prefill),
        native_ttft_p50_s=percentile(native_ttft, 50),
        finish_reasons=dict(sorted(reasons.items())),
        valid=not invalid, invalid_reasons=tuple(invalid),
        prompt_set_sha256=set_sha256(r.prompt_sha256 for r in ordered),
        output_set_sha256=set_sha256(r.output_sha256 for r in ordered),
        per_wave=waves)
