"""Helpers for the server's black-box tests: start a real server process, talk HTTP to it.

Modelled on llama.cpp's ``tools/server/tests/utils.py``: a preset builds the command line, the
process listens on 127.0.0.1 at a free port, ``start`` waits for ``/health`` and ``stop`` sends
SIGTERM and returns the exit status. Two presets:

- ``ServerPreset.fake(...)``: ``python -m tests.server.fake_server`` (the real ``run_server`` on
  a scripted engine), used by every test today;
- ``ServerPreset.embedded(model, ...)``: ``python -m ds4_app --serve --model FILE --backend cpu``,
  the shipped command on the real engine, for the tests that need real tokens.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    """A port nothing listens on right now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class ServerPreset:
    """How to start one kind of server: the command before ``--port``, plus extra options."""

    command: list[str]
    args: list[str] = field(default_factory=list)
    model: str = "fake-ds4.gguf"

    @staticmethod
    def fake(*args: str) -> "ServerPreset":
        """The real server on the scripted engine (``tests/server/fake_engine.py``)."""
        return ServerPreset([sys.executable, "-m", "tests.server.fake_server"], list(args))

    @staticmethod
    def embedded(model_path: str, *args: str, backend: str = "cpu") -> "ServerPreset":
        """``ds4-app --serve`` on the embedded engine with a model file."""
        return ServerPreset([sys.executable, "-m", "ds4_app", "--serve", "--model", model_path, "--backend",
                             backend], list(args), model=os.path.basename(model_path))


class ServerProcess:
    """A server process on 127.0.0.1 at a free port; stderr is kept for assertions."""

    def __init__(self, preset: ServerPreset) -> None:
        self.preset = preset
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()
        # One client for the helpers: a new httpx client per call costs ~50 ms (SSL context).
        self.http = httpx.Client(base_url=self.base, timeout=10.0)

    def start(self, *, wait: str = "healthy", timeout: float = 20.0) -> "ServerProcess":
        """Start; ``wait`` is "healthy" (200 on /health), "listening" (any answer) or "none"."""
        cmd = [*self.preset.command, "--host", "127.0.0.1", "--port", str(self.port), *self.preset.args]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        if wait != "none":
            self.wait_for(lambda r: wait == "listening" or r.status_code == 200, timeout)
        return self

    def wait_for(self, ok, timeout: float) -> httpx.Response:
        """Poll /health until ``ok(response)``; fail with the server's log if it does not come."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = self.http.get("/health", timeout=2.0)
                if ok(r):
                    return r
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log()}")

    def url(self, path: str) -> str:
        return self.base + path

    def v1(self) -> str:
        """The OpenAI base URL."""
        return self.base + "/v1"

    def state(self) -> dict:
        """The fake engine's record (``/_test/state``)."""
        return self.http.get("/_test/state").json()

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the process and wait for it; its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit {timeout} s after {signal.Signals(sig).name}:\n{self.log()}")

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.http.close()
        self._log.close()


def running(preset: ServerPreset, **start_kw) -> Iterator[ServerProcess]:
    """A generator for pytest fixtures: yields a started server, kills it afterwards."""
    with ServerProcess(preset) as server:
        server.start(**start_kw)
        yield server


def sse_lines(response: httpx.Response) -> Iterator[str]:
    """The non-empty lines of a streamed SSE response."""
    for line in response.iter_lines():
        if line:
            yield line


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        rest = head[len(name):]
        if rest and not rest.startswith("{"):
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return float(value)
    return 0.0
