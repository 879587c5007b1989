"""EngineService end to end on the tiny preset with the native CPU engine.

Exactness through the service, resident sessions, pressure (evictions and preemptions),
cancellation and admission errors. Every expected output is computed by running the same
request alone on a fresh service, never hard-coded.
"""

import time

import pytest

from ds4_app.engine.api import (ContextLengthExceeded, ExceedsPool, Finished, GenerationRequest,
                                InvalidRequest, QueueFull, Usage)
from ds4_app.engine.chat import Message
from ds4_app.engine.sampling import SamplerConfig
from ds4_app.engine.service import EngineService

PROMPTS = [
    "Hello there, how are you today?",
    "Tell me a story about the sea.",
    "What is two plus two?",
    "Name three colours.",
    "Why is the sky blue? Explain briefly, in words a child would understand.",
    "Write a line of verse.",
]


def make_service(model, **kw):
    from ds4_app.engine.runner import Runner
    from ds4_app.engine.tokenizer import Tokenizer

    opts = dict(max_slots=6, max_ctx=1024)
    opts.update({k: kw.pop(k) for k in list(kw) if k in ("max_slots", "max_ctx", "kv_pool_tokens", "max_rows")})
    runner = Runner(model, backend=kw.pop("backend", "cpu"), **opts)
    return EngineService(runner, Tokenizer.from_metadata(model.tokenizer_metadata), **kw)


def collect(stream, timeout=120):
    text, fin = [], None
    for ev in stream.events(timeout=timeout):
        if isinstance(ev, Finished):
            fin = ev
        elif ev.kind == "content":
            text.append(ev.text)
    return "".join(text), fin


def chat(prompt, **sampling):
    sampling.setdefault("max_tokens", 12)
    sampling.setdefault("ignore_eos", True)
    return GenerationRequest(messages=(Message("user", prompt),), sampling=SamplerConfig(**sampling))


@pytest.fixture(scope="module")
def solo_tokens(tiny_model):
    """Each prompt run alone (greedy and seeded sampling), on one service, one at a time."""
    out = {}
    with make_service(tiny_model) as svc:
        for p in PROMPTS:
            for mode, kw in (("greedy", {}), ("seeded", {"temperature": 0.9, "top_k": 40, "seed": 7})):
                out[(p, mode)] = collect(svc.submit(chat(p, **kw)))[1].tokens
    return out


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_six_concurrent_requests_match_solo(tiny_model, solo_tokens, mode):
    kw = {} if mode == "greedy" else {"temperature": 0.9, "top_k": 40, "seed": 7}
    with make_service(tiny_model) as svc:
        streams = [svc.submit(chat(p, **kw)) for p in PROMPTS]
        results = [collect(s)[1] for s in streams]
    for p, fin in zip(PROMPTS, results):
        assert fin.finish_reason == "length"
        assert fin.tokens == solo_tokens[(p, mode)], p


def two_turns(svc, between=None):
    """Turn 1 and turn 2 of session s1; ``between`` runs after turn 1 (e.g. to evict it)."""
    turn1 = [Message("user", "Hello, who are you?")]
    text1, fin1 = collect(svc.submit(GenerationRequest(messages=tuple(turn1), session="s1",
                                                       sampling=SamplerConfig(max_tokens=8))))
    if between:
        between(svc)
    turn2 = turn1 + [Message("assistant", text1), Message("user", "And what can you do?")]
    _, fin2 = collect(svc.submit(GenerationRequest(messages=tuple(turn2), session="s1",
                                                   sampling=SamplerConfig(max_tokens=8))))
    return fin1, fin2


