"""One session's chat: the message list, a status line and the input; owns its running reply.

Everything that changes the chat runs on this widget's own message queue (sends arrive as
messages, and App actions are scheduled with ``call_later``), so a reply chunk can never be
handled halfway through a send or a regenerate. Turns are written to the store as they become
final: the user's turn once the engine accepted the request, the reply when it finishes
(also when it was cancelled or failed part-way; an empty reply is not kept).

Only the last messages are drawn (about ``LOG_CHARS`` of text; older ones come back in batches
when the user scrolls to the top or clicks the line there). Every layout pass of the screen walks
every mounted widget, and a Markdown message is a widget per block: with 30 long turns drawn
(~1,000 widgets) a pass took 70 ms or more, and one ran at every frame of a streaming reply and
whenever another tab started or ended a reply.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from ds4_app.engine.api import Finished, GenerationRequest, ServiceError, Usage
from ds4_app.engine.chat import Message

from ..bridge import EngineBridge
from ..formatting import finish_meta, finish_note
from ..messages import EarlierRequested, PromptSubmitted, ReplyChunk, SessionBusyChanged, SessionTitleChanged
from ..session_settings import SessionSettings
from ..store import MessageRecord, SessionRecord, Store
from .chat_input import ChatInput
from .chat_message import ChatMessage
from .earlier_line import EarlierLine

DEFAULT_TITLE = re.compile(r"Chat \d+")
TITLE_CHARS = 32
LOG_CHARS = 8_000  # text drawn in the log (about two screens), then earlier batches on demand
LOG_MESSAGES = 30  # and at most this many messages (short ones are widgets too)


def window_start(history: list[MessageRecord], end: int, *, chars: int = LOG_CHARS,
                 max_messages: int = LOG_MESSAGES) -> int:
    """Where to start drawing the messages before ``end``: the last ones whose text adds up to
    at most ``chars`` and ``max_messages``, but always the last two (a turn and its reply)."""
    start, total = end, 0
    while start > 0:
        size = len(history[start - 1].content) + len(history[start - 1].reasoning)
        if end - start >= 2 and (total + size > chars or end - start >= max_messages):
            break
        total += size
        start -= 1
    return start


@dataclass(slots=True, eq=False)
class _Reply:
    """The reply being streamed into ``widget``."""

    request_id: str
    widget: ChatMessage
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    cancel_requested: bool = False


class ChatView(Vertical):
    """A chat session in a tab."""

    DEFAULT_CSS = """
    ChatView {
        height: 1fr;
    }
    ChatView > #log {
        height: 1fr;
        padding: 0 1;
    }
    ChatView > #status {
        height: 1;
        padding: 0 1;
        color: $text-muted;
    }
    """

    def __init__(self, session: SessionRecord, history: list[MessageRecord], *, store: Store,
                 bridge: EngineBridge) -> None:
        super().__init__(id=f"chat-{session.id}")
        self.session = session
        self._history = list(history)
        self._store = store
        self._bridge = bridge
        self._reply: _Reply | None = None
        self._drawn_from = window_start(self._history, len(self._history))  # first drawn message
        self._drawing_earlier = False

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="log"):
            yield EarlierLine(self._drawn_from)
            for m in self._history[self._drawn_from:]:
                yield _message_widget(m)
        yield Static(self._settings_line(), id="status", markup=False)
        yield ChatInput(id="input")

    def on_mount(self) -> None:
        log = self.query_one("#log", VerticalScroll)
        # Stay at the bottom while replies stream in, until the user scrolls up.
        log.anchor()
        self.watch(log, "scroll_y", self._scrolled, init=False)

    # ------------------------------------------------------------------ queries
    @property
    def busy(self) -> bool:
        """True while a reply is streaming."""
        return self._reply is not None

    @property
    def request_id(self) -> str | None:
        """The running reply's request id, if any."""
        return self._reply.request_id if self._reply else None

    @property
    def history(self) -> list[MessageRecord]:
        """The stored turns, in order (the streaming reply is not among them yet)."""
        return list(self._history)

    def last_reply(self) -> str | None:
        """The text of the last finished reply, or None."""
        for m in reversed(self._history):
            if m.role == "assistant":
                return m.content
        return None

    @property
    def shown(self) -> bool:
        """True while this chat is on screen (not in a hidden tab). A hidden chat keeps the text
        of its reply and draws it when shown (``catch_up``)."""
        return all(node.display for node in self.ancestors_with_self)

    @property
    def input(self) -> ChatInput:
        """The message box."""
        return self.query_one(ChatInput)

    # ------------------------------------------------------------------ commands (from the App)
    def cancel(self) -> bool:
        """Stop the running reply. Returns False when nothing runs. A second cancel while the
        engine has not answered the first ends the reply here (the engine may be wedged)."""
        reply = self._reply
        if reply is None:
            return False
        if reply.cancel_requested:
            self.call_later(self._finish, reply, Finished("cancelled", Usage(0, 0)))
        else:
            reply.cancel_requested = True
            self._bridge.cancel(reply.request_id)
        return True

    def regenerate(self) -> None:
        """Replace the replies after the last user turn with a new one (scheduled on this view)."""
        self.call_later(self._regenerate)

    def apply_settings(self, settings: SessionSettings) -> None:
        """Use ``settings`` for the next replies and store them."""
        self._store.set_settings(self.session.id, settings)
        self.session = dataclasses.replace(self.session, settings=settings)
        self.query_one("#status", Static).update(self._settings_line(), layout=False)

    def rename(self, title: str) -> None:
        """Give the session a new title (stored, and announced to the tab bar)."""
        self._store.rename_session(self.session.id, title)
        self.session = dataclasses.replace(self.session, title=title)
        self.post_message(SessionTitleChanged(self.session.id, title))

    @property
    def drawn_from(self) -> int:
        """How many of the first stored messages are not drawn (the log shows the rest)."""
        return self._drawn_from

    def show_earlier(self) -> None:
        """Draw another batch of earlier messages above the first one drawn (scheduled)."""
        if self._drawn_from > 0 and not self._drawing_earlier:
            self._drawing_earlier = True
            self.call_later(self._show_earlier)

    def catch_up(self) -> None:
        """Draw what arrived while the tab was hidden (scheduled on this view, after the chunks
        already queued)."""
        self.call_later(self._catch_up)

    async def _catch_up(self) -> None:
        for message in self.query(ChatMessage):
            await message.catch_up()
        self.query_one("#log", VerticalScroll).scroll_end(animate=False)

    def close(self) -> None:
        """Before the tab goes away: cancel a running reply and keep what it said so far."""
        reply = self._reply
        if reply is None:
            return
        self._bridge.cancel(reply.request_id)
        self._reply = None
        self._keep_reply(reply, Finished("cancelled", Usage(0, 0)))

    # ------------------------------------------------------------------ the drawn window
    def on_earlier_requested(self, message: EarlierRequested) -> None:
        message.stop()
        self.show_earlier()

    def _scrolled(self, scroll_y: float) -> None:
        if scroll_y <= 0 and self.query_one("#log", VerticalScroll).max_scroll_y > 0:
            self.show_earlier()

    async def _show_earlier(self) -> None:
        try:
            end = self._drawn_from
            start = window_start(self._history, end)
            log = self.query_one("#log", VerticalScroll)
            first = next(iter(log.query(ChatMessage)), None)
            batch = [_message_widget(m) for m in self._history[start:end]]
            if first is not None:
                await log.mount_all(batch, before=first)
            else:
                await log.mount_all(batch)
            self._drawn_from = start
            self.query_one(EarlierLine).show_count(start)
            if first is not None:
                # Keep what the user was reading in place: the batch went in above it.
                self.call_after_refresh(log.scroll_to_widget, first, top=True, animate=False)
        finally:
            self._drawing_earlier = False

    async def _trim(self) -> None:
        """Stop drawing the oldest messages once the drawn text is twice the window, while the
        user follows the end of the chat (never under someone reading back)."""
        log = self.query_one("#log", VerticalScroll)
        drawn = sum(len(m.content) + len(m.reasoning) for m in self._history[self._drawn_from:])
        if drawn <= 2 * LOG_CHARS or log.scroll_y < log.max_scroll_y - 1 or self._drawing_earlier:
            return
        start = window_start(self._history, len(self._history))
        gone = {m.id for m in self._history[self._drawn_from:start]}
        await log.remove_children([w for w in log.query(ChatMessage) if w.record_id in gone])
        self._drawn_from = start
        self.query_one(EarlierLine).show_count(start)

    # ------------------------------------------------------------------ sending
    async def on_prompt_submitted(self, message: PromptSubmitted) -> None:
        message.stop()
        if not await self._start(message.text):
            self.input.restore(message.text)

    async def _start(self, text: str | None) -> bool:
        """Submit a reply to the conversation (plus ``text`` as a new user turn, if given)."""
        if self._reply is not None:
            self.notify("A reply is still streaming in this session; Esc cancels it.", severity="warning")
            return False
        turns = [m.as_message() for m in self._history]
        if text is not None:
            turns.append(Message("user", text))
        settings = self.session.settings
        system = (Message("system", settings.system_prompt),) if settings.system_prompt else ()
        request = GenerationRequest(messages=system + tuple(turns), sampling=settings.sampler(),
                                    thinking=settings.thinking, session=self.session.id)
        try:
            request_id = self._bridge.submit(request, self)
        except ServiceError as e:
            self.notify(str(e) or type(e).__name__, title="Not sent", severity="error", timeout=8, markup=False)
            return False
        log = self.query_one("#log", VerticalScroll)
        if text is not None:
            if not self._history and DEFAULT_TITLE.fullmatch(self.session.title):
                self.rename(_title_from(text))
            record = self._store.add_message(self.session.id, "user", text)
            self._history.append(record)
            await log.mount(ChatMessage("user", text, record_id=record.id))
        widget = ChatMessage("assistant", streaming=True)
        self._reply = _Reply(request_id, widget)
        await log.mount(widget)
        log.scroll_end(animate=False)
        # The status line is one line whatever it says: a repaint, not a layout pass.
        self.query_one("#status", Static).update("streaming…  (Esc cancels)", layout=False)
        self.post_message(SessionBusyChanged(self.session.id, True))
        return True

    async def _regenerate(self) -> None:
        if self._reply is not None:
            self.notify("A reply is still streaming in this session; Esc cancels it.", severity="warning")
            return
        last_user = max((i for i, m in enumerate(self._history) if m.role == "user"), default=None)
        if last_user is None:
            self.notify("Nothing to regenerate yet: send a message first.", severity="warning")
            return
        dropped = self._history[last_user + 1:]
        kept = self._history[: last_user + 1]
        self._history = kept
        if not await self._start(None):
            self._history = kept + dropped  # refused: the old reply stays
            return
        for m in dropped:
            self._store.delete_message(m.id)
            for widget in self.query(ChatMessage):
                if widget.record_id == m.id:
                    await widget.remove()

    # ------------------------------------------------------------------ receiving
    async def on_reply_chunk(self, chunk: ReplyChunk) -> None:
        chunk.stop()
        reply = self._reply
        if reply is None or chunk.request_id != reply.request_id:
            return  # a reply this view already ended (closed or force-cancelled)
        if chunk.content:
            reply.content.append(chunk.content)
        if chunk.reasoning:
            reply.reasoning.append(chunk.reasoning)
        await reply.widget.append(chunk.content, chunk.reasoning, shown=self.shown)
        if chunk.finished is not None:
            await self._finish(reply, chunk.finished)

    async def _finish(self, reply: _Reply, finished: Finished) -> None:
        if self._reply is not reply:
            return
        self._reply = None
        note = finish_note(finish_meta(finished))
        content, reasoning = "".join(reply.content), "".join(reply.reasoning)
        # Stored before any await, so "not busy" always means "saved".
        if self._keep_reply(reply, finished):
            await reply.widget.finish(content, reasoning, note, shown=self.shown)
        else:
            await reply.widget.remove()
        if finished.finish_reason == "error":
            self.notify(finished.error or "the engine failed this reply", title="Reply failed",
                        severity="error", timeout=8, markup=False)
        self.query_one("#status", Static).update(self._settings_line(), layout=False)
        self.post_message(SessionBusyChanged(self.session.id, False))
        if self.shown:
            await self._trim()

    def _keep_reply(self, reply: _Reply, finished: Finished) -> bool:
        """Store a finished (or cut-short) reply; False when it said nothing at all."""
        content, reasoning = "".join(reply.content), "".join(reply.reasoning)
        if not content and not reasoning:
            return False
        record = self._store.add_message(self.session.id, "assistant", content, reasoning, finish_meta(finished))
        self._history.append(record)
        reply.widget.record_id = record.id
        return True

    def _settings_line(self) -> str:
        return self.session.settings.summary()


def _message_widget(m: MessageRecord) -> ChatMessage:
    """The widget of a stored message."""
    return ChatMessage(m.role, m.content, m.reasoning, record_id=m.id, note=finish_note(m.meta))


def _title_from(text: str) -> str:
    """A tab title from the first line of a message."""
    line = " ".join(text.strip().splitlines()[0].split()) if text.strip() else "Chat"
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"
