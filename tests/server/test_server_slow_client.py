"""A client that stops reading is dropped (and its request cancelled) while four others stream
at their normal pace: the server never lets one reader hold up the others or the engine."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest

from tests.server.utils import ServerPreset, ServerProcess, metric_value, running

CHAT = "/v1/chat/completions"
N_TOKENS, INTERVAL = 60, 0.02  # the normal clients' pace: 1.2 s of tokens each


@pytest.fixture(scope="module")
def server():
    # A small client buffer and a 1 s send timeout make the drop quick.
    yield from running(ServerPreset.fake("--send-timeout", "1", "--client-buffer-kib", "64"))


def normal_client(base: str, i: int, out: dict) -> None:
    body = {"messages": [{"role": "user", "content": f'!fake {{"tokens": {N_TOKENS}, "interval": {INTERVAL}}}'}],
            "stream": True}
    arrivals, tokens, finish = [], 0, None
    t0 = time.monotonic()
    with httpx.Client(base_url=base, timeout=30) as c, c.stream("POST", CHAT, json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.monotonic())
            choice = json.loads(line[6:])["choices"][0]
            tokens += bool(choice["delta"].get("content"))
            finish = choice["finish_reason"] or finish
    out[i] = {"tokens": tokens, "finish": finish, "duration": time.monotonic() - t0,
              "max_gap": max(b - a for a, b in zip(arrivals, arrivals[1:]))}


def open_slow_reader(server) -> tuple[socket.socket, str]:
    """A client with a tiny receive buffer that asks for ~16 MB/s of text and never reads it."""
    payload = json.dumps({"messages": [{"role": "user", "content":
                                        '!fake {"tokens": 100000, "chunk": 32768, "interval": 0.002}'}],
                          "stream": True}).encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", server.port))
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    head = slow.recv(1024).decode(errors="replace")
    return slow, re.search(r"x-request-id: (\S+)", head).group(1)


def wait_cancelled(server, rid: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while rid not in server.state()["cancelled"]:
        assert time.monotonic() < deadline, f"slow client {rid} was never dropped:\n{server.log()}"
        time.sleep(0.05)


def test_slow_reader_is_dropped_while_others_keep_pace(server):
    slow, rid = open_slow_reader(server)
    try:
        results: dict[int, dict] = {}
        threads = [threading.Thread(target=normal_client, args=(server.base, i, results)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

        # The others streamed everything, at about the engine's pace (generous bounds for a busy CI box).
        assert sorted(results) == [0, 1, 2, 3]
        for r in results.values():
            assert r["tokens"] == N_TOKENS and r["finish"] == "stop"
            assert r["duration"] < N_TOKENS * INTERVAL * 2 + 1.0, results
            assert r["max_gap"] < 0.5, results

        # The slow one was dropped and its request cancelled in the engine.
        wait_cancelled(server, rid)
        metrics = server.http.get("/metrics").text
        assert metric_value(metrics, "ds4:requests_aborted_total", reason="slow_client") == 1
        assert rid not in [x["request_id"] for x in server.http.get("/v1/lanes").json()["lanes"]]
        # Its connection was closed by the server, not left open holding the unsent bytes: what
        # the kernel already had arrives, then EOF (or a reset); a still-open socket would time out.
        slow.settimeout(5)
        try:
            while slow.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass
    finally:
        slow.close()
    assert server.http.get("/health").status_code == 200


def test_a_delta_bigger_than_the_client_buffer_does_not_drop_a_reader(server):
    # 20 deltas of 100 KiB each through a 64 KiB client buffer, to a client that reads them all.
    body = {"messages": [{"role": "user", "content": '!fake {"tokens": 20, "chunk": 102400, "interval": 0.005}'}],
            "stream": True}
    with server.http.stream("POST", CHAT, json=body) as r:
        sizes = [len(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
                 for line in r.iter_lines() if line.startswith("data: {")]
    assert sizes.count(102400) == 20


def test_a_dropped_reader_does_not_hold_up_shutdown():
    # The dropped client keeps its socket open and never reads. Its connection is reset when it
    # is dropped, so uvicorn has nothing to wait for at shutdown (else it waits out its timeout).
    with ServerProcess(ServerPreset.fake("--send-timeout", "1", "--client-buffer-kib", "64")) as server:
        server.start()
        slow, rid = open_slow_reader(server)
        with slow:
            wait_cancelled(server, rid)
            assert server.stop() == 0
        assert "graceful shutdown exceeded" not in server.log()
