"""The session tab bar: one tab (and one ChatView) per open session, in the order opened."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import ContentSwitcher, TabbedContent, TabPane

from ..bridge import EngineBridge
from ..store import MessageRecord, SessionRecord, Store
from .chat_view import ChatView

BUSY_MARK = "● "


def pane_id(session_id: str) -> str:
    """The TabPane id of a session."""
    return f"tab-{session_id}"


class SessionTabs(TabbedContent):
    """Tabs of chat sessions. Labels are plain text (a title is never read as markup) and carry
    a dot while the session's reply streams."""

    DEFAULT_CSS = """
    SessionTabs {
        height: 1fr;
        width: 1fr;
    }
    SessionTabs > ContentSwitcher {
        height: 1fr;
    }
    SessionTabs TabPane {
        padding: 0;
        height: 1fr;
    }
    """

    async def open_session(self, session: SessionRecord, history: list[MessageRecord], *, store: Store,
                           bridge: EngineBridge, activate: bool = True) -> ChatView:
        """Add a tab for ``session`` (with its stored turns) and return its chat view."""
        view = ChatView(session, history, store=store, bridge=bridge)
        await self.add_pane(TabPane(Content(session.title), view, id=pane_id(session.id)))
        if activate:
            self.activate(session.id)
        return view

    async def close_session(self, session_id: str) -> None:
        """Remove a session's tab (the view ends its reply first)."""
        view = self.chat(session_id)
        if view is not None:
            view.close()
        await self.remove_pane(pane_id(session_id))

    def chats(self) -> list[ChatView]:
        """The chat views in tab order."""
        # Each pane holds its view as a direct child. A query would walk every widget of every
        # chat (a Markdown block is a widget), at each stats tick and tab-label change: 5 ms a
        # tick with one long chat open.
        return [child for pane in self.get_child_by_type(ContentSwitcher).children
                for child in pane.children if isinstance(child, ChatView)]

    def chat(self, session_id: str) -> ChatView | None:
        """A session's chat view, if it has a tab."""
        for view in self.chats():
            if view.session.id == session_id:
                return view
        return None

    def current(self) -> ChatView | None:
        """The chat view of the active tab."""
        pane = self.active_pane
        if pane is None:
            return None
        return next((child for child in pane.children if isinstance(child, ChatView)), None)

    def activate(self, session_id: str) -> None:
        """Show a session's tab and put the cursor in its input.

        The focus moves here and now (``Widget.focus`` would only queue it behind keys the App
        already holds), so keys typed right after a tab key go to the tab it showed.
        """
        self.active = pane_id(session_id)
        view = self.chat(session_id)
        if view is not None and view.is_mounted:
            self.screen.set_focus(view.input)

    def on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        # TabbedContent makes a pane active when something in it gains focus (a click, tab to
        # focus). That message arrives after the fact: with two tab keys in one read the focus
        # has already moved on, and following it would pull the view back. Follow only the focus
        # where it is now.
        focused = self.screen.focused
        if focused is None or event.tab_pane not in focused.ancestors:
            event.stop()
            event.prevent_default()  # skips TabbedContent's handler

    def cycle(self, step: int) -> None:
        """Move ``step`` tabs to the right (negative: left), wrapping around."""
        views = self.chats()
        current = self.current()
        if not views or current is None:
            return
        self.activate(views[(views.index(current) + step) % len(views)].session.id)

    def goto(self, n: int) -> bool:
        """Show the n-th tab (1-based); False if there are fewer tabs."""
        views = self.chats()
        if not 1 <= n <= len(views):
            return False
        self.activate(views[n - 1].session.id)
        return True

    def set_label(self, session_id: str, title: str, busy: bool) -> None:
        """Update a tab's label."""
        if self.chat(session_id) is None:
            return
        self.get_tab(pane_id(session_id)).label = Content((BUSY_MARK if busy else "") + title)

    def session_titles(self) -> dict[str, str]:
        """Session id → title of every open session (the engine panel names lanes with them)."""
        return {v.session.id: v.session.title for v in self.chats()}
