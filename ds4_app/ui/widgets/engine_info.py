"""What the engine is: backend, device, model, limits and its memory plan."""

from __future__ import annotations

from textual.widgets import Static

from ds4_app.engine.api import StatsSnapshot

from ..formatting import size


def describe(snapshot: StatsSnapshot) -> str:
    """A few short lines about the engine (plain text)."""
    lines = [f"model   {snapshot.model or '–'}",
             f"backend {snapshot.backend or '–'} · {snapshot.device or '–'}"]
    if snapshot.max_slots or snapshot.max_ctx:
        lines.append(f"slots   {snapshot.max_slots} × {snapshot.max_ctx} tokens")
    if snapshot.memory:
        total = sum(n for _, n in snapshot.memory)
        parts = " · ".join(f"{name} {size(n)}" for name, n in snapshot.memory)
        lines.append(f"memory  {size(total)}: {parts}")
    return "\n".join(lines)


class EngineInfo(Static):
    """Static text about the engine; updated only when it changes."""

    DEFAULT_CSS = """
    EngineInfo {
        height: auto;
        color: $text;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("loading the engine…", id=id, markup=False)
        self._text = ""

    def show(self, snapshot: StatsSnapshot) -> None:
        """Describe the engine of ``snapshot``."""
        self.show_text(describe(snapshot))

    def show_text(self, text: str) -> None:
        """Show ``text`` instead (loading, or why there is no engine)."""
        if text != self._text:
            self._text = text
            self.update(text)
