"""The action table and the keymap file."""

from __future__ import annotations

import json
from pathlib import Path

from ds4_app.ui.bindings import ACTIONS, ACTIONS_BY_ID, bindings, effective_keys, load_keymap
from ds4_app.ui.locations import ENV_DATA_DIR, data_dir


def test_every_action_has_a_unique_id_and_keys() -> None:
    assert len(ACTIONS_BY_ID) == len(ACTIONS)
    assert all(a.keys and a.description and a.help for a in ACTIONS)
    app_keys = [k for b in bindings("app") for k in b.key.split(",")]
    assert len(app_keys) == len(set(app_keys)), "two app actions share a key"
    assert all(b.id for b in bindings("app") + bindings("input"))
    assert {b.id for b in bindings("input")} == {"chat.send", "chat.newline"}


def test_load_keymap(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    assert load_keymap(path) == ({}, [])
    path.write_text(json.dumps({"keymap": {"session.new": " f9 , ctrl+t ", "bogus.id": "f1",
                                           "chat.copy_last": 5, "app.help": ""}}))
    keymap, problems = load_keymap(path)
    assert keymap == {"session.new": "f9,ctrl+t"}
    assert len(problems) == 3
    assert "unknown binding id 'bogus.id'" in problems[0]
    assert "'chat.copy_last'" in problems[1] and "'app.help'" in problems[2]
    assert effective_keys(ACTIONS_BY_ID["session.new"], keymap) == "f9,ctrl+t"
    assert effective_keys(ACTIONS_BY_ID["app.help"], keymap) == "f1"


def test_load_keymap_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{oops")
    assert load_keymap(path)[0] == {} and "not valid JSON" in load_keymap(path)[1][0]
    path.write_text(json.dumps({"keymap": ["f1"]}))
    assert load_keymap(path)[0] == {} and "must be an object" in load_keymap(path)[1][0]
    path.write_text(json.dumps({"theme": "nord"}))
    assert load_keymap(path) == ({}, [])


def test_data_dir_order(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_DATA_DIR, str(tmp_path / "from-env"))
    assert data_dir(tmp_path / "from-flag") == tmp_path / "from-flag"
    assert (tmp_path / "from-flag").is_dir()
    assert data_dir() == tmp_path / "from-env"
    monkeypatch.delenv(ENV_DATA_DIR)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_dir() == tmp_path / "xdg" / "ds4-app"
