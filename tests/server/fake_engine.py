"""A scripted ``EngineClient`` for the server's black-box tests (never shipped).

It behaves like the real service where the server can tell: a loop thread of its own produces
every request's events on its own clock into a buffered handle (so it never waits on a
consumer), ``cancel`` retires a request before its next token, ``submit`` raises the
``ServiceError``s the real one raises, and ``stats`` returns a snapshot. What it generates is
scripted, so tests can assert exact text:

- the reply to a chat is ``"Echo: " + last user message`` (one word per token), or to a raw
  prompt the prompt's words reversed; in thinking mode it is preceded by the reasoning
  ``"Thinking about it."``;
- max_tokens ("length"), stop strings (the real ``StopMatcher``) and ignore_eos (filler tokens
  ``w<i>`` until max_tokens) apply as in the engine;
- a prompt containing ``!fake {json}`` changes the script: ``tokens`` (number of content tokens
  ``t0 t1 ...``), ``chunk`` (each content token is this many bytes of ``x``), ``prefill``
  (seconds before the first token), ``interval`` (seconds between tokens), ``raise`` (name of a
  ServiceError class raised by submit), ``error_after`` (finish with "error" after that many
  tokens).

Prompt "tokens" are whitespace-separated words; a prompt over ``max_ctx`` words raises
ContextLengthExceeded, and prompt + max_tokens over ``pool_tokens`` raises ExceedsPool.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from ds4_app.engine import api
from ds4_app.engine.api import (ContextLengthExceeded, Delta, ExceedsPool, Finished, GenerationRequest,
                                LaneStats, PoolStats, StatsSnapshot, Usage)
from ds4_app.engine.chat import Message
from ds4_app.engine.sampling import StopMatcher
from ds4_app.engine.stream import EventStream

_DIRECTIVE = re.compile(r"!fake\s+(\{.*\})", re.S)


FakeHandle = EventStream  # the same handle the real engines hand out


@dataclass(frozen=True, slots=True)
class _Script:
    """The tokens of a reply, made on demand (a scripted reply may be millions of bytes)."""

    reasoning: list[str]
    words: list[str] | None  # None: ``n_tokens`` tokens "t<i> " (or ``chunk`` bytes of "x" each)
    n_tokens: int
    chunk: int | None

    def __len__(self) -> int:
        return len(self.reasoning) + (len(self.words) if self.words is not None else self.n_tokens)

    def __getitem__(self, i: int) -> tuple[str, str]:
        if i < len(self.reasoning):
            return "reasoning", self.reasoning[i]
        j = i - len(self.reasoning)
        if self.words is not None:
            return "content", self.words[j]
        return "content", "x" * self.chunk if self.chunk else f"t{j} "


@dataclass(slots=True, eq=False)
class _Live:
    req: GenerationRequest
    handle: FakeHandle
    steps: _Script  # (kind, text) per token, before max_tokens / stop
    prompt_tokens: int
    interval: float
    error_after: int | None
    t_submit: float
    next_at: float
    stops: StopMatcher
    done: int = 0
    t_first: float = 0.0


@dataclass(slots=True)
class FakeEngine:
    """The scripted engine (see the module docstring)."""

    model_name: str = "fake-ds4.gguf"
    max_slots: int = 4
    max_ctx: int = 512
    pool_tokens: int = 4096
    token_interval: float = 0.01
    submitted: list[dict] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    closed: bool = False
    _live: dict[str, _Live] = field(default_factory=dict)
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _counts: collections.Counter = field(default_factory=collections.Counter)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    # --- EngineClient ---
    def count_prompt_tokens(self, messages: Sequence[Message] | None, prompt: str | None,
                            thinking: bool = False) -> int:
        text = " ".join(m.content for m in messages) if messages is not None else (prompt or "")
        return len(text.split())

    def submit(self, request: GenerationRequest) -> FakeHandle:
        text = request.messages[-1].content if request.messages is not None else request.prompt or ""
        script = {}
        m = _DIRECTIVE.search(text)
        if m:
            script = json.loads(m.group(1))
            text = (text[:m.start()] + text[m.end():]).strip()
        if "raise" in script:
            raise getattr(api, script["raise"])(f"scripted {script['raise']}")
        n_prompt = self.count_prompt_tokens(request.messages, request.prompt)
        if n_prompt > self.max_ctx:
            raise ContextLengthExceeded(f"prompt is {n_prompt} tokens, the context is {self.max_ctx}")
        mt = request.sampling.max_tokens
        if mt is not None and n_prompt + mt > self.pool_tokens:
            raise ExceedsPool(f"prompt ({n_prompt}) + max_tokens ({mt}) can never fit the page pool of "
                              f"{self.pool_tokens} tokens")
        reasoning = ["Thinking ", "about ", "it."] if request.thinking else []
        if "tokens" in script or "chunk" in script:
            words = None
        else:
            words = ("Echo: " + text).split(" ") if request.messages is not None else list(reversed(text.split()))
            words = [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]
        steps = _Script(reasoning, words, script.get("tokens", 1), script.get("chunk"))
        now = time.monotonic()
        handle = FakeHandle(request.request_id)
        live = _Live(req=request, handle=handle, steps=steps, prompt_tokens=n_prompt,
                     interval=float(script.get("interval", self.token_interval)),
                     error_after=script.get("error_after"), t_submit=now,
                     next_at=now + float(script.get("prefill", 0.0)), stops=StopMatcher(request.sampling.stop))
        with self._lock:
            if self.closed:
                raise api.EngineUnavailable("the engine is stopping")
            self.submitted.append({"request_id": request.request_id, "thinking": request.thinking,
                                   "session": request.session, "sampling": dataclasses.asdict(request.sampling),
                                   "prompt": request.prompt,
                                   "messages": [dataclasses.asdict(x) for x in request.messages or ()]})
            self._live[request.request_id] = live
            self._lock.notify()
        return handle

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancelled.append(request_id)
            live = self._live.get(request_id)
            if live is not None:
                self._finish(live, "cancelled", time.monotonic())

    def stats(self) -> StatsSnapshot:
        with self._lock:
            lives = list(self._live.values())
            counts = dict(self._counts)
        lanes = []
        for i, lv in enumerate(lives):
            queued = i >= self.max_slots
            state = "queued" if queued else ("prefill" if lv.done == 0 else "decode")
            lanes.append(LaneStats(slot=None if queued else i, request_id=lv.req.request_id, session=lv.req.session,
                                   state=state, position=lv.prompt_tokens + lv.done,
                                   context=lv.prompt_tokens + lv.done, pages=0 if queued else 1,
                                   tok_s=1.0 / lv.interval if lv.interval > 0 else 0.0))
        running = sum(1 for x in lanes if x.state != "queued")
        n_pages = self.pool_tokens // 128
        return StatsSnapshot(
            time=time.time(), lanes=tuple(lanes),
            pool=PoolStats(n_pages=n_pages, used=running, reserved=0, free=n_pages - running, evictions=2,
                           preemptions=1),
            queue_len=len(lanes) - running, n_running=running, agg_tok_s=0.0, tok_s_history=(1.0, 2.0),
            ttft_recent=(0.01,), step_decode_rows=running, step_prompt_rows=0, steps=counts.get("steps", 0),
            prompt_tokens_total=counts.get("prompt", 0), generation_tokens_total=counts.get("generated", 0),
            requests_finished=counts.get("finished", 0), backend="fake", device="none", model=self.model_name,
            memory=(("weights", 1024),), max_slots=self.max_slots, max_ctx=self.max_ctx)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            for lv in list(self._live.values()):
                self._finish(lv, "cancelled", time.monotonic())
            self._lock.notify()
        print("fake engine closed", file=sys.stderr, flush=True)

    # --- the loop ---
    def _loop(self) -> None:
        with self._lock:
            while not self.closed:
                now = time.monotonic()
                for lv in list(self._live.values()):
                    while lv.next_at <= now and lv.req.request_id in self._live:
                        self._advance(lv, now)
                        lv.next_at += lv.interval
                wake = min((lv.next_at for lv in self._live.values()), default=now + 0.5)
                self._lock.wait(max(0.0, wake - time.monotonic()))

    def _advance(self, lv: _Live, now: float) -> None:
        s = lv.req.sampling
        if lv.done == 0:
            lv.t_first = now
            self._counts["prompt"] += lv.prompt_tokens
        if lv.error_after is not None and lv.done >= lv.error_after:
            self._finish(lv, "error", now, "scripted engine failure")
            return
        if lv.done < len(lv.steps):
            kind, text = lv.steps[lv.done]
        elif s.ignore_eos and s.max_tokens is not None:
            kind, text = "content", f"w{lv.done} "
        else:
            tail = lv.stops.flush()
            if tail:
                lv.handle.push(Delta("content", tail))
            self._finish(lv, "stop", now)
            return
        lv.done += 1
        self._counts["generated"] += 1
        if kind == "content":
            text, stopped = lv.stops.feed(text)
            if text:
                lv.handle.push(Delta("content", text))
            if stopped:
                self._finish(lv, "stop", now)
                return
        else:
            lv.handle.push(Delta(kind, text))
        if s.max_tokens is not None and lv.done >= s.max_tokens:
            tail = lv.stops.flush()
            if tail:
                lv.handle.push(Delta("content", tail))
            self._finish(lv, "length", now)

    def _finish(self, lv: _Live, reason: str, now: float, error: str | None = None) -> None:
        if self._live.pop(lv.req.request_id, None) is None:
            return
        self._counts["finished"] += 1
        first = lv.t_first or now
        usage = Usage(prompt_tokens=lv.prompt_tokens, completion_tokens=lv.done, cached_tokens=0,
                      queue_s=0.0, ttft_s=first - lv.t_submit, prefill_s=first - lv.t_submit,
                      decode_s=now - first, total_s=now - lv.t_submit)
        lv.handle.push(Finished(finish_reason=reason, usage=usage,  # type: ignore[arg-type]
                                tokens=tuple(range(lv.done)), error=error))
