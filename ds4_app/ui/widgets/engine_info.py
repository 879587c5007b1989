"""What the engine is: backend, device, model, slots, step limits and its memory plan."""

from __future__ import annotations

from textual.widgets import Static

from ds4_app.engine.api import StatsSnapshot

from ..formatting import size


INDENT = 8


def describe(snapshot: StatsSnapshot, width: int = 56) -> str:
    """A few short lines about the engine (plain text, lines at most ``width`` wide)."""
    lines = [f"model   {snapshot.model or '–'}",
             f"backend {snapshot.backend or '–'} · {snapshot.device or '–'}"]
    if snapshot.max_slots or snapshot.max_ctx:
        lines.append(f"slots   {snapshot.max_slots} × {snapshot.max_ctx} tokens")
    if snapshot.max_rows:
        # The step limits in force: rows and sequences a step, the rows of a prompt beside others
        # and of a lone prompt (a GPU backend takes far more than the CPU's 16).
        lines.append(f"step    {snapshot.max_rows} rows · {snapshot.max_seqs} seqs · "
                     f"prompt {snapshot.rows_per_prompt} rows, alone {snapshot.lone_prompt_rows}")
    if snapshot.memory:
        lines.append(f"memory  {size(sum(n for _, n in snapshot.memory))}")
        # One part per line would be long; pack them, never splitting a "name size" pair.
        row = ""
        for name, n in snapshot.memory:
            part = f"{name.replace('_', ' ')} {size(n)}"
            if row and len(row) + 3 + len(part) > width - INDENT:
                lines.append(" " * INDENT + row)
                row = part
            else:
                row = f"{row} · {part}" if row else part
        lines.append(" " * INDENT + row)
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
