"""Fixed-concurrency waves against any ``EngineClient`` (in-process service or remote server).

A level at concurrency C runs ``waves`` waves one after the other. A wave is C requests, one
thread per client, released together by a barrier; each thread stamps its own start just after
the barrier, submits, and reads its stream to the end, stamping the arrival of the first output
text and of the Finished event. The next wave starts only when every request of this one has
ended, so the waves measure a steady C, not a ramp (serving_notes §4).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..engine.api import EngineClient, Finished, ServiceError
from ..engine.sampling import SamplerConfig
from .metrics import LevelMetrics, RequestRecord, level_metrics
from .progress import Progress
from .prompts import BenchPrompt, PromptSet

clock = time.perf_counter


@dataclass(frozen=True, slots=True)
class BenchPlan:
    """What one arm runs: the levels, waves per level, sampling and the warm-up."""

    concurrency: tuple[int, ...]
    waves: int
    sampling: SamplerConfig
    thinking: bool = False
    warmup: int = 1
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError("concurrency levels must be integers >= 1")
        if self.waves < 1:
            raise ValueError("waves must be >= 1")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if self.request_timeout <= 0:
            raise ValueError("request timeout must be > 0")

    @property
    def total_requests(self) -> int:
        """Measured requests of one arm (warm-up excluded)."""
        return sum(c * self.waves for c in self.concurrency)


@dataclass(frozen=True, slots=True)
class LevelRun:
    """One level's raw records and its metrics."""

    concurrency: int
    records: tuple[RequestRecord, ...]
    metrics: LevelMetrics


def run_request(client: EngineClient, prompt: BenchPrompt, plan: BenchPlan, *, wave: int, lane: int,
                barrier: threading.Barrier | None = None) -> RequestRecord:
    """Send one request and read it to the end; failures become a record, never an exception."""
    if barrier is not None:
        barrier.wait()
    t_start = clock()
    t_first: float | None = None
    content: list[str] = []
    reasoning: list[str] = []
    fin: Finished | None = None
    error: str | None = None
    try:
        handle = client.submit(prompt.request(plan.sampling, thinking=plan.thinking))
        try:
            for ev in handle.events(timeout=plan.request_timeout):
                if isinstance(ev, Finished):
                    fin = ev
                    break
                if ev.text:
                    if t_first is None:
                        t_first = clock()
                    (reasoning if ev.kind == "reasoning" else content).append(ev.text)
        except TimeoutError as e:
            client.cancel(handle.request_id)
            error = f"timed out: {e}"
    except ServiceError as e:
        error = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - one broken request must not hang or kill the wave
        error = f"{type(e).__name__}: {e}"
    t_end = clock()
    if fin is None:
        return RequestRecord(wave=wave, lane=lane, prompt_id=prompt.id, prompt_sha256=prompt.sha256,
                             t_start=t_start, t_first=t_first, t_end=t_end, prompt_tokens=0,
                             completion_tokens=0, finish_reason="error", content="".join(content),
                             reasoning="".join(reasoning), error=error or "stream ended without a finish event")
    u = fin.usage
    return RequestRecord(
        wave=wave, lane=lane, prompt_id=prompt.id, prompt_sha256=prompt.sha256, t_start=t_start,
        t_first=t_first, t_end=t_end, prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
        finish_reason=fin.finish_reason, content="".join(content), reasoning="".join(reasoning),
        error=fin.error, cached_tokens=u.cached_tokens, native_queue_s=u.queue_s, native_ttft_s=u.ttft_s,
        native_prefill_s=u.prefill_s, native_decode_s=u.decode_s)


def run_wave(client: EngineClient, prompts: list[BenchPrompt], plan: BenchPlan, *, wave: int,
             on_done: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
    """Start ``len(prompts)`` requests together (one thread each) and wait for all of them."""
    n = len(prompts)
    barrier = threading.Barrier(n)
    out: list[RequestRecord | None] = [None] * n

    def lane(i: int) -> None:
        rec = run_request(client, prompts[i], plan, wave=wave, lane=i, barrier=barrier)
        out[i] = rec
        if on_done is not None:
            on_done(rec)

    # Daemon threads: Ctrl-C in the main thread must not wait for a slow server.
    threads = [threading.Thread(target=lane, args=(i,), name=f"bench-w{wave}-l{i}", daemon=True)
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)
    return [r for r in out if r is not None]


def warm_up(client: EngineClient, prompt_set: PromptSet, plan: BenchPlan) -> list[RequestRecord]:
    """Run ``plan.warmup`` single requests (first prompt) so one-off start costs stay out of level 1."""
    return [run_request(client, prompt_set.prompts[0], plan, wave=-1, lane=0) for _ in range(plan.warmup)]


def run_level(client: EngineClient, prompt_set: PromptSet, plan: BenchPlan, concurrency: int, *,
              progress: Progress | None = None, label: str = "") -> LevelRun:
    """All waves of one concurrency level, then its metrics."""
    records: list[RequestRecord] = []

    def done(rec: RequestRecord) -> None:
        if progress is not None:
            progress.advance(1, rec.completion_tokens)

    for w, prompts in enumerate(prompt_set.waves(concurrency, plan.waves)):
        if progress is not None:
            progress.set_label(f"{label}C={concurrency} wave {w + 1}/{plan.waves}")
        records.extend(run_wave(client, prompts, plan, wave=w, on_done=done))
    metrics = level_metrics(concurrency, records, max_tokens=plan.sampling.max_tokens,
                            ignore_eos=plan.sampling.ignore_eos)
    return LevelRun(concurrency=concurrency, records=tuple(records), metrics=metrics)


def run_levels(client: EngineClient, prompt_set: PromptSet, plan: BenchPlan, *,
               progress: Progress | None = None, label: str = "") -> list[LevelRun]:
    """Warm up, then every level of ``plan`` in order."""
    # Check the fixture covers every level before spending any time on the engine.
    for c in plan.concurrency:
        prompt_set.waves(c, plan.waves)
    if plan.warmup:
        if progress is not None:
            progress.set_label(f"{label}warm-up")
        warm = warm_up(client, prompt_set, plan)
        failed = [r for r in warm if r.finish_reason == "error"]
        if failed:
            raise ServiceError(f"warm-up request failed: {failed[0].error}")
    runs = []
    for c in plan.concurrency:
        run = run_level(client, prompt_set, plan, c, progress=progress, label=label)
        if progress is not None:
            progress.note(summary_line(label, run.metrics))
        runs.append(run)
    return runs


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def summary_line(label: str, m: LevelMetrics) -> str:
    """One line per finished level for the progress stream."""
    flag = "" if m.valid else "  INVALID: " + "; ".join(m.invalid_reasons)
    return (f"{label}C={m.concurrency}: {m.requests} req, {m.completion_tokens} tok, "
            f"output-window {_fmt(m.output_window_tok_s)} tok/s, aggregate {_fmt(m.aggregate_tok_s)} tok/s, "
            f"TTFT p50 {_fmt(m.ttft_p50_s, '.3f')} s p95 {_fmt(m.ttft_p95_s, '.3f')} s, "
            f"output set {m.output_set_sha256[:12]}{flag}")
