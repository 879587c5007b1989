"""The ds4-app terminal app: session tabs on the left, the engine panel on the right.

The App is thin: it wires the store, the engine bridge, the tab bar and the panel together and
turns key bindings into calls on the current chat view. It takes any ``EngineClient`` (the
embedded ``EngineService``, a ``RemoteEngine``, or a test's fake), or a factory that builds one
in a background thread so the window opens at once and a bad model file becomes a notification.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path
from typing import Callable, Mapping

from textual import events, on, work
from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.driver import Driver
from textual.drivers.linux_driver import LinuxDriver
from textual.screen import ModalScreen
from textual.widgets import Footer, TabbedContent

from ds4_app.engine.api import EngineClient

from .bindings import bindings, load_keymap
from .bridge import EngineBridge
from .commands import ActionCommands
from .export import write_export
from .locations import config_path, exports_dir, store_path
from .messages import EngineFailed, EngineReady, SessionBusyChanged, SessionTitleChanged, StatsUpdated
from .screens.help import HelpScreen
from .screens.input_dialog import InputDialog
from .screens.sessions import Choice, SessionsScreen
from .screens.settings import SettingsScreen
from .session_settings import SessionSettings
from .store import Store
from .terminal import TerminalDriver
from .widgets.chat_view import ChatView
from .widgets.engine_panel import EnginePanel
from .widgets.session_tabs import SessionTabs

PANEL_MIN_WIDTH = 120  # the panel shows by default from this terminal width on
# Actions of priority bindings that change the tabs: refused while a dialog is open, since a
# priority binding fires over a modal screen too.
TAB_ACTIONS = frozenset({"new_session", "close_session", "next_session", "prev_session", "goto_session"})


def one_line(error: BaseException) -> str:
    """An exception as one line for a notification (its message, else its type)."""
    text = " ".join(str(error).split())
    return text or type(error).__name__


def _display_path(path: Path) -> str:
    """``path`` with the home directory written as ``~``."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


