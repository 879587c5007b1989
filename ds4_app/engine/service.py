"""EngineService: the step loop in its own thread, behind submit / cancel / stats.

Every front end talks to this (through the ``EngineClient`` protocol of ``api.py``). One thread
owns the slots, the scheduler and the runner; other threads only enqueue requests and
cancellations under a lock and read immutable stats snapshots. The loop never waits on a
consumer: each request's events go into a bounded buffer, and a consumer that falls too far
behind is dropped (its request is cancelled with an error), not waited for.

A step of the loop:
1. retire cancelled requests (before any compute), then admit from the queue in FIFO order
   while slots and pages allow (a resident session resumes its parked slot);
2. schedule (decoders + packed prompt rows), wake the consumers of the last step's events (they
   run while the native step holds no GIL), run the step on the runner, sample;
3. queue the new text on each request's stream, finish requests at EOS / stop strings / max
   tokens, park the slots of named sessions (they stay resident) and retire the others;
4. publish a fresh stats snapshot when the set of lanes changed (admission, first token,
   finish, cancel, eviction, preemption, the queue) or STATS_INTERVAL has passed; the step
   counters are current on every read (see ``stats``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from .api import (ContextLengthExceeded, EngineUnavailable, ExceedsPool, Finished,
                  GenerationRequest, InvalidRequest, LaneStats, PoolStats, QueueFull, StatsSnapshot,
                  Usage)
from .chat import Delta, Message, ReplyParser, encode_chat, render_chat
from .pages import PagePool, pages_for
from .sampling import StopMatcher, sample_rows
from .scheduler import Scheduler
from .slots import AdmissionError, Busy, Preempted, SlotManager, SlotState
from .stream import EventStream

log = logging.getLogger(__name__)

MAX_BUFFERED_EVENTS = 8192  # per request; a consumer this far behind is dropped
# A full snapshot costs tens of µs (a LaneStats per lane, the rates, the history), as much as the
# rest of a step's Python at C = 6; the panel reads it at 10 Hz, so 100 Hz is fresh enough.
STATS_INTERVAL = 0.01  # s


@dataclass(frozen=True, slots=True)
class _SessionHistory:
    """What a chat session's last finished turn left: its messages, the reply it produced and the
    exact tokens behind them. The next turn continues these tokens instead of re-tokenizing the
    reply text (BPE need not give back the tokens that were generated), so a resident slot's state
    stays a prefix of the new prompt, and a recompute after eviction sees the same tokens."""

    messages: tuple[Message, ...]
    reply: str
    tokens: tuple[int, ...]


@dataclass(slots=True, eq=False)
class _Request:
    """The service's record of one request (engine thread only, after submission)."""

    req: GenerationRequest
    prompt: list[int]
    stream: EventStream
    parser: ReplyParser
    stops: StopMatcher
    t_submit: float
    slot: int | None = None
    cached: int = 0
    generated: list[int] = field(default_factory=list)
    content: list[str] = field(default_factory=list)  # content text streamed so far
    t_admit: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    recompute: Preempted | None = None  # set while waiting to be recomputed after preemption
    finished: bool = False