def test_resident_session_prefills_only_new_tokens(tiny_model):
    with make_service(tiny_model, max_slots=1) as svc:
        fin1, fin2 = two_turns(svc, between=lambda s: (
            assert_resident(s), None))
    # Only the tokens after the resident prefix were prefilled: the whole first turn is cached.
    assert fin2.usage.cached_tokens == fin1.usage.prompt_tokens + fin1.usage.completion_tokens - 1
    assert fin2.usage.prompt_tokens > fin2.usage.cached_tokens

    # The same turns where the session is evicted in between: turn 2 prefills everything from
    # scratch (a fresh full-prompt run over the same tokens) and gives the same reply.
    def evict(s):
        collect(s.submit(chat("something else", max_tokens=2)))  # needs the only slot
        assert s.stats().pool.evictions == 1

    with make_service(tiny_model, max_slots=1) as svc:
        fresh1, fresh2 = two_turns(svc, between=evict)
    assert fresh2.usage.cached_tokens == 0
    assert fresh2.usage.prompt_tokens == fin2.usage.prompt_tokens
    assert fresh2.tokens == fin2.tokens and fresh1.tokens == fin1.tokens


def assert_resident(svc):
    lanes = svc.stats().lanes
    assert [lane.state for lane in lanes] == ["resident"] and lanes[0].session == "s1"


def test_forget_session_frees_its_slot(tiny_model):
    with make_service(tiny_model) as svc:
        collect(svc.submit(GenerationRequest(messages=(Message("user", "hi"),), session="gone",
                                             sampling=SamplerConfig(max_tokens=3))))
        assert_resident_count = sum(1 for lane in svc.stats().lanes if lane.state == "resident")
        assert assert_resident_count == 1
        svc.forget_session("gone")
        assert wait_until(lambda: not svc.stats().lanes and svc.stats().pool.used == 0)


def test_pressure_twenty_requests_on_a_small_pool(tiny_model):
    """20 requests on a pool that holds 3 at a time (6 pages; a request holds its prompt page and
    one page of headroom). Every other one names a session, so finished turns stay resident until
    pressure evicts them; every fourth generates 300 tokens, growing to 3 pages, so decoders run
    out of headroom and the newest is preempted and recomputed. All complete with the tokens they
    give alone, and the pool is whole afterwards."""
    def spec(i):
        return PROMPTS[i % len(PROMPTS)], (300 if i % 4 == 0 else 12)

    solo = {}
    with make_service(tiny_model) as svc:
        for i in range(20):
            p, n = spec(i)
            if (p, n) not in solo:
                solo[(p, n)] = collect(svc.submit(chat(p, max_tokens=n)))[1].tokens
    with make_service(tiny_model, max_slots=6, max_ctx=1024, kv_pool_tokens=6 * 128, max_queue=64) as svc:
        streams = []
        for i in range(20):
            p, n = spec(i)
            req = chat(p, max_tokens=n)
            if i % 2 == 0:
                req = GenerationRequest(messages=req.messages, sampling=req.sampling, session=f"s{i}")
            streams.append((spec(i), svc.submit(req)))
        results = [(key, collect(s)[1]) for key, s in streams]
        assert wait_until(lambda: svc.stats().n_running == 0)
        st = svc.stats()
    for key, fin in results:
        assert fin.finish_reason == "length", fin.error
        assert fin.tokens == solo[key], key
    assert st.pool.evictions >= 1 and st.pool.preemptions >= 1
    assert st.requests_finished == 20
    resident = [lane for lane in st.lanes if lane.state == "resident"]
    assert st.pool.used == sum(lane.pages for lane in resident) and st.pool.reserved == 0


def test_pressure_evicts_resident_sessions(tiny_model):
    with make_service(tiny_model, max_slots=4, max_ctx=1024, kv_pool_tokens=4 * 128) as svc:
        for i in range(3):
            collect(svc.submit(GenerationRequest(messages=(Message("user", f"session {i}"),), session=f"s{i}",
                                                 sampling=SamplerConfig(max_tokens=4))))
        assert sum(1 for lane in svc.stats().lanes if lane.state == "resident") == 3
        long_prompt = "word " * 130  # about 3 pages: parked sessions must make room
        _, fin = collect(svc.submit(chat(long_prompt, max_tokens=4)))
        assert fin.finish_reason == "length"
        st = svc.stats()
    assert st.pool.evictions >= 1


