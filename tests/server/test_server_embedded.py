"""The shipped command on the real engine: ``ds4-app --serve --model tiny.gguf --backend cpu``.

- concurrency is exact: eight clients at once get exactly the text each gets alone (greedy, and
  sampled with a seed);
- a load of 200 requests, some abandoned mid-stream, leaves no page, slot or queue entry behind;
- /v1/lanes shows six lanes at once, a disconnect frees its lane within two steps, a full queue
  answers 503, and a reader that stops reading does not slow the others.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.server.utils import ServerPreset, running

pytest.importorskip("ds4_app.engine._native", reason="needs the native engine (make install)")

PROMPTS = [f"Tell me about item {i}: {'abc' * (i + 1)}" for i in range(8)]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    yield from running(ServerPreset.embedded(tiny_model_path, "--max-slots", "8", "--max-queue", "64"),
                       timeout=60)


def ask(base: str, prompt: str, *, stream: bool, **kw) -> str:
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
    args = dict(model="tiny.gguf", messages=[{"role": "user", "content": prompt}], max_tokens=16,
                extra_body={"ignore_eos": True}, **kw)
    if not stream:
        m = client.chat.completions.create(**args).choices[0].message
        return (m.model_extra or {}).get("reasoning_content", "") + "|" + (m.content or "")
    parts = {"r": "", "c": ""}
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            d = chunk.choices[0].delta
            parts["c"] += d.content or ""
            parts["r"] += (d.model_extra or {}).get("reasoning_content") or ""
    return parts["r"] + "|" + parts["c"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_eight_concurrent_clients_get_their_solo_text(server, sampling):
    solo = [ask(server.v1(), p, stream=False, **sampling) for p in PROMPTS]
    assert len(set(solo)) > 1  # the prompts really lead to different replies
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: ask(server.v1(), PROMPTS[i], stream=i % 2 == 0, **sampling), range(8)))
    assert together == solo


def test_200_requests_leave_nothing_behind(server):
    rng = random.Random(0)
    bodies = [{"messages": [{"role": "user", "content": f"load {i} " + "x" * rng.randrange(1, 8)}],
               "max_tokens": rng.randrange(1, 6), "stream": i % 3 != 0} for i in range(200)]

    def one(c: httpx.Client, i: int) -> str:
        body = bodies[i]
        if not body["stream"]:
            return str(c.post("/v1/chat/completions", json=body).status_code)
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for n, line in enumerate(r.iter_lines()):
                if i % 7 == 0 and n >= 1:
                    return "abandoned"  # leave mid-stream: the server must cancel it
                if line == "data: [DONE]":
                    return "200"
        return "cut"

    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    with httpx.Client(base_url=server.base, timeout=60, limits=limits) as c, \
            concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda i: one(c, i), range(200)))
    assert set(outcomes) <= {"200", "abandoned"}, outcomes
    assert outcomes.count("200") >= 150

    lanes = server.http.get("/v1/lanes").json()
    for _ in range(100):  # cancellations land within a step or two
        if not lanes["lanes"] and lanes["n_running"] == 0:
            break
        lanes = server.http.get("/v1/lanes").json()
    assert lanes["lanes"] == [] and lanes["queue_len"] == 0 and lanes["n_running"] == 0
    pool = lanes["pool"]
    assert (pool["used"], pool["reserved"], pool["free"]) == (0, 0, pool["n_pages"]), json.dumps(pool)
    metrics = server.http.get("/metrics").text
    assert "ds4:requests_in_flight{model_name=\"tiny.gguf\"} 0.0" in metrics


# --- the remaining acceptance items, on the real engine (default --max-slots 6) -------------------


@pytest.fixture(scope="module")
def server6(tiny_model_path):
    # A long context, so that a request held open (max_tokens 20000) does not end on its own while
    # a test still needs it running: the tiny model fills 4096 tokens in about a second.
    yield from running(ServerPreset.embedded(tiny_model_path, "--max-queue", "4", "--max-ctx", "32768"),
                       timeout=60)


def _stream_body(prompt: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _completion_tokens(lines) -> int:
    """Read an SSE stream to its end; the usage chunk's completion token count."""
    n = 0
    for line in lines:
        if line.startswith("data: {") and '"usage"' in line:
            usage = json.loads(line[6:]).get("usage")
            if usage:
                n = usage["completion_tokens"]
    return n


