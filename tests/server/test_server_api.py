"""Black-box tests of the OpenAI-compatible routes: a real server process, the official client
and raw HTTP. The engine behind it is scripted (tests/server/fake_engine.py), so answers are exact."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from tests.server.utils import ServerPreset, metric_value, running, sse_lines

MODEL = "fake-ds4.gguf"
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


@pytest.fixture(scope="module")
def server():
    # keep-alive every 0.2 s so the test of silent prefill is quick; max_ctx 512 words.
    yield from running(ServerPreset.fake("--keepalive", "0.2", "--max-slots", "8", "--max-queue", "16"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1(), api_key="sk-unused", max_retries=0, timeout=20)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def submitted(server, marker: str) -> dict:
    """The fake engine's record of the request whose last message contains ``marker``."""
    for rec in reversed(server.state()["submitted"]):
        text = rec["messages"][-1]["content"] if rec["messages"] else rec["prompt"]
        if marker in text:
            return rec
    raise AssertionError(f"no submitted request contains {marker!r}")


def wait_cancelled(server, request_id: str, timeout: float = 3.0) -> float:
    """Seconds until the engine saw cancel(request_id); fails after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if request_id in server.state()["cancelled"]:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"{request_id} was not cancelled within {timeout} s")


# --- happy paths with the official client -----------------------------------------------------


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=user("hello there"))
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "Echo: hello there"
    assert choice.finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (2, 3, 5)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    timings = r.usage.model_extra["timings"]
    for key in ("ttft_ms", "prefill_ms", "prefill_tok_s", "decode_ms", "decode_tok_s", "total_ms"):
        assert timings[key] >= 0
    assert timings["total_ms"] >= timings["ttft_ms"] > 0


def test_chat_streaming_with_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("one two three"), stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Echo: one two three"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4 and last.usage.prompt_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streaming_without_include_usage_has_no_usage(server):
    with server.http.stream("POST", CHAT, json={"messages": user("hi"), "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(sse_lines(r))
    assert lines[-1] == "data: [DONE]"
    bodies = [json.loads(x[6:]) for x in lines[:-1] if x.startswith("data: ")]
    assert all("usage" not in b for b in bodies)


def test_reasoning_goes_to_reasoning_content(client, server):
    r = client.chat.completions.create(model=MODEL, messages=user("think r1"),
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = r.choices[0].message
    assert msg.content == "Echo: think r1"
    assert msg.model_extra["reasoning_content"] == "Thinking about it."
    assert submitted(server, "think r1")["thinking"] is True

    chunks = list(client.chat.completions.create(model=MODEL, messages=user("think r2"), stream=True,
                                                 reasoning_effort="high"))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    assert (content, reasoning) == ("Echo: think r2", "Thinking about it.")

    r = client.chat.completions.create(model=MODEL, messages=user("think r3"), reasoning_effort="none")
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert submitted(server, "think r3")["thinking"] is False
    r = client.chat.completions.create(model=MODEL, messages=user("think r4"), extra_body={"thinking": True})
    assert r.choices[0].message.model_extra["reasoning_content"] == "Thinking about it."


def test_completions(client, server):
    r = client.completions.create(model=MODEL, prompt="alpha beta gamma")
    assert r.object == "text_completion" and r.choices[0].text == "gamma beta alpha"
    assert r.choices[0].finish_reason == "stop" and r.usage.prompt_tokens == 3
    # OpenAI's (and vLLM's) default of 16 tokens when max_tokens is not given.
    assert submitted(server, "alpha beta gamma")["sampling"]["max_tokens"] == 16

    chunks = list(client.completions.create(model=MODEL, prompt="x y", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "y x"
    assert chunks[-1].usage.total_tokens == 4


def test_sampling_fields_reach_the_engine(client, server):
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "be brief"}, *user("sampling s1")],
        temperature=0.7, top_p=0.9, seed=0, presence_penalty=0.5, frequency_penalty=-0.25,
        max_completion_tokens=64, stop=["zzz", "qqq"],
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": False})
    rec = submitted(server, "sampling s1")
    s = rec["sampling"]
    assert (s["temperature"], s["top_p"], s["top_k"], s["min_p"]) == (0.7, 0.9, 40, 0.05)
    assert (s["seed"], s["presence_penalty"], s["frequency_penalty"], s["repetition_penalty"]) == (0, 0.5, -0.25, 1.1)
    assert s["max_tokens"] == 64 and s["stop"] == ["zzz", "qqq"] and s["ignore_eos"] is False
    assert [m["role"] for m in rec["messages"]] == ["system", "user"]
    # A string stop, max_tokens (the older name), seed -1 (llama.cpp's "random"), top_k -1 (vLLM's "off").
    client.chat.completions.create(model=MODEL, messages=user("sampling s2"), stop="zzz", max_tokens=5, seed=-1,
                                   extra_body={"top_k": -1})
    s = submitted(server, "sampling s2")["sampling"]
    assert (s["stop"], s["max_tokens"], s["seed"], s["top_k"]) == (["zzz"], 5, None, 0)


def test_stop_strings_length_and_ignore_eos(client):
    r = client.chat.completions.create(model=MODEL, messages=user("hello world"), stop=["world"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Echo: hello ", "stop")
    r = client.chat.completions.create(model=MODEL, messages=user("hello world"), max_tokens=2)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Echo: hello ", "length")
    r = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=6, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_keepalive_during_silent_prefill(server):
    body = {"messages": user('slow !fake {"prefill": 0.8}'), "stream": True}
    with server.http.stream("POST", CHAT, json=body, timeout=10) as r:
        lines = list(sse_lines(r))
    first_content = next(i for i, x in enumerate(lines) if '"content":"Echo' in x)
    keepalives = [x for x in lines[:first_content] if x == ": keep-alive"]
    assert len(keepalives) >= 2, lines[:first_content]
    assert lines[-1] == "data: [DONE]"


def test_models_health_lanes_tokenize(server):
    r = server.http.get("/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    assert [m["id"] for m in data] == [MODEL] and data[0]["object"] == "model" and data[0]["max_model_len"] == 512
    assert server.http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    r = server.http.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert server.http.get("/health").json() == {"status": "ok"}
    r = server.http.post("/tokenize", json={"messages": user("four words right here")})
    assert r.json() == {"count": 4, "max_model_len": 512}
    assert server.http.post("/tokenize", json={"prompt": "a b"}).json()["count"] == 2


def test_lanes_show_a_request_in_flight(server):
    body = {"messages": user('lanes probe !fake {"tokens": 100, "interval": 0.01}'), "stream": True}
    with server.http.stream("POST", CHAT, json=body, timeout=10) as r:
        rid = r.headers["x-request-id"]
        it = sse_lines(r)
        next(it), next(it)
        lanes = server.http.get("/v1/lanes").json()
        assert lanes["object"] == "ds4.lanes"
        mine = [x for x in lanes["lanes"] if x["request_id"] == rid]
        assert len(mine) == 1 and mine[0]["state"] == "decode" and mine[0]["slot"] is not None
        assert lanes["pool"]["n_pages"] == 32 and lanes["max_slots"] == 8 and lanes["max_ctx"] == 512
        assert lanes["n_running"] >= 1 and 0 < lanes["kv_cache_usage_perc"] <= 1
        for key in ("tok_s_history", "ttft_recent", "agg_tok_s", "step_decode_rows", "backend", "memory"):
            assert key in lanes


def test_metrics_names(server, client):
    client.chat.completions.create(model=MODEL, messages=user("metrics warmup"))
    r = server.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "ds4:num_evictions_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "ds4:requests_in_flight"):
        assert f"\n{name}{{" in text, name
    assert metric_value(text, "vllm:request_success_total", finished_reason="stop", model_name=MODEL) >= 1
    assert metric_value(text, "vllm:generation_tokens_total") >= 3
    assert metric_value(text, "ds4:num_evictions_total") == 2  # the fake's snapshot says 2
    assert metric_value(text, "vllm:time_to_first_token_seconds_count") >= 1


def test_server_imports_no_textual(server):
    assert server.state()["textual_loaded"] is False


# --- errors -----------------------------------------------------------------------------------

LONG = " ".join(["w"] * 600)  # over the fake's 512-token context
BAD = [
    # (path, body, status, error type, param)
    (CHAT, b"{not json", 400, "invalid_request_error", None),
    (CHAT, b"[1, 2]", 400, "invalid_request_error", None),
    (CHAT, {"model": MODEL}, 400, "invalid_request_error", "messages"),
    (CHAT, {"messages": []}, 400, "invalid_request_error", "messages"),
    (CHAT, {"messages": "hi"}, 400, "invalid_request_error", "messages"),
    (CHAT, {"messages": ["hi"]}, 400, "invalid_request_error", "messages[0]"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error", "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request_error", "messages[0].content"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "invalid_request_error", "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "invalid_request_error", "messages[0].content"),
    (CHAT, {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, 400, "invalid_request_error",
     "messages[0].role"),
    (CHAT, {"messages": [*user("a"), {"role": "assistant", "content": "b"}]}, 400, "invalid_request_error",
     "messages[1].role"),
    (CHAT, {"messages": user("a"), "model": "gpt-4o"}, 400, "invalid_request_error", "model"),
    (CHAT, {"messages": user("a"), "model": 7}, 400, "invalid_request_error", "model"),
    (CHAT, {"messages": user("a"), "temperature": "hot"}, 400, "invalid_request_error", "temperature"),
    (CHAT, {"messages": user("a"), "temperature": -0.5}, 400, "invalid_request_error", "temperature"),
    (CHAT, {"messages": user("a"), "temperature": 2.5}, 400, "invalid_request_error", "temperature"),
    (CHAT, {"messages": user("a"), "top_p": 0}, 400, "invalid_request_error", "top_p"),
    (CHAT, {"messages": user("a"), "top_p": 1.5}, 400, "invalid_request_error", "top_p"),
    (CHAT, {"messages": user("a"), "top_k": 1.5}, 400, "invalid_request_error", "top_k"),
    (CHAT, {"messages": user("a"), "top_k": -2}, 400, "invalid_request_error", "top_k"),
    (CHAT, {"messages": user("a"), "min_p": 2}, 400, "invalid_request_error", "min_p"),
    (CHAT, {"messages": user("a"), "presence_penalty": 3}, 400, "invalid_request_error", "presence_penalty"),
    (CHAT, {"messages": user("a"), "frequency_penalty": -3}, 400, "invalid_request_error", "frequency_penalty"),
    (CHAT, {"messages": user("a"), "repetition_penalty": 0}, 400, "invalid_request_error", "repetition_penalty"),
    (CHAT, {"messages": user("a"), "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    (CHAT, {"messages": user("a"), "max_tokens": "10"}, 400, "invalid_request_error", "max_tokens"),
    (CHAT, {"messages": user("a"), "max_completion_tokens": -1}, 400, "invalid_request_error",
     "max_completion_tokens"),
    (CHAT, {"messages": user("a"), "seed": -2}, 400, "invalid_request_error", "seed"),
    (CHAT, {"messages": user("a"), "seed": "x"}, 400, "invalid_request_error", "seed"),
    (CHAT, {"messages": user("a"), "stop": [""]}, 400, "invalid_request_error", "stop"),
    (CHAT, {"messages": user("a"), "stop": 5}, 400, "invalid_request_error", "stop"),
    (CHAT, {"messages": user("a"), "stream": "yes"}, 400, "invalid_request_error", "stream"),
    (CHAT, {"messages": user("a"), "stream_options": {"include_usage": True}}, 400, "invalid_request_error",
     "stream_options"),
    (CHAT, {"messages": user("a"), "ignore_eos": "true"}, 400, "invalid_request_error", "ignore_eos"),
    (CHAT, {"messages": user("a"), "n": 2}, 400, "invalid_request_error", "n"),
    (CHAT, {"messages": user("a"), "logprobs": True}, 400, "invalid_request_error", "logprobs"),
    (CHAT, {"messages": user("a"), "top_logprobs": 3}, 400, "invalid_request_error", "top_logprobs"),
    (CHAT, {"messages": user("a"), "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "invalid_request_error", "tools"),
    (CHAT, {"messages": user("a"), "tool_choice": "required"}, 400, "invalid_request_error", "tool_choice"),
    (CHAT, {"messages": user("a"), "response_format": {"type": "json_object"}}, 400, "invalid_request_error",
     "response_format"),
    (CHAT, {"messages": user("a"), "logit_bias": {"1": 5}}, 400, "invalid_request_error", "logit_bias"),
    (CHAT, {"messages": user("a"), "reasoning_effort": "bogus"}, 400, "invalid_request_error", "reasoning_effort"),
    (CHAT, {"messages": user("a"), "reasoning_effort": "max"}, 400, "invalid_request_error", "reasoning_effort"),
    (CHAT, {"messages": user("a"), "chat_template_kwargs": {"thinking": "yes"}}, 400, "invalid_request_error",
     "chat_template_kwargs.thinking"),
    (CHAT, {"messages": user(LONG)}, 400, "exceed_context_size_error", None),
    (CHAT, {"messages": user("a"), "max_tokens": 5000}, 400, "exceed_pool_error", None),
    (COMPL, {"model": MODEL}, 400, "invalid_request_error", "prompt"),
    (COMPL, {"prompt": ""}, 400, "invalid_request_error", "prompt"),
    (COMPL, {"prompt": [1, 2, 3]}, 400, "invalid_request_error", "prompt"),
    (COMPL, {"prompt": ["a", "b"]}, 400, "invalid_request_error", "prompt"),
    (COMPL, {"prompt": "a", "echo": True}, 400, "invalid_request_error", "echo"),
    (COMPL, {"prompt": "a", "best_of": 2}, 400, "invalid_request_error", "best_of"),
    (COMPL, {"prompt": "a", "suffix": "b"}, 400, "invalid_request_error", "suffix"),
    (COMPL, {"prompt": "a", "logprobs": 2}, 400, "invalid_request_error", "logprobs"),
    (COMPL, {"prompt": LONG}, 400, "exceed_context_size_error", None),
]


@pytest.mark.parametrize("path,body,status,etype,param", BAD,
                         ids=[f"{i}-{p.rsplit('/', 1)[1]}-{b if isinstance(b, bytes) else sorted(b)}"[:60]
                              for i, (p, b, *_rest) in enumerate(BAD)])
def test_bad_input_gets_openai_error(server, path, body, status, etype, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = server.http.post(path, timeout=10, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}
    assert err["type"] == etype and err["param"] == param
    assert isinstance(err["message"], str) and len(err["message"]) > 10


def test_routing_errors_have_the_same_shape(server):
    r = server.http.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = server.http.get(CHAT)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "code", "param"}


def test_server_is_healthy_after_bad_inputs(server, client):
    for case in BAD[:10]:
        server.http.post(case[0], json=case[1]) if not isinstance(case[1], bytes) else \
            server.http.post(case[0], content=case[1])
    assert server.http.get("/health").status_code == 200
    assert client.chat.completions.create(model=MODEL, messages=user("still fine")).choices[0].message.content \
        == "Echo: still fine"
    text = server.http.get("/metrics").text
    assert metric_value(text, "ds4:request_errors_total", type="invalid_request_error") >= 10


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("a"), temperature=3)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="not-this-one", messages=user("a"))
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("name,status,etype", [
    ("QueueFull", 503, "unavailable_error"),
    ("EngineUnavailable", 503, "unavailable_error"),
    ("InvalidRequest", 400, "invalid_request_error"),
    ("ContextLengthExceeded", 400, "exceed_context_size_error"),
    ("ExceedsPool", 400, "exceed_pool_error"),
])
def test_engine_errors_map_to_their_status(server, name, status, etype):
    r = server.http.post(CHAT, json={"messages": user(f'!fake {{"raise": "{name}"}}'), "stream": True})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == etype and f"scripted {name}" in err["message"]
    if status == 503:
        assert int(r.headers["retry-after"]) >= 1
    if name == "QueueFull":
        assert err["code"] == "queue_full"


def test_engine_failure_mid_request(server):
    body = {"messages": user('!fake {"tokens": 10, "error_after": 3}')}
    r = server.http.post(CHAT, json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "scripted engine failure" in r.json()["error"]["message"]
    with server.http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = list(sse_lines(r))
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["message"] == "scripted engine failure"
    assert sum('"content":"t' in x for x in lines) == 3


# --- cancellation on disconnect ---------------------------------------------------------------


def test_stream_disconnect_cancels_the_request(server):
    body = {"messages": user('disconnect me !fake {"tokens": 2000, "interval": 0.005}'), "stream": True}
    with httpx.Client(base_url=server.base, timeout=10) as c:
        with c.stream("POST", CHAT, json=body) as r:
            rid = r.headers["x-request-id"]
            lines = sse_lines(r)
            for _ in range(4):
                next(lines)
        # leaving the block closes the connection mid-stream
    wait_cancelled(server, rid, timeout=2.0)
    text = server.http.get("/metrics").text
    assert metric_value(text, "ds4:requests_aborted_total", reason="disconnect") >= 1
    lane_ids = [x["request_id"] for x in server.http.get("/v1/lanes").json()["lanes"]]
    assert rid not in lane_ids


def test_non_streaming_disconnect_cancels_the_request(server):
    payload = json.dumps({"messages": user('gone-nonstream !fake {"tokens": 1000, "interval": 0.01}')}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                rid = submitted(server, "gone-nonstream")["request_id"]
                break
            except AssertionError:
                time.sleep(0.02)
    wait_cancelled(server, rid, timeout=2.0)
