"""A plain-text progress line on stderr (``\\r`` redraws on a terminal, whole lines elsewhere)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    """Requests done out of a known total, with tokens and elapsed time; thread-safe.

    On a terminal the bar redraws in place at most ten times a second; on a pipe or file only
    the lines passed to ``note`` are written, so logs stay readable.
    """

    WIDTH = 24

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.tokens = 0
        self.label = ""
        self._t0 = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False
        self._lock = threading.Lock()

    def set_label(self, label: str) -> None:
        """What is running now (arm, level, wave)."""
        with self._lock:
            self.label = label
            self._draw(force=True)

    def advance(self, requests: int = 1, tokens: int = 0) -> None:
        """Count finished requests and their completion tokens."""
        with self._lock:
            self.done += requests
            self.tokens += tokens
            self._draw(force=self.done >= self.total)

    def note(self, line: str) -> None:
        """Write a whole line (a level's summary), above the bar on a terminal."""
        if not self.enabled:
            return
        with self._lock:
            if self._drawn:
                self.stream.write("\r\x1b[2K")
            self.stream.write(line + "\n")
            self._drawn = False
            self._draw(force=True)

    def close(self) -> None:
        """End the bar's line."""
        with self._lock:
            if self._drawn:
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = False

    def line(self) -> str:
        """The bar's current text."""
        filled = int(self.WIDTH * min(self.done, self.total) / self.total)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        elapsed = time.monotonic() - self._t0
        return f"{self.label} [{bar}] {self.done}/{self.total} req  {self.tokens} tok  {elapsed:.1f}s"

    def _draw(self, *, force: bool) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        self.stream.write("\r\x1b[2K" + self.line())
        self.stream.flush()
        self._drawn = True