class EngineService:
    """Owns a runner and serves requests concurrently through its paged engine (thread-safe)."""

    def __init__(self, runner, tokenizer, *, model_name: str = "ds4", max_queue: int = 64) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_queue = max_queue
        self.max_slots = runner.max_slots
        self.max_ctx = runner.max_ctx
        self.pool = PagePool(runner.n_pages)
        self.slots = SlotManager(self.max_slots, self.max_ctx, self.pool)
        self.scheduler = Scheduler(self.slots, runner.limits)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Request] = collections.deque()
        self._cancels: set[str] = set()
        self._forget: set[str] = set()  # sessions whose resident slot and history go
        self._live: dict[str, _Request] = {}  # admitted or queued, by request id
        self._by_slot: dict[int, _Request] = {}
        self._stopping = False
        self._failed: str | None = None
        self._sessions: dict[str, _SessionHistory] = {}
        self._rates = _Rates()
        self._finished = collections.Counter()  # by finish reason
        self._eos_id = tokenizer.eos_id
        # The per-step counters as one tuple, replaced (never mutated) after each step so that
        # stats() on another thread reads a consistent set: steps, prompt tokens, generated
        # tokens, and the last step's decode and prompt rows.
        self._counts: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
        self._stats_dirty = True  # the set of lanes changed since the last full snapshot
        self._next_stats = 0.0  # monotonic time when the next snapshot is due regardless
        self._published = (StatsSnapshot.empty(runner.backend, runner.device, model_name), self._counts)
        # Streams with events pushed but their consumer not yet woken (see _wake_consumers).
        self._wake_due: dict[EventStream, None] = {}
        self._waker = _Waker()
        self._publish_stats()  # the pool, memory and limits are known before the first step
        self._thread = threading.Thread(target=self._run, name="ds4-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def open(cls, model: str | None = None, *, backend: str = "cpu", max_slots: int = 6, max_ctx: int = 4096,
             kv_pool_tokens: int | None = None, threads: int = 0, qat_numerics: bool | None = None,
             max_queue: int = 64, max_rows: int | None = None) -> "EngineService":
        """Load a model file (default: the embedded model) and start serving it.

        ``max_rows`` is the rows one engine step carries; None takes the backend's default (16 on
        cpu, 512 on cuda / hip) and with it the backend's step policy (``runner.default_limits``)."""
        from .default_model import resolve_model
        from .gguf_file import ModelFile
        from .runner import Runner
        from .tokenizer import Tokenizer

        mf = ModelFile.open(resolve_model(model))
        runner = Runner(mf, backend=backend, max_slots=max_slots, max_ctx=max_ctx, kv_pool_tokens=kv_pool_tokens,
                        max_rows=max_rows, n_threads=threads, qat_numerics=qat_numerics)
        tok = Tokenizer.from_metadata(mf.tokenizer_metadata)
        return cls(runner, tok, model_name=os.path.basename(mf.path), max_queue=max_queue)

    @classmethod
    def from_args(cls, args, *, max_queue: int = 64) -> "EngineService":
        """``open`` with the shared engine options of the command line (cli.add_engine_arguments)."""
        return cls.open(args.model, backend=args.backend, max_slots=args.max_slots, max_ctx=args.max_ctx,
                        kv_pool_tokens=args.kv_pool_tokens, threads=args.threads,
                        qat_numerics=args.qat_numerics, max_rows=args.max_rows,
                        max_queue=max_queue if getattr(args, "max_queue", None) is None else args.max_queue)

    def __enter__(self) -> "EngineService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the client interface
    def prompt_tokens(self, messages: Sequence[Message] | None, prompt: str | None,
                      thinking: bool = False) -> list[int]:
        """The token ids a request's prompt renders to."""
        if messages is not None:
            return encode_chat(list(messages), self.tokenizer, thinking=thinking)
        return [self.tokenizer.bos_id] + self.tokenizer.encode(prompt or "")

    def count_prompt_tokens(self, messages: Sequence[Message] | None, prompt: str | None,
                            thinking: bool = False) -> int:
        return len(self.prompt_tokens(messages, prompt, thinking))

    def submit(self, request: GenerationRequest) -> EventStream:
        """Queue a request. Raises InvalidRequest / ContextLengthExceeded / ExceedsPool when it can
        never run, QueueFull when the queue is at its bound, EngineUnavailable when stopping."""
        if request.messages is not None and not request.messages:
            raise InvalidRequest("messages is empty: send at least one message")
        if request.prompt is not None and not request.prompt:
            raise InvalidRequest("prompt is empty")
        tokens = self._session_prompt(request) or self.prompt_tokens(request.messages, request.prompt,
                                                                      request.thinking)
        n = len(tokens)
        if n > self.max_ctx:
            raise ContextLengthExceeded(f"prompt is {n} tokens, the context is {self.max_ctx}")
        if pages_for(n) > self.pool.n_pages:
            raise ExceedsPool(f"prompt of {n} tokens needs {pages_for(n)} pages; the pool has "
                              f"{self.pool.n_pages} (raise --kv-pool-tokens)")
        mt = request.sampling.max_tokens
        if mt is not None and pages_for(min(n + mt, self.max_ctx + 1)) > self.pool.n_pages:
            raise ExceedsPool(f"prompt ({n}) + max_tokens ({mt}) can never fit the page pool of "
                              f"{self.pool.n_pages * 128} tokens; lower max_tokens or raise --kv-pool-tokens")
        stream = EventStream(request.request_id, max_buffered=MAX_BUFFERED_EVENTS, on_overflow=self.cancel)
        r = _Request(req=request, prompt=tokens, stream=stream,
                     parser=ReplyParser(self.tokenizer, thinking=request.thinking),
                     stops=StopMatcher(request.sampling.stop), t_submit=time.monotonic())
        with self._lock:
            if self._stopping or self._failed:
                raise EngineUnavailable(self._failed or "the engine is stopping")
            # Requests the next loop turn admits into free (or idle, evictable) slots are not
            # waiting; the bound is on those beyond the slots.
            waiting = len(self._queue) - self.slots.n_free_slots - len(self.slots.idle())
            if waiting >= self.max_queue:
                raise QueueFull(f"{max(waiting, 0)} requests are waiting (the queue holds "
                                f"{self.max_queue}); retry later")
            self._queue.append(r)
            self._live[request.request_id] = r
            self._wake.notify()
        return stream

    def _session_prompt(self, request: GenerationRequest) -> list[int] | None:
        """The tokens of a session's next turn when it continues the last one exactly (chat mode):
        the last turn's tokens, EOS if the reply did not end with it, then the new messages."""
        h = self._sessions.get(request.session) if request.session else None
        msgs = request.messages
        if h is None or msgs is None or request.thinking:
            return None
        k = len(h.messages)
        if len(msgs) <= k + 1 or msgs[:k] != h.messages:
            return None
        reply = msgs[k]
        if reply.role != "assistant" or reply.content != h.reply:
            return None
        head = render_chat(msgs[: k + 1], thinking=False)
        full = render_chat(msgs, thinking=False)
        if not full.startswith(head):
            return None
        eos = self.tokenizer.eos_id
        return list(h.tokens) + ([] if h.tokens[-1] == eos else [eos]) + self.tokenizer.encode(full[len(head):])

    def cancel(self, request_id: str) -> None:
        """Retire the request before the next step; its stream ends with finish_reason "cancelled"."""
        with self._lock:
            if request_id in self._live:
                self._cancels.add(request_id)
                self._wake.notify()

    def forget_session(self, session: str) -> None:
        """Drop a chat session (its tab closed): its resident slot is freed before the next step."""
        with self._lock:
            self._forget.add(session)
            self._wake.notify()

    def stats(self) -> StatsSnapshot:
        """The last full snapshot (at most STATS_INTERVAL old, and current after any change to
        the set of lanes), with the step counters and the last step's composition as of now."""
        snap, counts = self._published
        live = self._counts  # read after _published: never older than the snapshot's own counts
        if live is counts:
            return snap
        steps, prompt, generated, decode_rows, prompt_rows = live
        return dataclasses.replace(snap, steps=steps, prompt_tokens_total=prompt,
                                   generation_tokens_total=generated, step_decode_rows=decode_rows,
                                   step_prompt_rows=prompt_rows)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still running end with finish_reason "cancelled"."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._has_work():
                        self._wake.wait(0.5)
                    if self._stopping:
                        break
                    cancels, self._cancels = self._cancels, set()
                    forget, self._forget = self._forget, set()
                if cancels:
                    self._apply_cancels(cancels)
                if forget:
                    self._apply_forget(forget)
                self._admit()
                self._step()
                if not self._by_slot:  # no step follows at once: wake whoever has events now
                    self._wake_consumers()
                self._maybe_publish_stats()
        except Exception as e:  # noqa: BLE001 - a broken loop must fail every request, not hang them
            log.exception("engine loop failed")
            with self._lock:
                self._failed = f"engine failed: {e}"
        finally:
            for r in list(self._live.values()):
                self._finish(r, "error" if self._failed else "cancelled", self._failed)
            self._wake_consumers()
            self._waker.close()
            self._publish_stats()

    def _has_work(self) -> bool:
        return bool(self._queue or self._cancels or self._forget or self._by_slot)

    def _apply_cancels(self, ids: set[str]) -> None:
        for rid in ids:
            r = self._live.get(rid)
            if r is not None:
                self._finish(r, "cancelled")

    def _apply_forget(self, sessions: set[str]) -> None:
        for session in sessions:
            self._sessions.pop(session, None)
            slot = self.slots.find_session(session)
            if slot is not None:
                self.slots.retire(slot)
                self._stats_dirty = True

    def _admit(self) -> None:
        """Admit queued requests in FIFO order while slots and pages allow."""
        if not self._queue:  # an unlocked peek: a request queued just after it waits one step
            return
        while True:
            # The slot is taken and the request leaves the queue under one lock: submit's count of
            # waiting requests (queue minus free slots) never sees the one without the other.
            with self._lock:
                if not self._queue:
                    return
                r = self._queue[0]
                try:
                    self._admit_one(r)
                    error = None
                except Busy:
                    return
                except (AdmissionError, ValueError) as e:
                    error = str(e)
                self._queue.popleft()
            if error is not None:
                self._finish(r, "error", error)
                continue
            r.t_admit = r.t_admit or time.monotonic()
            self._by_slot[r.slot] = r
            self._stats_dirty = True

    def _admit_one(self, r: _Request) -> None:
        sm, req = self.slots, r.req
        if r.recompute is not None:  # a preempted request: its tokens so far are the prompt
            p = r.recompute
            r.slot = sm.admit(req.request_id, p.tokens, p.sampler, max_new_tokens=p.max_new_tokens,
                              session_id=req.session, rng=p.rng)
            self.runner.reset_slot(r.slot)
            r.recompute = None
            return
        resident = sm.find_session(req.session) if req.session else None
        if resident is not None:
            have = sm.slot(resident).tokens
            if len(have) < len(r.prompt) and r.prompt[: len(have)] == have:
                sm.resume(resident, r.prompt[len(have):], req.request_id, req.sampling)
                r.slot, r.cached = resident, sm.slot(resident).n_computed
                return
            sm.retire(resident)  # the conversation changed under it: recompute from scratch
            sm.n_evictions += 1
        r.slot = sm.admit(req.request_id, r.prompt, req.sampling, session_id=req.session)
        self.runner.reset_slot(r.slot)

    def _step(self) -> None:
        if not self._by_slot:
            return
        step = self.scheduler.schedule()
        if step.evicted or step.preempted:
            self._stats_dirty = True
        for p in step.preempted:
            r = self._live.get(p.request_id)
            if r is not None:
                self._by_slot.pop(r.slot, None)
                r.slot, r.recompute = None, p
                with self._lock:
                    self._queue.appendleft(r)
        if step.is_empty:
            self._retire_stalled()
            self._wake_consumers()
            return
        plan = step.plan
        logit_slots = step.logit_slots
        get_slot = self.slots.slot
        ran = [get_slot(slot) for slot in logit_slots]
        # All plain greedy (temperature 0, no penalty): the runner's argmax is sample_rows' token
        # (np.argmax's rule), and a GPU backend then copies tokens back instead of logits.
        greedy = all(s.sampler.argmax_only for s in ran)
        self._wake_consumers()
        try:
            if greedy:
                tokens = self.runner.step_argmax(plan).tolist()
            else:
                logits = self.runner.step(plan)
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving the others
            log.exception("engine step failed")
            for slot in step.rows:
                r = self._by_slot.get(slot)
                if r is not None:
                    self._finish(r, "error", f"engine step failed: {e}")
            return
        now = time.monotonic()
        if not greedy:
            tokens = sample_rows(logits, [s.sampler for s in ran], [s.rng for s in ran],
                                 [s.history for s in ran])
        sampled = dict(zip(logit_slots, tokens))
        n_decode = step.n_decode_rows
        n_prompt = plan.n_lanes - n_decode
        done = self.scheduler.commit(step, sampled)
        by_slot = self._by_slot
        got = [(r, tok) for slot, tok in sampled.items() if (r := by_slot.get(slot)) is not None]
        steps, prompt_total, generated, _, _ = self._counts
        self._counts = (steps + 1, prompt_total + n_prompt, generated + len(got), n_decode, n_prompt)
        # Every token is counted before any request finishes: finishing forgets the lane's rate.
        self._rates.tokens(now, [r.slot for r, _ in got])
        for r, tok in got:
            self._on_token(r, tok, now, length_done=r.slot in done)

    def _retire_stalled(self) -> None:
        """Running slots with nothing left to compute (a request at its length limit)."""
        for slot, r in list(self._by_slot.items()):
            s = self.slots.get(slot)
            if s is not None and s.length_done:
                self._finish(r, "length")

    def _on_token(self, r: _Request, tok: int, now: float, *, length_done: bool) -> None:
        """Stream one generated token of ``r`` (already counted in the rates) and finish the
        request at EOS, a stop string or its length limit."""
        if not r.generated:
            r.t_first = now
            self._rates.ttft(now - r.t_submit)
            self._stats_dirty = True  # the lane goes from prefill to decode
        r.generated.append(tok)
        r.t_last = now
        if tok == self._eos_id and not r.req.sampling.ignore_eos:
            self._flush_parser(r)
            self._finish(r, "stop")
            return
        for d in r.parser.feed(tok):
            if not self._emit(r, d):
                self._finish(r, "stop")
                return
        if length_done:
            self._flush_parser(r)
            self._finish(r, "length")

    def _emit(self, r: _Request, d: Delta) -> bool:
        """Stream a delta (content passes the stop-string matcher); False once a stop matched."""
        if d.kind == "content":
            text, stopped = r.stops.feed(d.text)
            if text:
                r.content.append(text)
                self._push(r, d if text is d.text else Delta("content", text))
            return not stopped
        self._push(r, d)
        return True

    def _flush_parser(self, r: _Request) -> None:
        for d in r.parser.finish():
            if not self._emit(r, d):
                return
        tail = r.stops.flush()
        if tail:
            r.content.append(tail)
            self._push(r, Delta("content", tail))

    def _finish(self, r: _Request, reason: str, error: str | None = None) -> None:
        """End a request: free or park its slot, send the Finished event (exactly once)."""
        if r.finished:
            return
        r.finished = True
        self._stats_dirty = True
        with self._lock:
            self._live.pop(r.req.request_id, None)
            try:
                self._queue.remove(r)
            except ValueError:
                pass
        if r.slot is not None and self._by_slot.get(r.slot) is r:
            del self._by_slot[r.slot]
            self._rates.forget(r.slot)
            s = self.slots.get(r.slot)
            if s is not None:
                if r.req.session and reason in ("stop", "length") and s.state is SlotState.RUNNING:
                    self._remember_session(r, s.tokens)
                    self.slots.park(r.slot, r.req.session)
                else:
                    self.slots.retire(r.slot)
        now = time.monotonic()
        first = r.t_first or now
        usage = Usage(prompt_tokens=len(r.prompt), completion_tokens=len(r.generated), cached_tokens=r.cached,
                      queue_s=(r.t_admit or now) - r.t_submit, ttft_s=(r.t_first - r.t_submit) if r.t_first else 0.0,
                      prefill_s=first - (r.t_admit or first), decode_s=(r.t_last - r.t_first) if r.t_first else 0.0,
                      total_s=now - r.t_submit)
        self._finished[reason] += 1
        self._push(r, Finished(finish_reason=reason, usage=usage, tokens=tuple(r.generated), error=error))

    def _push(self, r: _Request, ev: Delta | Finished) -> None:
        """Queue an event on the request's stream; its consumer is woken by _wake_consumers."""
        r.stream.push(ev, wake=False)
        self._wake_due[r.stream] = None

    def _wake_consumers(self) -> None:
        """Wake the consumers of the events pushed since the last call.

        Called just before the native step (which releases the GIL) or when no step follows.
        A consumer woken earlier would wait for the GIL, take it at the engine thread's next
        release (a numpy call) and make the engine thread wait until it is done: measured
        ~40 µs of a C6 step on the 2-core machine. Woken here, it runs during the native step.
        """
        if self._wake_due:
            due, self._wake_due = self._wake_due, {}
            if len(due) == 1 or self._stopping:
                for stream in due:
                    stream.wake()
            else:
                self._waker.wake(list(due))

    def _remember_session(self, r: _Request, tokens: list[int]) -> None:
        """Keep the turn's tokens for the session's next turn, unless a stop string cut the reply
        (the tokens would then hold text the conversation never shows)."""
        if r.req.messages is None or r.stops.stopped:
            self._sessions.pop(r.req.session, None)
            return
        self._sessions[r.req.session] = _SessionHistory(
            messages=r.req.messages, reply="".join(r.content), tokens=tuple(tokens))

    # ------------------------------------------------------------------ stats
    def _maybe_publish_stats(self) -> None:
        """Publish a full snapshot when the lanes changed, when one is due, or before idling."""
        now = time.monotonic()
        if (self._stats_dirty or now >= self._next_stats or not self._by_slot
                or len(self._queue) != self._published[0].queue_len):
            self._publish_stats(now)

    def _publish_stats(self, now: float | None = None) -> None:
        if now is None:
            now = time.monotonic()
        self._stats_dirty = False
        self._next_stats = now + STATS_INTERVAL
        counts = self._counts
        lanes: list[LaneStats] = []
        for slot in range(self.max_slots):
            s = self.slots.get(slot)
            if s is None:
                continue
            r = self._by_slot.get(slot)
            if s.state is SlotState.IDLE:
                state = "resident"
            else:
                state = "decode" if s.n_pending <= 1 else "prefill"
            lanes.append(LaneStats(slot=slot, request_id=r.req.request_id if r else None,
                                   session=s.session_id or (r.req.session if r else None), state=state,
                                   position=s.n_computed, context=len(s.tokens), pages=len(s.block_table),
                                   tok_s=self._rates.lane_rate(slot, now) if state == "decode" else 0.0))
        with self._lock:
            queued = list(self._queue)
        for r in queued:
            lanes.append(LaneStats(slot=None, request_id=r.req.request_id, session=r.req.session, state="queued",
                                   position=0, context=len(r.prompt), pages=0, tok_s=0.0))
        pool = PoolStats(n_pages=self.pool.n_pages, used=self.pool.n_used, reserved=self.pool.n_reserved,
                         free=self.pool.n_free, evictions=self.slots.n_evictions,
                         preemptions=self.slots.n_preemptions)
        steps, prompt_total, generated, decode_rows, prompt_rows = counts
        mem = getattr(self.runner, "memory_plan", None)
        lim = self.scheduler.limits  # what the scheduler plans with, not StepLimits' defaults
        snap = StatsSnapshot(
            time=time.time(), lanes=tuple(lanes), pool=pool, queue_len=len(queued),
            n_running=sum(1 for x in lanes if x.state in ("decode", "prefill")),
            agg_tok_s=self._rates.agg_rate(now), tok_s_history=self._rates.history(now),
            ttft_recent=tuple(self._rates.ttfts), step_decode_rows=decode_rows,
            step_prompt_rows=prompt_rows, steps=steps, prompt_tokens_total=prompt_total,
            generation_tokens_total=generated, requests_finished=sum(self._finished.values()),
            backend=self.runner.backend, device=self.runner.device, model=self.model_name,
            memory=tuple(mem.sections.items()) if mem is not None else (), max_slots=self.max_slots,
            max_ctx=self.max_ctx, max_rows=lim.max_rows, max_seqs=lim.max_seqs,
            rows_per_prompt=lim.rows_per_prompt, lone_prompt_rows=lim.lone_prompt_rows,
            finished_by_reason=tuple(sorted(self._finished.items())))
        self._published = (snap, counts)