class DS4App(App[None]):
    """Concurrent chat sessions over one engine, with a live view of the engine."""

    TITLE = "ds4-app"
    BINDINGS = bindings("app")
    COMMANDS = App.COMMANDS | {ActionCommands}
    CSS = """
    #main {
        height: 1fr;
    }
    """

    def __init__(self, engine: EngineClient | None = None, *, data_dir: str | Path,
                 engine_factory: Callable[[], EngineClient] | None = None,
                 keymap: Mapping[str, str] | None = None, show_panel: bool | None = None,
                 clock: Callable[[], float] = time.time, stats_interval: float = 0.1,
                 pump_interval: float = 0.04) -> None:
        """``engine`` or ``engine_factory`` (run in a thread at start), not both. ``data_dir``
        holds sessions.db, config.json and exports/. ``keymap`` entries override config.json's.
        ``show_panel`` None follows the terminal width; ``clock`` stamps stored rows."""
        if (engine is None) == (engine_factory is None):
            raise ValueError("DS4App needs exactly one of engine or engine_factory")
        super().__init__()
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(store_path(self.data_dir), clock=clock)
        self.bridge = EngineBridge(engine, interval=pump_interval, stats_interval=stats_interval)
        self._engine_factory = engine_factory
        self.keymap, self._config_problems = load_keymap(config_path(self.data_dir))
        self.keymap.update(keymap or {})
        self._panel_choice = show_panel
        self._tabs: SessionTabs | None = None  # found once: it stays for the app's life

    @property
    def engine(self) -> EngineClient | None:
        """The engine (None while a factory still loads it, or after it failed)."""
        return self.bridge.engine

    def get_driver_class(self) -> type[Driver]:
        """Textual's driver, except that a Linux/macOS terminal is read with ``TerminalDriver``
        (alt+digit arrives as ESC+digit; see terminal.py)."""
        driver = super().get_driver_class()
        return TerminalDriver if driver is LinuxDriver else driver

    # ------------------------------------------------------------------ layout and start
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield SessionTabs(id="sessions")
            yield EnginePanel(id="engine-panel")
        yield Footer()

    async def on_mount(self) -> None:
        # What is alive now (modules, Textual, this app's frame) lives as long as the process:
        # moved out of the collector's sight (after one collection, so no garbage is kept), a
        # full collection later scans half as many objects. Gen-2 pauses while six replies
        # streamed: 56-91 ms, 24-40 ms frozen.
        gc.collect()
        gc.freeze()
        self.set_keymap(self.keymap)
        for problem in self._config_problems:
            self.notify(problem, title="config.json", severity="warning", timeout=10, markup=False)
        panel = self.panel
        panel.display = self._panel_wanted(self.size.width)
        self.bridge.attach(self, self, poll_stats=lambda: bool(panel.display))
        if self.bridge.engine is None:
            panel.show_unavailable("loading the engine…")
            self._load_engine()
        for session in self.store.sessions(open_only=True):
            await self.tabs.open_session(session, self.store.messages(session.id), store=self.store,
                                         bridge=self.bridge, activate=False)
        views = self.tabs.chats()
        if views:
            self.tabs.activate(views[-1].session.id)
        else:
            await self.action_new_session()

    async def action_quit(self) -> None:
        """Quit; replies still streaming are cancelled and what they said so far is kept."""
        for view in self.tabs.chats():
            view.close()
        self.exit()

    def on_unmount(self) -> None:
        self.bridge.close()
        self.store.close()

    @work(thread=True, exclusive=True, group="engine-load", exit_on_error=False)
    def _load_engine(self) -> None:
        assert self._engine_factory is not None
        try:
            engine = self._engine_factory()
            name = engine.model_name
        except Exception as e:  # noqa: BLE001 - any load failure is shown, and the app keeps running
            self.post_message(EngineFailed(one_line(e)))
        else:
            self.post_message(EngineReady(engine, name))

    def on_engine_ready(self, message: EngineReady) -> None:
        self.bridge.set_engine(message.engine)
        self.notify(f"{message.model_name} is ready", markup=False)

    def on_engine_failed(self, message: EngineFailed) -> None:
        reason = f"no engine: {message.error}"
        self.bridge.set_unavailable(reason)
        self.panel.show_unavailable(reason)
        self.notify(message.error, title="The engine did not start", severity="error", timeout=30, markup=False)

    # ------------------------------------------------------------------ parts
    @property
    def tabs(self) -> SessionTabs:
        """The session tab bar."""
        if self._tabs is None:
            self._tabs = self.query_one(SessionTabs)
        return self._tabs

    @property
    def panel(self) -> EnginePanel:
        """The engine panel."""
        return self.query_one(EnginePanel)

    def current_chat(self) -> ChatView | None:
        """The chat view of the active tab."""
        return self.tabs.current()

    def _panel_wanted(self, width: int) -> bool:
        return self._panel_choice if self._panel_choice is not None else width >= PANEL_MIN_WIDTH

    # ------------------------------------------------------------------ routed messages
    def on_resize(self, event: events.Resize) -> None:
        if self._panel_choice is None:
            self.panel.display = self._panel_wanted(event.size.width)

    # These messages keep coming (from the stats thread, from a reply that ends) while the app
    # shuts down, after its widgets are gone: then they are dropped, not an exception at exit.
    def on_stats_updated(self, message: StatsUpdated) -> None:
        if self.bridge.engine is not None and self._widgets_up():
            self.panel.show(message.snapshot, self.tabs.session_titles())

    def on_session_title_changed(self, message: SessionTitleChanged) -> None:
        view = self.tabs.chat(message.session_id) if self._widgets_up() else None
        if view is not None:
            self.tabs.set_label(message.session_id, message.title, view.busy)

    def on_session_busy_changed(self, message: SessionBusyChanged) -> None:
        view = self.tabs.chat(message.session_id) if self._widgets_up() else None
        if view is not None:
            self.tabs.set_label(message.session_id, view.session.title, message.busy)

    def _widgets_up(self) -> bool:
        # Not a query: that walks every widget of every chat, at each stats tick.
        return self.tabs.is_attached

    @on(TabbedContent.TabActivated)
    def _show_chat(self, event: TabbedContent.TabActivated) -> None:
        # The chat draws what streamed while it was hidden, and takes the cursor.
        # Focusing posts TabPane.Focused, which sets the active tab: act only on the tab that is
        # active now, or a stale event would pull the view back to a tab the user just left.
        if event.pane.id == self.tabs.active:
            for view in event.pane.query(ChatView):
                view.catch_up()
                view.input.focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Tab actions only on the main screen (a dialog keeps its keys: ctrl+w deletes a word).
        None, not False: the footer shows them dimmed rather than dropping them."""
        if action in TAB_ACTIONS and isinstance(self.screen, ModalScreen):
            return None
        return True

    # ------------------------------------------------------------------ session actions
    async def action_new_session(self) -> None:
        """Open a new chat with default settings."""
        n = len(self.store.sessions()) + 1
        session = self.store.create_session(f"Chat {n}", SessionSettings())
        await self.tabs.open_session(session, [], store=self.store, bridge=self.bridge)

    async def action_close_session(self) -> None:
        """Close the current tab; the session stays in the store. The last tab is replaced by a new one."""
        view = self.current_chat()
        if view is None:
            return
        self.store.set_open(view.session.id, False)
        await self.tabs.close_session(view.session.id)
        shown = self.current_chat()
        if shown is None:
            await self.action_new_session()
        else:
            self.tabs.activate(shown.session.id)  # focus its input now, before the next key

    def action_next_session(self) -> None:
        """Show the next tab."""
        self.tabs.cycle(1)

    def action_prev_session(self) -> None:
        """Show the previous tab."""
        self.tabs.cycle(-1)

    def action_goto_session(self, n: int) -> None:
        """Show tab ``n`` (1-based)."""
        self.tabs.goto(n)

    def action_rename_session(self) -> None:
        """Ask for a new title for the current session."""
        view = self.current_chat()
        if view is None:
            return

        def done(title: str | None) -> None:
            if title:
                view.rename(title)

        self.push_screen(InputDialog("Rename session", view.session.title), done)

    def action_session_settings(self) -> None:
        """Edit the current session's system prompt, sampling and thinking."""
        view = self.current_chat()
        if view is None:
            return

        def done(settings: SessionSettings | None) -> None:
            if settings is not None:
                view.apply_settings(settings)
                self.notify("Settings saved; they apply from the next reply.")

        self.push_screen(SettingsScreen(view.session.title, view.session.settings), done)

    def action_toggle_thinking(self) -> None:
        """Turn thinking mode on or off for the current session."""
        view = self.current_chat()
        if view is not None:
            settings = view.session.settings
            view.apply_settings(dataclasses.replace(settings, thinking=not settings.thinking))
            self.notify(f"Thinking {'on' if view.session.settings.thinking else 'off'} for this session")

    def action_session_list(self) -> None:
        """Reopen or delete stored sessions."""
        self.push_screen(SessionsScreen(self.store.sessions(), self.store.message_counts()), self._session_chosen)

    async def _session_chosen(self, choice: Choice | None) -> None:
        if choice is None:
            return
        verb, session_id = choice
        open_view = self.tabs.chat(session_id)
        if verb == "delete":
            if open_view is not None:
                await self.tabs.close_session(session_id)
            self.store.delete_session(session_id)
            if not self.tabs.chats():
                await self.action_new_session()
            self.notify("Session deleted")
        elif open_view is not None:
            self.tabs.activate(session_id)
        else:
            self.store.set_open(session_id, True)
            await self.tabs.open_session(self.store.session(session_id), self.store.messages(session_id),
                                         store=self.store, bridge=self.bridge)

    # ------------------------------------------------------------------ chat actions
    def action_cancel_reply(self) -> None:
        """Stop the reply streaming in the current tab."""
        view = self.current_chat()
        if view is not None and not view.cancel():
            self.notify("Nothing is being generated in this session.", timeout=2)

    def action_regenerate(self) -> None:
        """Replace the current session's last reply."""
        view = self.current_chat()
        if view is not None:
            view.regenerate()

    def action_copy_last(self) -> None:
        """Copy the current session's last reply (OSC 52: works over SSH too)."""
        view = self.current_chat()
        text = view.last_reply() if view is not None else None
        if not text:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(text)
        self.notify(f"Copied the last reply ({len(text)} characters)")

    # ------------------------------------------------------------------ export, panel, help
    def action_export(self, fmt: str) -> None:
        """Export the current session as "markdown" or "json" into the exports folder."""
        self._export(None, "json" if fmt == "json" else "markdown")

    def action_export_to(self) -> None:
        """Ask for a file (or folder) to export the current session to; .json means JSON."""
        self.push_screen(InputDialog("Export to file (.md or .json), or a folder",
                                     str(exports_dir(self.data_dir)) + "/", placeholder="path"),
                         lambda path: self._export(Path(path), None) if path else None)

    def _export(self, path: Path | None, fmt: str | None) -> None:
        view = self.current_chat()
        if view is None:
            return
        try:
            written = write_export(self.store.session(view.session.id), self.store.messages(view.session.id),
                                   folder=exports_dir(self.data_dir), path=path, fmt=fmt)  # type: ignore[arg-type]
        except OSError as e:
            self.notify(one_line(e), title="Export failed", severity="error", markup=False)
            return
        self.notify(f"Exported to {written}", markup=False, timeout=6)

    def action_toggle_panel(self) -> None:
        """Show or hide the engine panel (and stop following the terminal width)."""
        self._panel_choice = not self.panel.display
        self.panel.display = self._panel_choice

    def action_help(self) -> None:
        """Show the key bindings."""
        self.push_screen(HelpScreen(self.keymap, _display_path(config_path(self.data_dir))))
