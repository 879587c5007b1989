"""Reading keys from a real terminal: alt+digit arrives as ESC followed by the digit.

xterm-style terminals (with meta sending escape), tmux and screen send alt+1 as the two bytes
ESC "1". Textual's parser maps those pairs to the characters macOS types for option+1..0 ("¡",
"™", "£", …), a mapping meant for WezTerm on macOS, so alt+1..9 never reached a binding and the
chat input typed "™" instead of switching tabs. ``KeyParser`` reads ESC+digit as alt+digit, as
every other ESC+key pair is read (ESC "c" is alt+c). A character typed directly ("¡" on a Spanish
keyboard, "£" on a UK one) is one code point, not an ESC pair, and still types.

``TerminalDriver`` is Textual's Linux driver with ``KeyParser`` in place of ``XTermParser``. The
driver has no hook for its parser, so its input loop is reused with the one name rebound; a test
checks that the loop still builds its parser by that name.
"""

from __future__ import annotations

import types
from typing import Iterable

from textual import events
from textual._xterm_parser import XTermParser
from textual.drivers import linux_driver
from textual.drivers.linux_driver import LinuxDriver

ESC = "\x1b"
DIGITS = frozenset("0123456789")


class KeyParser(XTermParser):
    """Textual's terminal parser, with ESC+digit read as alt+digit."""

    def _sequence_to_key_events(self, sequence: str, alt: bool = False) -> Iterable[events.Key]:
        if len(sequence) == 2 and sequence[0] == ESC and sequence[1] in DIGITS:
            # Same shape as Textual's alt+letter: the key names the chord, the character is the
            # key's own (inputs that take alt chords as text must refuse them, see ChatInput).
            yield events.Key(f"alt+{sequence[1]}", sequence[1])
            return
        yield from super()._sequence_to_key_events(sequence, alt)


def _with_parser(function: types.FunctionType, parser: type[XTermParser]) -> types.FunctionType:
    """``function`` (from linux_driver) with the global name XTermParser bound to ``parser``."""
    namespace = dict(function.__globals__, XTermParser=parser)
    rebound = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                                 function.__closure__)
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    return rebound


class TerminalDriver(LinuxDriver):
    """The Linux/macOS terminal driver, reading keys with ``KeyParser``."""

    run_input_thread = _with_parser(linux_driver.LinuxDriver.run_input_thread, KeyParser)  # type: ignore[arg-type]