class _Waker:
    """A thread that wakes the consumers of a step's streams for the engine thread.

    Waking a sleeping thread costs the waker about 10 µs on the 2-core machine (the woken
    thread preempts it, then blocks on the GIL); the engine thread pays that once here instead
    of once per stream, and this thread does the rest while the native step runs.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._due: list[EventStream] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ds4-waker", daemon=True)
        self._thread.start()

    def wake(self, streams: list[EventStream]) -> None:
        """Have ``stream.wake()`` called for each of ``streams`` on this thread, in order."""
        with self._cond:
            self._due.extend(streams)
            self._cond.notify()

    def close(self) -> None:
        """Wake what is still due, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due and not self._closed:
                    self._cond.wait()
                due, self._due = self._due, []
            for stream in due:
                stream.wake()
            if not due:
                return


class _Rates:
    """Token timestamps for tok/s figures: per lane, aggregate, and one point a second.

    Tokens are recorded every step and queried at every snapshot, so each call is O(1) amortized:
    each deque holds only the last WINDOW seconds and is trimmed as it is read or written.
    """

    WINDOW = 5.0

    def __init__(self) -> None:
        self.recent: collections.deque[float] = collections.deque()
        self.lanes: dict[int | None, collections.deque[float]] = {}
        self.per_second: collections.deque[tuple[int, int]] = collections.deque(maxlen=60)
        self.ttfts: collections.deque[float] = collections.deque(maxlen=60)

    def _trim(self, d: collections.deque[float], now: float) -> collections.deque[float]:
        while d and d[0] < now - self.WINDOW:
            d.popleft()
        return d

    def tokens(self, now: float, slots: list[int | None]) -> None:
        """One step's tokens, all stamped ``now``: one per entry of ``slots`` (the lane of each)."""
        if not slots:
            return
        recent = self.recent
        recent.extend([now] * len(slots))
        self._trim(recent, now)
        lanes = self.lanes
        for slot in slots:
            d = lanes.get(slot)
            if d is None:
                lanes[slot] = d = collections.deque()
            else:
                self._trim(d, now)
            d.append(now)
        sec = int(now)
        if self.per_second and self.per_second[-1][0] == sec:
            self.per_second[-1] = (sec, self.per_second[-1][1] + len(slots))
        else:
            self.per_second.append((sec, len(slots)))

    def ttft(self, seconds: float) -> None:
        self.ttfts.append(seconds)

    def forget(self, slot: int | None) -> None:
        """The slot's request ended: its next occupant starts a rate of its own."""
        self.lanes.pop(slot, None)

    def agg_rate(self, now: float) -> float:
        return len(self._trim(self.recent, now)) / self.WINDOW

    def lane_rate(self, slot: int, now: float) -> float:
        ts = self._trim(self.lanes.get(slot, collections.deque()), now)
        if len(ts) < 2:
            return 0.0
        return (len(ts) - 1) / max(ts[-1] - ts[0], 1e-9)

    def history(self, now: float) -> tuple[float, ...]:
        """Tokens per second for each of the last 60 seconds (oldest first)."""
        counts = dict(self.per_second)
        sec = int(now)
        return tuple(float(counts.get(s, 0)) for s in range(sec - 59, sec + 1))


__all__ = ["EngineService", "EventStream"]
