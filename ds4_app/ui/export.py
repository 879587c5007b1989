"""Export a session to Markdown (for people) or JSON (for programs).

JSON keeps everything needed to rebuild the conversation: the title, the settings, and every
message with role, content, reasoning, time and (for replies) finish reason and usage. The
``messages`` list is also directly usable as an OpenAI-style ``messages`` array (extra keys aside).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from pathlib import Path
from typing import Literal, Sequence

from .store import MessageRecord, SessionRecord

ExportFormat = Literal["markdown", "json"]
_ROLE_TITLES = {"system": "System", "user": "User", "assistant": "Assistant"}


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).isoformat(timespec="seconds")


def to_markdown(session: SessionRecord, messages: Sequence[MessageRecord]) -> str:
    """The conversation as Markdown: a heading per turn, reasoning folded in ``<details>``."""
    out = [f"# {session.title}", "", f"_{session.settings.summary()}_", ""]
    if session.settings.system_prompt:
        out += ["## System", "", session.settings.system_prompt, ""]
    for m in messages:
        out += [f"## {_ROLE_TITLES[m.role]}", ""]
        if m.reasoning:
            out += ["<details><summary>Thinking</summary>", "", m.reasoning, "", "</details>", ""]
        out += [m.content, ""]
    return "\n".join(out)


def to_json(session: SessionRecord, messages: Sequence[MessageRecord]) -> str:
    """The session as a JSON document (see the module docstring)."""
    doc = {
        "id": session.id,
        "title": session.title,
        "created": _iso(session.created),
        "updated": _iso(session.updated),
        "settings": session.settings.to_dict(),
        "messages": [
            {"role": m.role, "content": m.content, "reasoning_content": m.reasoning,
             "created": _iso(m.created), **({"meta": dict(m.meta)} if m.meta else {})}
            for m in messages
        ],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def default_filename(session: SessionRecord, fmt: ExportFormat) -> str:
    """``<title-slug>-<id>.md`` or ``.json``: readable, and unique per session."""
    slug = re.sub(r"[^a-z0-9]+", "-", session.title.lower()).strip("-")[:40] or "session"
    return f"{slug}-{session.id}.{'json' if fmt == 'json' else 'md'}"


def format_for_path(path: Path) -> ExportFormat:
    """JSON for a ``.json`` path, Markdown for anything else."""
    return "json" if path.suffix.lower() == ".json" else "markdown"


def write_export(session: SessionRecord, messages: Sequence[MessageRecord], *,
                 folder: Path, path: Path | None = None, fmt: ExportFormat | None = None) -> Path:
    """Write the session to ``path`` (format from its suffix unless ``fmt`` is given), or to
    ``folder``/default_filename; returns the file written. Raises OSError with the OS's reason."""
    if path is None:
        fmt = fmt or "markdown"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / default_filename(session, fmt)
    else:
        path = path.expanduser()
        fmt = fmt or format_for_path(path)
        if path.is_dir():
            path = path / default_filename(session, fmt)
        path.parent.mkdir(parents=True, exist_ok=True)
    text = to_json(session, messages) if fmt == "json" else to_markdown(session, messages)
    path.write_text(text, encoding="utf-8")
    return path
