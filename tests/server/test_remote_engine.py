"""RemoteEngine: the EngineClient interface over HTTP, against our server (on the scripted engine)
and against a server that only speaks plain OpenAI (a mock transport)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from ds4_app.engine.api import (ContextLengthExceeded, Delta, ExceedsPool, Finished, GenerationRequest,
                                InvalidRequest, QueueFull)
from ds4_app.engine.chat import Message
from ds4_app.engine.remote import RemoteEngine, RemoteError
from ds4_app.engine.sampling import SamplerConfig
from tests.server.utils import ServerPreset, running

MODEL = "fake-ds4.gguf"


@pytest.fixture(scope="module")
def server():
    yield from running(ServerPreset.fake())


@pytest.fixture
def engine(server):
    e = RemoteEngine(server.v1())
    yield e
    e.close()


def chat(text: str, **kw) -> GenerationRequest:
    return GenerationRequest(messages=(Message("user", text),), **kw)


def collect(handle) -> tuple[str, str, Finished]:
    parts = {"content": "", "reasoning": ""}
    for ev in handle.events(timeout=10):
        if isinstance(ev, Delta):
            parts[ev.kind] += ev.text
        else:
            return parts["content"], parts["reasoning"], ev
    raise AssertionError("no Finished event")


def test_chat_with_reasoning_blocking(engine):
    assert engine.model_name == MODEL
    content, reasoning, fin = collect(engine.submit(chat("hello remote", thinking=True)))
    assert (content, reasoning) == ("Echo: hello remote", "Thinking about it.")
    assert fin.finish_reason == "stop"
    assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (2, 6)
    assert fin.usage.ttft_s > 0 and fin.usage.total_s >= fin.usage.ttft_s


async def test_completion_async(engine):
    handle = engine.submit(GenerationRequest(prompt="a b c", sampling=SamplerConfig(max_tokens=10)))
    events = [ev async for ev in handle]
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "c b a"
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop"


def test_sampling_reaches_the_server(engine, server):
    s = SamplerConfig(temperature=0.5, top_k=20, top_p=0.8, min_p=0.1, repetition_penalty=1.2, seed=0,
                      max_tokens=3, stop=("never",), ignore_eos=True)
    content, _, fin = collect(engine.submit(chat("remote sampling", sampling=s)))
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == 3
    rec = [r for r in server.state()["submitted"] if r["messages"] and r["messages"][-1]["content"] ==
           "remote sampling"][-1]
    got = rec["sampling"]
    assert (got["temperature"], got["top_k"], got["top_p"], got["min_p"], got["repetition_penalty"]) == \
        (0.5, 20, 0.8, 0.1, 1.2)
    assert (got["seed"], got["max_tokens"], got["stop"], got["ignore_eos"]) == (0, 3, ["never"], True)
    assert rec["thinking"] is False


def test_cancel_closes_the_stream_and_the_server_cancels(engine, server):
    handle = engine.submit(chat('remote cancel !fake {"tokens": 2000, "interval": 0.005}'))
    it = handle.events(timeout=10)
    assert isinstance(next(it), Delta) and isinstance(next(it), Delta)
    engine.cancel(handle.request_id)
    rest = list(it)
    assert isinstance(rest[-1], Finished) and rest[-1].finish_reason == "cancelled"
    server_rid = [r for r in server.state()["submitted"] if r["messages"] and
                  "remote cancel" in r["messages"][-1]["content"]][-1]["request_id"]
    deadline = time.monotonic() + 3
    while server_rid not in server.state()["cancelled"]:
        assert time.monotonic() < deadline, "the server never cancelled the request"
        time.sleep(0.02)


def test_cancel_right_after_submit_still_finishes(engine):
    handle = engine.submit(chat("cancel at once"))
    engine.cancel(handle.request_id)
    events = list(handle.events(timeout=10))
    assert isinstance(events[-1], Finished) and events[-1].finish_reason in ("cancelled", "stop")


def test_admission_errors_surface_on_first_read(engine):
    with pytest.raises(ExceedsPool):
        list(engine.submit(chat("x", sampling=SamplerConfig(max_tokens=5000))).events(timeout=10))
    with pytest.raises(ContextLengthExceeded):
        list(engine.submit(chat(" ".join(["w"] * 600))).events(timeout=10))
    with pytest.raises(QueueFull):
        list(engine.submit(chat('!fake {"raise": "QueueFull"}')).events(timeout=10))


def test_stats_from_lanes_and_token_count(engine):
    handle = engine.submit(chat('remote lanes !fake {"tokens": 200, "interval": 0.005}'))
    it = handle.events(timeout=10)
    next(it)
    s = engine.stats()
    assert s.backend == "fake" and s.model == MODEL and s.max_slots == 6 and s.pool.n_pages == 32
    assert s.pool.evictions == 2 and s.memory == (("weights", 1024),)
    assert any(lane.state == "decode" for lane in s.lanes) and isinstance(s.lanes, tuple)
    engine.cancel(handle.request_id)
    list(it)
    assert engine.count_prompt_tokens([Message("user", "three little words")], None) == 3
    assert engine.count_prompt_tokens(None, "a b c d e") == 5


# --- a plain OpenAI server (no /v1/lanes, no timings): a mock transport ---------------------------


def plain_openai(request: httpx.Request) -> httpx.Response:
    if request.headers.get("authorization") != "Bearer k":
        return httpx.Response(401, json={"error": {"message": "no key", "type": "authentication_error"}})
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "other-model", "object": "model"}]})
    if request.url.path == "/v1/chat/completions":
        body = json.loads(request.content)
        if body.get("temperature", 0) > 1:
            return httpx.Response(400, json={"error": {"message": "temperature too high", "type": "BadRequest"}})
        if body["messages"][-1]["content"] == "locked":
            return httpx.Response(401, json={"error": {"message": "bad key", "type": "authentication_error"}})
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                  {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ": keep-alive\n\ndata: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})
    if request.url.path == "/v1/lanes":
        return httpx.Response(404, json={"detail": "Not Found"})
    return httpx.Response(500, text="unexpected")


def test_plain_openai_server_without_lanes():
    e = RemoteEngine("http://example.invalid", api_key="k", transport=httpx.MockTransport(plain_openai),
                     sync_transport=httpx.MockTransport(plain_openai))
    try:
        assert e.model_name == "other-model"
        content, reasoning, fin = collect(e.submit(chat("hi")))
        assert (content, reasoning, fin.finish_reason) == ("Hi!", "hmm", "stop")
        assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (7, 3)
        s = e.stats()  # no /v1/lanes: what the client itself knows
        assert (s.backend, s.device, s.model) == ("remote", "http://example.invalid", "other-model")
        assert s.requests_finished == 1 and s.prompt_tokens_total == 7 and s.generation_tokens_total == 3
        assert len(s.ttft_recent) == 1 and s.lanes == ()
        with pytest.raises(InvalidRequest, match="temperature too high"):
            list(e.submit(chat("hot", sampling=SamplerConfig(temperature=1.5))).events(timeout=10))
        with pytest.raises(RemoteError) as err:
            list(e.submit(chat("locked")).events(timeout=10))
        assert (err.value.http_status, err.value.error_type) == (401, "authentication_error")
        assert "bad key" in str(err.value)
    finally:
        e.close()
