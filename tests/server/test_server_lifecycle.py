"""Process life: graceful shutdown on SIGTERM/SIGINT (exit 0), a failed model load (exit 1), a
busy port, and that the server never imports Textual."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import httpx

from tests.server.utils import ROOT, ServerPreset, ServerProcess, sse_lines

CHAT = "/v1/chat/completions"


def stream_body(tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": f'!fake {{"tokens": {tokens}, "interval": 0.01}}'}],
            "stream": True}


def finish_of(lines: list[str]) -> str | None:
    for line in reversed(lines):
        if line.startswith("data: {"):
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("finish_reason"):
                return choices[0]["finish_reason"]
    return None


def test_sigterm_drains_in_flight_streams_then_exits_0():
    with ServerProcess(ServerPreset.fake("--shutdown-grace", "1.5")) as server:
        server.start()
        with httpx.Client(base_url=server.base, timeout=15) as c1, \
                httpx.Client(base_url=server.base, timeout=15) as c2:
            with c1.stream("POST", CHAT, json=stream_body(40)) as short, \
                    c2.stream("POST", CHAT, json=stream_body(2000)) as long:
                short_lines, long_lines = sse_lines(short), sse_lines(long)
                next(short_lines), next(long_lines)  # the role chunks: both are admitted and streaming
                server.proc.send_signal(signal.SIGTERM)
                # Draining: no new work (on a new connection), /health says so.
                with httpx.Client(base_url=server.base, timeout=5) as c3:
                    for _ in range(100):  # the signal arrives asynchronously
                        h = c3.get("/health")
                        if h.status_code == 503:
                            break
                    assert h.status_code == 503 and h.json()["status"] == "shutting_down"
                    r = c3.post(CHAT, json={"messages": [{"role": "user", "content": "late"}]})
                    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
                    assert "retry-after" in r.headers
                rest_short = list(short_lines)
                rest_long = list(long_lines)
        # The short one finished within the grace period; the long one was cancelled after it.
        assert rest_short[-1] == "data: [DONE]" and finish_of(rest_short) == "stop"
        assert sum('"content":"t' in x for x in rest_short) == 40
        assert rest_long[-1] == "data: [DONE]" and finish_of(rest_long) == "cancelled"
        assert server.stop(timeout=15) == 0
        log = server.log()
        assert "fake engine closed" in log and "SIGTERM received" in log


def test_sigint_on_an_idle_server_exits_0():
    with ServerProcess(ServerPreset.fake()) as server:
        server.start()
        assert server.stop(signal.SIGINT, timeout=10) == 0
        assert "fake engine closed" in server.log()


def test_failed_model_load_exits_1_with_one_line():
    with ServerProcess(ServerPreset.fake("--fail-load", "weights truncated at blk.3")) as server:
        server.start(wait="none")
        assert server.proc.wait(15) == 1
        log = server.log()
        assert "model load failed: weights truncated at blk.3" in log
        assert "Traceback" not in log


def test_busy_port_exits_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tests.server.fake_server", "--port", str(port)], cwd=ROOT,
                              capture_output=True, text=True, timeout=20)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr


def test_server_modules_import_no_textual():
    code = ("import sys\n"
            "import ds4_app.server.main, ds4_app.server.app, ds4_app.commands.serve, ds4_app.engine.remote\n"
            "bad = [m for m in sys.modules if m == 'textual' or m.startswith('textual.')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=30)