def test_preemption_recomputes_exactly(tiny_model):
    """Three long generations on a pool too small for all: the newest is preempted, parked and
    recomputed, and every output still equals its solo run."""
    prompts = PROMPTS[:3]
    with make_service(tiny_model) as svc:
        solo = [collect(svc.submit(chat(p, max_tokens=300)))[1].tokens for p in prompts]
    with make_service(tiny_model, max_slots=3, max_ctx=1024, kv_pool_tokens=7 * 128) as svc:
        results = [collect(s)[1] for s in [svc.submit(chat(p, max_tokens=300)) for p in prompts]]
        st = svc.stats()
    assert st.pool.preemptions >= 1
    assert [r.tokens for r in results] == solo


def wait_until(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_cancel_frees_slot_and_pages(tiny_model, phase):
    # One row a step, so the prompt's prefill spans a few hundred steps: on a fast engine a
    # 16-row-a-step prefill of this prompt can end between two polls of the lane states.
    with make_service(tiny_model, max_slots=2, max_rows=1 if phase == "prefill" else 16) as svc:
        prompt = "long " * 200 if phase == "prefill" else "hi"
        stream = svc.submit(chat(prompt, max_tokens=500))
        assert wait_until(lambda: any(lane.state == phase for lane in svc.stats().lanes))
        steps_before = svc.stats().steps
        svc.cancel(stream.request_id)
        _, fin = collect(stream)
        assert fin.finish_reason == "cancelled"
        assert wait_until(lambda: not svc.stats().lanes)
        st = svc.stats()
        assert st.steps <= steps_before + 2
        assert st.pool.used == 0 and st.pool.reserved == 0


def test_admission_errors(tiny_model):
    with make_service(tiny_model, max_slots=1, max_ctx=256, kv_pool_tokens=256, max_queue=1) as svc:
        with pytest.raises(InvalidRequest):
            svc.submit(GenerationRequest(messages=()))
        with pytest.raises(ContextLengthExceeded):
            svc.submit(chat("word " * 400))
        with pytest.raises(ExceedsPool):
            svc.submit(chat("hi", max_tokens=10_000))
        first = svc.submit(chat("hi", max_tokens=200, ignore_eos=True))
        assert wait_until(lambda: svc.stats().n_running == 1)
        second = svc.submit(chat("hi", max_tokens=4))  # waits: the one slot is busy
        with pytest.raises(QueueFull):
            svc.submit(chat("hi", max_tokens=4))
        svc.cancel(first.request_id)
        assert collect(second)[1].finish_reason == "length"


def test_a_burst_fills_free_slots_before_the_queue_bound(tiny_model):
    """Eight requests at once into an idle six-slot engine with a queue of two: all are taken
    (six run, two wait); the ninth is refused."""
    with make_service(tiny_model, max_slots=6, max_queue=2) as svc:
        streams = [svc.submit(chat(p, max_tokens=50)) for p in PROMPTS + PROMPTS[:2]]
        with pytest.raises(QueueFull):
            svc.submit(chat("one too many", max_tokens=2))
        assert all(collect(s)[1].finish_reason == "length" for s in streams)


def test_stats_step_counters_are_live_and_the_final_snapshot_is_exact(tiny_model):
    """Full snapshots are published when the lanes change or every few ms; the step counters
    are current on every read, and once the engine is idle the snapshot is exact."""
    with make_service(tiny_model, max_slots=2) as svc:
        long = svc.submit(chat(PROMPTS[0], max_tokens=600))
        assert wait_until(lambda: any(lane.state == "decode" for lane in svc.stats().lanes))
        s1 = svc.stats()
        time.sleep(0.05)
        s2 = svc.stats()
        assert s2.steps > s1.steps and s2.generation_tokens_total > s1.generation_tokens_total
        assert s2.lanes[0].position > s1.lanes[0].position  # a newer full snapshot, not only counters
        short = [svc.submit(chat(p, max_tokens=n)) for p, n in ((PROMPTS[1], 5), (PROMPTS[2], 9))]
        fins = [collect(s)[1] for s in short]
        svc.cancel(long.request_id)
        fins.append(collect(long)[1])
        assert wait_until(lambda: not svc.stats().lanes)
        st = svc.stats()
    assert [f.finish_reason for f in fins] == ["length", "length", "cancelled"]
    assert st.generation_tokens_total == sum(f.usage.completion_tokens for f in fins)
    assert st.prompt_tokens_total == sum(f.usage.prompt_tokens for f in fins)
    assert st.requests_finished == 3 and st.finished_by_reason == (("cancelled", 1), ("length", 2))
    assert st.n_running == 0 and st.queue_len == 0 and st.pool.used == 0


def test_a_stream_pushed_without_wake_reaches_its_consumer_only_on_wake():
    """The service queues a step's events with wake=False and wakes their consumers together;
    the events are there at once for a reader that looks, and a sleeping reader wakes on wake()."""
    import asyncio
    import threading

    from ds4_app.engine.chat import Delta
    from ds4_app.engine.stream import EventStream

    stream = EventStream("r")
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(stream.events(timeout=10)))
    reader.start()
    time.sleep(0.05)  # the reader is asleep on the empty buffer
    stream.push(Delta("content", "a"), wake=False)
    time.sleep(0.05)
    assert got == []  # not woken: nothing notified it
    stream.wake()
    assert wait_until(lambda: got == [Delta("content", "a")], timeout=5)
    stream.push(Finished(finish_reason="stop", usage=Usage(1, 1)), wake=False)
    stream.wake()
    reader.join(5)
    assert not reader.is_alive() and len(got) == 2

    async def main() -> list:
        s = EventStream("r2")
        seen: list = []

        async def consume() -> None:
            async for ev in s:
                seen.append(ev)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.02)
        s.push(Delta("content", "b"), wake=False)
        await asyncio.sleep(0.05)
        assert seen == []
        await asyncio.to_thread(s.wake)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert seen == [Delta("content", "b")]
        s.push(Finished(finish_reason="stop", usage=Usage(1, 1)))
        await asyncio.wait_for(task, 5)
        return seen

    evs = asyncio.run(main())
    assert evs[0] == Delta("content", "b") and isinstance(evs[1], Finished)


