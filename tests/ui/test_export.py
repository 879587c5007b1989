"""Export to Markdown and JSON, and where files go."""

from __future__ import annotations

import json
from pathlib import Path

from ds4_app.ui.export import default_filename, to_json, to_markdown, write_export
from ds4_app.ui.session_settings import SessionSettings
from ds4_app.ui.store import Store

from .helpers import FIXED_TIME


def _session(tmp_path: Path):
    store = Store(tmp_path / "s.db", clock=lambda: FIXED_TIME)
    s = store.create_session("Fix the *build* / CI", SessionSettings(system_prompt="Answer in English.", seed=3),
                             session_id="s0123456789ab")
    store.add_message(s.id, "user", "Why does `make` fail?")
    store.add_message(s.id, "assistant", "Because of **X**.", "Look at the log first.",
                      {"finish_reason": "stop", "completion_tokens": 5})
    return store.session(s.id), store.messages(s.id)


def test_markdown(tmp_path: Path) -> None:
    session, messages = _session(tmp_path)
    assert to_markdown(session, messages) == (
        "# Fix the *build* / CI\n\n"
        "_temperature 1 · top-p 1 · max tokens 4096 · seed 3 · thinking off_\n\n"
        "## System\n\nAnswer in English.\n\n"
        "## User\n\nWhy does `make` fail?\n\n"
        "## Assistant\n\n<details><summary>Thinking</summary>\n\nLook at the log first.\n\n</details>\n\n"
        "Because of **X**.\n")


def test_json(tmp_path: Path) -> None:
    session, messages = _session(tmp_path)
    doc = json.loads(to_json(session, messages))
    assert doc["id"] == "s0123456789ab" and doc["title"] == "Fix the *build* / CI"
    assert doc["created"] == "2026-01-01T00:00:00+00:00"
    assert doc["settings"] == SessionSettings(system_prompt="Answer in English.", seed=3).to_dict()
    assert doc["messages"] == [
        {"role": "user", "content": "Why does `make` fail?", "reasoning_content": "",
         "created": "2026-01-01T00:00:00+00:00"},
        {"role": "assistant", "content": "Because of **X**.", "reasoning_content": "Look at the log first.",
         "created": "2026-01-01T00:00:00+00:00", "meta": {"finish_reason": "stop", "completion_tokens": 5}},
    ]


def test_where_exports_go(tmp_path: Path) -> None:
    session, messages = _session(tmp_path)
    assert default_filename(session, "markdown") == "fix-the-build-ci-s0123456789ab.md"
    folder = tmp_path / "exports"
    md = write_export(session, messages, folder=folder)
    assert md == folder / "fix-the-build-ci-s0123456789ab.md" and md.read_text().startswith("# Fix")
    js = write_export(session, messages, folder=folder, fmt="json")
    assert js.suffix == ".json" and json.loads(js.read_text())["title"] == session.title
    # A path: the suffix picks the format; a folder gets the default name; parents are made.
    typed = write_export(session, messages, folder=folder, path=tmp_path / "a" / "b" / "chat.JSON")
    assert json.loads(typed.read_text())["id"] == session.id
    into_dir = write_export(session, messages, folder=folder, path=tmp_path / "a")
    assert into_dir == tmp_path / "a" / "fix-the-build-ci-s0123456789ab.md"
