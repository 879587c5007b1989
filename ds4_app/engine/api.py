"""The engine's public surface: requests, streamed events, stats snapshots and errors.

Every front end (TUI, server, bench) talks to an ``EngineClient``: the embedded
``EngineService`` implements it in-process, and ``RemoteEngine`` implements it over any
OpenAI-compatible HTTP server. Nothing here imports a front end or the native engine.

Events of one request, in order: any number of ``Delta`` (content or reasoning text), then
exactly one ``Finished`` (with usage and timings). A request that fails after admission still
ends with a ``Finished`` whose finish_reason is "error"; it never takes others down.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Literal, Protocol, Sequence

from .chat import Delta, Message  # Delta: a piece of streamed text, content or reasoning
from .sampling import SamplerConfig

_ids = itertools.count(1)


def new_request_id() -> str:
    """A process-unique request id (``req-<n>``)."""
    return f"req-{next(_ids)}"


# --- errors ---------------------------------------------------------------------------------


class ServiceError(Exception):
    """Base of the errors submit() raises before a request is admitted (one line each)."""

    http_status = 500
    error_type = "server_error"


class InvalidRequest(ServiceError):
    """The request itself is wrong (empty prompt, bad settings): HTTP 400."""

    http_status = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt (plus max_tokens where it matters) is longer than the context: HTTP 400."""

    error_type = "exceed_context_size_error"


class ExceedsPool(InvalidRequest):
    """Prompt + max_tokens can never fit the page pool, whatever else runs: HTTP 400."""

    error_type = "exceed_pool_error"


class QueueFull(ServiceError):
    """The waiting queue is at its bound: HTTP 503 with Retry-After."""

    http_status = 503
    error_type = "unavailable_error"


class EngineUnavailable(ServiceError):
    """The engine is loading, stopping or has failed: HTTP 503."""

    http_status = 503
    error_type = "unavailable_error"


# --- requests and events --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation. Exactly one of ``messages`` (chat) or ``prompt`` (raw text) is set.

    ``session`` names a resident chat session: its slot stays resident after the turn, and the
    next turn of the same session prefills only the tokens it adds.
    """

    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    sampling: SamplerConfig = field(default_factory=SamplerConfig)
    thinking: bool = False
    session: str | None = None
    request_id: str = field(default_factory=new_request_id)

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise InvalidRequest("a request needs exactly one of messages or prompt")


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts and timings of a finished request (seconds; rates in tokens/s)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        """Decode rate after the first token: (completion - 1) / decode time."""
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 and self.completion_tokens > 1 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        new = self.prompt_tokens - self.cached_tokens
        return new / self.prefill_s if self.prefill_s > 0 else 0.0


FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a request."""

    finish_reason: FinishReason
    usage: Usage
    tokens: tuple[int, ...] = ()
    error: str | None = None


Event = Delta | Finished


class RequestHandle(Protocol):
    """What submit() returns: an async (and a blocking) iterator over the request's events."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[Event]: ...

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking iteration, for threads and scripts (CLI generate, bench workers)."""
        ...


# --- stats ----------------------------------------------------------------------------------

LaneState = Literal["queued", "prefill", "decode", "resident"]


@dataclass(frozen=True, slots=True)
class LaneStats:
    """One slot (or queued request) as the panel shows it."""

    slot: int | None  # None while queued
    request_id: str | None
    session: str | None
    state: LaneState
    position: int  # tokens whose state the engine holds
    context: int  # prompt + generated tokens so far (or the queued prompt length)
    pages: int
    tok_s: float


@dataclass(frozen=True, slots=True)
class PoolStats:
    """The shared page pool."""

    n_pages: int
    used: int
    reserved: int
    free: int
    evictions: int = 0
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """An immutable picture of the engine, cheap to take (the panel reads it up to 10×/s).

    Freshness (EngineService): the lanes, pool, rates and queue are those of the last full
    snapshot, published whenever the set of lanes changes (admission, first token, finish, cancel,
    eviction, preemption, the queue) and otherwise every 10 ms; the step counters are overlaid live,
    so a read is at most the step in flight behind.
    """

    time: float
    lanes: tuple[LaneStats, ...]
    pool: PoolStats
    queue_len: int
    n_running: int
    agg_tok_s: float  # generated tokens/s over the last few seconds
    tok_s_history: tuple[float, ...]  # one point per second, last minute
    ttft_recent: tuple[float, ...]  # seconds, most recent last
    step_decode_rows: int  # composition of the last step
    step_prompt_rows: int
    steps: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished: int
    backend: str
    device: str
    model: str
    memory: tuple[tuple[str, int], ...] = ()
    max_slots: int = 0
    max_ctx: int = 0
    # The step limits in force (the runner's StepLimits; 0 where unknown, e.g. a remote engine):
    # rows a step, sequences a step, rows of a prompt beside others, rows of a lone prompt.
    max_rows: int = 0
    max_seqs: int = 0
    rows_per_prompt: int = 0
    lone_prompt_rows: int = 0
    finished_by_reason: tuple[tuple[str, int], ...] = ()  # (finish_reason, count) since start

    @staticmethod
    def empty(backend: str = "", device: str = "", model: str = "") -> "StatsSnapshot":
        return StatsSnapshot(time=time.time(), lanes=(), pool=PoolStats(0, 0, 0, 0), queue_len=0, n_running=0,
                             agg_tok_s=0.0, tok_s_history=(), ttft_recent=(), step_decode_rows=0,
                             step_prompt_rows=0, steps=0, prompt_tokens_total=0, generation_tokens_total=0,
                             requests_finished=0, backend=backend, device=device, model=model)


class EngineClient(Protocol):
    """The interface every front end uses; thread-safe."""

    model_name: str

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises a ServiceError subclass at once if it can never run."""
        ...

    def cancel(self, request_id: str) -> None:
        """Retire the request before the next step (no-op if already finished)."""
        ...

    def stats(self) -> StatsSnapshot:
        """The engine now (see StatsSnapshot for how fresh each part is)."""
        ...

    def count_prompt_tokens(self, messages: Sequence[Message] | None, prompt: str | None,
                            thinking: bool = False) -> int:
        """Tokens the prompt will take (for validation and usage)."""
        ...

    def close(self) -> None: ...