@pytest.mark.parametrize("mode", [{}, {"temperature": 0.9, "top_k": 40, "seed": 7}], ids=["greedy", "seeded"])
def test_max_rows_sets_the_rows_a_lone_prompt_prefills_a_step(tiny_model_path, mode):
    """EngineService.open(max_rows=32): the stats show the limits in force, a lone prompt of ~100
    tokens takes 32 rows a step (so ceil(n/32) prefill steps, the last one sampling the first
    token, then one step per further token), and the reply is the one 16 rows a step gives."""
    text = "The lighthouse stood on a shelf of dark rock where the bay opened to the sea. " * 3
    request = GenerationRequest(prompt=text, sampling=SamplerConfig(max_tokens=12, ignore_eos=True, **mode))
    runs = {}
    for rows in (None, 32):
        with EngineService.open(tiny_model_path, max_slots=2, max_ctx=1024, max_rows=rows) as svc:
            got, fin = collect(svc.submit(request))
            assert wait_until(lambda: not svc.stats().lanes)
            runs[rows] = (got, fin, svc.stats())
    for rows, want in ((None, 16), (32, 32)):
        got, fin, st = runs[rows]
        n = fin.usage.prompt_tokens
        assert 90 <= n <= 120 and fin.finish_reason == "length"
        assert (st.max_rows, st.max_seqs, st.rows_per_prompt, st.lone_prompt_rows) == (want, 6, 4, want)
        assert st.prompt_tokens_total == n
        assert st.steps == -(-n // want) + 12 - 1
    assert runs[None][1].tokens == runs[32][1].tokens and runs[None][0] == runs[32][0]


def test_from_args_takes_max_rows_or_the_backends_default(tiny_model_path):
    from ds4_app.cli import build_parser

    for argv, rows in (([], 16), (["--max-rows", "24"], 24)):
        args = build_parser().parse_args(["--model", tiny_model_path, "--max-slots", "1", "--max-ctx", "256", *argv])
        with EngineService.from_args(args) as svc:
            assert svc.runner.max_rows == rows and svc.scheduler.limits.max_rows == rows
            assert (svc.stats().max_rows, svc.stats().lone_prompt_rows) == (rows, rows)