def test_lanes_show_six_active_while_eight_stream(server6):
    """Eight streaming clients on six slots: /v1/lanes shows six lanes running, two queued."""
    seen_running, seen_queued = 0, 0

    start = threading.Barrier(8)  # the eight requests go out together

    def client(i: int) -> int:
        with httpx.Client(base_url=server6.base, timeout=120) as c:
            start.wait()
            with c.stream("POST", "/v1/chat/completions", json=_stream_body(PROMPTS[i], 1000)) as r:
                lines = list(r.iter_lines())
                return _completion_tokens(lines) or (r.status_code, lines[-3:])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, i) for i in range(8)]
        while not all(f.done() for f in futures):
            lanes = server6.http.get("/v1/lanes").json()
            seen_running = max(seen_running, lanes["n_running"])
            seen_queued = max(seen_queued, sum(1 for lane in lanes["lanes"] if lane["state"] == "queued"))
        assert [f.result() for f in futures] == [1000] * 8
    assert seen_running == 6
    assert seen_queued >= 1


def test_disconnect_after_five_tokens_frees_the_lane(server6):
    """A stream closed after 5 content chunks is retired within 2 engine steps of the server
    noticing, its pages return, and /metrics counts the abort."""
    def aborted() -> float:
        for line in server6.http.get("/metrics").text.splitlines():
            if line.startswith("ds4:requests_aborted_total") and 'reason="disconnect"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = aborted()
    with httpx.Client(base_url=server6.base, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=_stream_body("keep talking", 5000)) as r:
            got = 0
            for line in r.iter_lines():
                if '"content"' in line:
                    got += 1
                    if got == 5:
                        break
    # The response is closed: the server sees the disconnect and cancels the request.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and aborted() == before:
        time.sleep(0.005)
    assert aborted() == before + 1
    steps_at_abort = server6.http.get("/v1/lanes").json()["steps"]
    while time.monotonic() < deadline:
        lanes = server6.http.get("/v1/lanes").json()
        if not lanes["lanes"]:
            break
        time.sleep(0.002)
    assert lanes["lanes"] == [] and lanes["pool"]["used"] == 0
    assert lanes["steps"] - steps_at_abort <= 2


def test_queue_full_gives_503_on_the_real_engine(server6):
    """Six slots busy and four requests waiting: the next one gets 503 with Retry-After."""
    stop = threading.Event()
    start = threading.Barrier(10)  # the ten requests go out together, not one client set-up apart

    def hold(i: int) -> None:
        with httpx.Client(base_url=server6.base, timeout=120) as c:
            start.wait()
            with c.stream("POST", "/v1/chat/completions", json=_stream_body(f"hold {i}", 20000)) as r:
                if r.status_code != 200:
                    return (r.status_code, r.read())
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(hold, i) for i in range(10)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lanes = server6.http.get("/v1/lanes").json()
            if lanes["n_running"] == 6 and lanes["queue_len"] == 4:
                break
            time.sleep(0.01)
        assert (lanes["n_running"], lanes["queue_len"]) == (6, 4), [f.result() for f in futures if f.done()]
        r = server6.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2})
        stop.set()
        for f in futures:
            f.result()
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert r.json()["error"]["type"] == "unavailable_error"
    assert server6.http.get("/health").status_code == 200


def test_slow_reader_does_not_slow_the_others(tiny_model_path):
    """One client opens a stream and reads nothing; four others finish at the pace they have
    alone. (Dropping the stalled reader once its bytes pile up in the server is covered by
    test_server_slow_client.py: here its whole reply fits in the sockets' kernel buffers.)"""
    for srv in running(ServerPreset.embedded(tiny_model_path), timeout=60):
        def timed(i: int) -> float:
            t0 = time.monotonic()
            with httpx.Client(base_url=srv.base, timeout=120) as c, \
                    c.stream("POST", "/v1/chat/completions", json=_stream_body(PROMPTS[i], 200)) as r:
                assert _completion_tokens(r.iter_lines()) == 200
            return time.monotonic() - t0

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            alone = max(pool.map(timed, range(4)))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        body = json.dumps(_stream_body("I will not read", 3000)).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            assert _wait(lambda: srv.http.get("/v1/lanes").json()["n_running"] == 1)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                beside = max(pool.map(timed, range(4)))
        finally:
            sock.close()
        # Four lanes plus a fifth that never reads: each step carries one more row, nothing waits.
        assert beside < alone * 2 + 0.5, (alone, beside)
        assert _wait(lambda: srv.http.get("/v1/lanes").json()["n_running"] == 0)


def _wait(pred, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_session_id_keeps_the_conversation_resident(server6):
    """Two turns with one session_id: the second prefills only its new tokens (the whole first
    turn shows as cached tokens in usage); a session_id that is not a string is a 400."""
    def turn(messages, session=None):
        body = {"messages": messages, "max_tokens": 8, "ignore_eos": True}
        if session:
            body["session_id"] = session
        r = server6.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    first = [{"role": "user", "content": "Hello, who are you?"}]
    a1 = turn(first, "chat-1")
    second = first + [{"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And what can you do?"}]
    a2 = turn(second, "chat-1")
    cached = a2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= a1["usage"]["prompt_tokens"]
    bad = server6.http.post("/v1/chat/completions", json={"messages": first, "session_id": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"
