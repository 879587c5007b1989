"""A scripted EngineClient for UI tests: deterministic replies, controllable pacing, frozen stats.

Replies come from a script (by default: echo the last user message, word by word, with a short
reasoning first in thinking mode). ``pause_after=n`` stops every reply after its first n deltas
until ``resume()``, so a test can hold several replies mid-stream at once. Everything the UI did
is recorded (``submitted``, ``cancelled``). Stats are computed from the fake's state only (no
clocks), so snapshots of the engine panel are stable.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator, Sequence

from ds4_app.engine.api import (Delta, Event, Finished, FinishReason, GenerationRequest, LaneStats, PoolStats,
                                ServiceError, StatsSnapshot, Usage)
from ds4_app.engine.chat import Message

Script = Callable[[GenerationRequest], Sequence[Delta]]

LANE_TOK_S = 42.5
AGG_TOK_S = 85.0
TOK_S_HISTORY = tuple(float(v) for v in (0, 0, 12, 30, 41, 44, 52, 60, 71, 80, 84, 85, 83, 86, 85, 79,
                                          64, 70, 82, 85, 85, 84, 86, 85))
TTFT_RECENT = (0.31, 0.22, 0.18, 0.25, 0.19, 0.21)
N_PAGES = 64
MEMORY = (("weights", 310 * 2**20), ("pages", 96 * 2**20), ("rings", 12 * 2**20), ("scratch", 40 * 2**20))


def words(text: str) -> list[str]:
    """Split text into word chunks that keep their trailing space (so they join back exactly)."""
    parts = text.split(" ")
    return [p + " " for p in parts[:-1]] + [parts[-1]] if parts[-1] else [p + " " for p in parts[:-1]]


def echo_script(request: GenerationRequest) -> list[Delta]:
    """Reply "You said: <last user message>", word by word; reasoning first in thinking mode."""
    assert request.messages is not None
    last = next(m.content for m in reversed(request.messages) if m.role == "user")
    out = [Delta("reasoning", w) for w in words("The user wants an echo.")] if request.thinking else []
    return out + [Delta("content", w) for w in words(f"You said: {last}")]


@dataclass(slots=True, eq=False)
class _Live:
    request: GenerationRequest
    prompt_tokens: int
    slot: int
    deltas: Sequence[Delta]
    generated: int = 0
    state: str = "prefill"
    cancelled: bool = False
    done: bool = False


@dataclass(slots=True, eq=False)
class FakeHandle:
    """The fake's RequestHandle."""

    engine: "FakeEngine"
    live: _Live
    request_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.request_id = self.live.request.request_id

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Event]:
        for i, delta in enumerate(self.live.deltas):
            while not self.live.cancelled and not self.engine._may_emit(i):
                await asyncio.sleep(0.005)
            if self.engine.chunk_delay:
                await asyncio.sleep(self.engine.chunk_delay)
            if self.live.cancelled:
                break
            self.engine._emitted(self.live)
            yield delta
        yield self.engine._finish(self.live)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking iteration (same script and pacing, with sleeps)."""
        for i, delta in enumerate(self.live.deltas):
            while not self.live.cancelled and not self.engine._may_emit(i):
                time.sleep(0.005)
            if self.engine.chunk_delay:
                time.sleep(self.engine.chunk_delay)
            if self.live.cancelled:
                break
            self.engine._emitted(self.live)
            yield delta
        yield self.engine._finish(self.live)


class FakeEngine:
    """Implements EngineClient for tests (thread-safe like the real one: one lock over state)."""

    model_name = "fake-ds4.gguf"

    def __init__(self, *, script: Script = echo_script, chunk_delay: float = 0.0, pause_after: int | None = None,
                 finish_reason: FinishReason = "stop", error: str | None = None, max_slots: int = 4) -> None:
        self.script = script
        self.chunk_delay = chunk_delay
        self.pause_after = pause_after
        self.finish_reason: FinishReason = finish_reason
        self.error = error
        self.max_slots = max_slots
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.submit_errors: list[ServiceError] = []  # raised (first first) by the next submits
        self.closed = False
        self._resumed = threading.Event()
        self._lock = threading.Lock()
        self._slots: dict[int, _Live] = {}  # slot -> the request holding it (running or resident)
        self._steps = 0

    # ------------------------------------------------------------------ test controls
    def resume(self) -> None:
        """Let paused replies run to the end (and later ones run without pausing)."""
        self._resumed.set()

    def lanes(self) -> list[LaneStats]:
        """The lanes the stats would show now."""
        return list(self.stats().lanes)

    # ------------------------------------------------------------------ EngineClient
    def submit(self, request: GenerationRequest) -> FakeHandle:
        """Queue a scripted reply; raises the next of ``submit_errors`` if any."""
        if self.submit_errors:
            raise self.submit_errors.pop(0)
        assert request.messages is not None
        prompt = self.count_prompt_tokens(request.messages, None, request.thinking)
        with self._lock:
            slot = next((s for s, r in self._slots.items() if request.session and r.request.session == request.session),
                        None)
            if slot is None:
                slot = min(set(range(self.max_slots)) - set(self._slots))
            live = _Live(request, prompt, slot, tuple(self.script(request)))
            self._slots[slot] = live
            self.submitted.append(request)
        return FakeHandle(self, live)

    def cancel(self, request_id: str) -> None:
        """Record the cancel; the reply ends with "cancelled" before its next delta."""
        with self._lock:
            self.cancelled.append(request_id)
            for live in self._slots.values():
                if live.request.request_id == request_id and not live.done:
                    live.cancelled = True

    def stats(self) -> StatsSnapshot:
        """A snapshot computed from the fake's state only (frozen rates, fixed memory plan)."""
        with self._lock:
            lanes = []
            for slot, live in sorted(self._slots.items()):
                pos = live.prompt_tokens + live.generated
                state = "resident" if live.done else live.state
                lanes.append(LaneStats(slot=slot, request_id=None if live.done else live.request.request_id,
                                       session=live.request.session, state=state,  # type: ignore[arg-type]
                                       position=pos, context=pos, pages=max(1, math.ceil(pos / 128)),
                                       tok_s=LANE_TOK_S if state == "decode" else 0.0))
            used = sum(lane.pages for lane in lanes)
            running = [lane for lane in lanes if lane.state in ("prefill", "decode")]
            reserved = 2 * len(running)
            decode = sum(1 for lane in lanes if lane.state == "decode")
            prefill = sum(1 for lane in lanes if lane.state == "prefill")
            return StatsSnapshot(
                time=0.0, lanes=tuple(lanes),
                pool=PoolStats(N_PAGES, used, reserved, N_PAGES - used - reserved, evictions=1, preemptions=0),
                queue_len=0, n_running=len(running), agg_tok_s=AGG_TOK_S if decode else 0.0,
                tok_s_history=TOK_S_HISTORY, ttft_recent=TTFT_RECENT, step_decode_rows=decode,
                step_prompt_rows=4 * prefill, steps=self._steps, prompt_tokens_total=0,
                generation_tokens_total=0, requests_finished=0, backend="fake", device="test device",
                model=self.model_name, memory=MEMORY, max_slots=self.max_slots, max_ctx=4096)

    def count_prompt_tokens(self, messages: Sequence[Message] | None, prompt: str | None,
                            thinking: bool = False) -> int:
        """Words plus two per message: deterministic and roughly token-like."""
        if messages is None:
            return len((prompt or "").split()) + 1
        return sum(len(m.content.split()) + 2 for m in messages) + 1

    def close(self) -> None:
        """Record the close."""
        self.closed = True

    # ------------------------------------------------------------------ internals (handle side)
    def _may_emit(self, index: int) -> bool:
        return self.pause_after is None or index < self.pause_after or self._resumed.is_set()

    def _emitted(self, live: _Live) -> None:
        with self._lock:
            live.state = "decode"
            live.generated += 1
            self._steps += 1

    def _finish(self, live: _Live) -> Finished:
        with self._lock:
            live.done = True
            reason: FinishReason = "cancelled" if live.cancelled else self.finish_reason
            if reason in ("cancelled", "error"):
                # The fake frees the slot of a cut-short turn; a finished turn stays resident.
                self._slots = {s: r for s, r in self._slots.items() if r is not live}
        usage = Usage(prompt_tokens=live.prompt_tokens, completion_tokens=live.generated, ttft_s=0.12,
                      decode_s=max(0.0, (live.generated - 1) / LANE_TOK_S),
                      total_s=0.12 + max(0.0, (live.generated - 1) / LANE_TOK_S))
        return Finished(reason, usage, error=self.error if reason == "error" else None)
