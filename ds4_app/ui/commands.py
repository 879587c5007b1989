"""The command palette (ctrl+p): one entry per action of the ``ACTIONS`` table."""

from __future__ import annotations

from functools import partial
from typing import Mapping

from textual.command import DiscoveryHit, Hit, Hits, Provider

from .bindings import ACTIONS, ActionSpec, effective_keys


def _entries(keymap: Mapping[str, str]) -> list[tuple[ActionSpec, str]]:
    # Input-scope actions (send, newline) only mean something while typing in a chat.
    return [(spec, f"{spec.description} · {effective_keys(spec, keymap)}")
            for spec in ACTIONS if spec.scope == "app"]


class ActionCommands(Provider):
    """Offers every App action by its description; running one is the same as pressing its key."""

    def _keymap(self) -> Mapping[str, str]:
        return getattr(self.app, "keymap", {})

    async def discover(self) -> Hits:
        for spec, help_text in _entries(self._keymap()):
            yield DiscoveryHit(spec.help, partial(self.app.run_action, spec.action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for spec, help_text in _entries(self._keymap()):
            score = matcher.match(spec.help)
            if score > 0:
                yield Hit(score, matcher.highlight(spec.help), partial(self.app.run_action, spec.action),
                          help=help_text)
