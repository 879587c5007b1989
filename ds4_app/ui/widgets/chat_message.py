"""One turn of a chat: who spoke, the reasoning (folded) and the text, streamed by appending.

Streaming never re-renders the whole reply: text goes through ``MarkdownStream.write``, which
appends to the Markdown document (only the last block is re-parsed) and batches fragments that
arrive faster than it can render. When the reply ends, the streams stop and the widgets get one
full ``update`` with the final text, so a partly parsed block (an open code fence) cannot drop
content.

A message nobody can see (its chat is in a hidden tab) only collects its text: parsing Markdown
and mounting blocks for five hidden streams cost the UI loop more than the one on screen. It is
drawn in one ``update`` when its tab is shown (``catch_up``).
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownStream

_ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System"}


class ChatMessage(Vertical):
    """A message in the chat view. ``record_id`` is its row in the store (None while streaming)."""

    DEFAULT_CSS = """
    ChatMessage {
        height: auto;
        margin: 0 0 1 0;
        padding: 0 1;
    }
    ChatMessage.-user {
        background: $boost;
        border-left: thick $primary;
    }
    ChatMessage.-assistant {
        border-left: thick $secondary;
    }
    ChatMessage > .role {
        text-style: bold;
        color: $text-muted;
    }
    ChatMessage > Collapsible {
        background: transparent;
        padding-bottom: 0;
        border-top: none;
    }
    ChatMessage Markdown {
        margin: 0;
        padding: 0;
    }
    ChatMessage Markdown > *:last-child {
        margin-bottom: 0;
    }
    ChatMessage .reasoning {
        color: $text-muted;
    }
    ChatMessage > .note {
        color: $text-muted;
        text-style: italic;
    }
    """

    def __init__(self, role: str, content: str = "", reasoning: str = "", *, record_id: int | None = None,
                 note: str = "", streaming: bool = False) -> None:
        super().__init__(classes=f"-{role}")
        self.role = role
        self.record_id = record_id
        self._content = content
        self._reasoning = reasoning
        self._note = note
        self.streaming = streaming
        self._streams: dict[str, MarkdownStream] = {}
        self._behind = False  # text arrived while hidden and is not drawn yet

    def compose(self) -> ComposeResult:
        # The folded reasoning and the note are only created when there is something to show:
        # fewer widgets per message keeps long chats cheap to lay out.
        yield Static(_ROLE_LABELS.get(self.role, self.role), classes="role")
        if self._reasoning:
            yield self._folded()
        yield Markdown(self._content, classes="content")
        if self._note:
            yield Static(self._note, classes="note", markup=False)

    @property
    def content(self) -> str:
        """The message text as far as it has arrived."""
        return self._content

    @property
    def reasoning(self) -> str:
        """The reasoning text as far as it has arrived."""
        return self._reasoning

    async def append(self, content: str = "", reasoning: str = "", *, shown: bool = True) -> None:
        """Stream more text onto the end of the reply (either part may be empty). With ``shown``
        False the text is only kept, to be drawn by ``catch_up``."""
        if not shown:
            self._content += content
            self._reasoning += reasoning
            self._behind = self._behind or bool(content or reasoning)
            return
        if self._behind:
            self._content += content
            self._reasoning += reasoning
            await self.catch_up()
            return
        if reasoning:
            if not self.query(Collapsible):
                await self.mount(self._folded(), before=self.query_one(".content"))
            self._reasoning += reasoning
            await self._stream("reasoning").write(reasoning)
        if content:
            self._content += content
            await self._stream("content").write(content)

    async def finish(self, content: str, reasoning: str, note: str, *, shown: bool = True) -> None:
        """End the stream: render the final text in full once, and show ``note`` under it. With
        ``shown`` False the final render waits for ``catch_up``."""
        self.streaming = False
        self._content, self._reasoning, self._note = content, reasoning, note
        if shown:
            await self._redraw()
        else:
            self._behind = True  # the note too: mounting it would cost a layout pass now

    async def catch_up(self) -> None:
        """Draw the text that arrived while hidden (one full render); nothing if none did."""
        if self._behind:
            await self._redraw()

    async def _redraw(self) -> None:
        """Stop the streams and render the whole text as it is now."""
        self._behind = False
        for stream in self._streams.values():
            await stream.stop()
        self._streams.clear()
        await self.query_one(".content", Markdown).update(self._content)
        if self._reasoning:
            if not self.query(Collapsible):
                await self.mount(self._folded(), before=self.query_one(".content"))
            folded = self.query_one(Collapsible)
            folded.title = self._thinking_title()
            await self.query_one(".reasoning", Markdown).update(self._reasoning)
        await self.set_note(self._note)

    async def set_note(self, note: str) -> None:
        """Set the small line under the message (how a reply ended)."""
        self._note = note
        existing = self.query(".note")
        if existing:
            existing.first(Static).update(note)
        elif note:
            await self.mount(Static(note, classes="note", markup=False))

    def on_unmount(self) -> None:
        # A tab closed mid-reply: stop the stream tasks without awaiting them (the widgets they
        # write to are going away).
        for stream in self._streams.values():
            if stream._task is not None:  # noqa: SLF001 - MarkdownStream offers no sync cancel
                stream._task.cancel()
        self._streams.clear()

    def _folded(self) -> Collapsible:
        return Collapsible(Markdown(self._reasoning, classes="reasoning"), collapsed=True,
                           title=self._thinking_title())

    def _stream(self, part: str) -> MarkdownStream:
        stream = self._streams.get(part)
        if stream is None:
            stream = Markdown.get_stream(self.query_one(f".{part}", Markdown))
            self._streams[part] = stream
        return stream

    def _thinking_title(self) -> str:
        if self.streaming:
            return "Thinking…"
        words = len(self._reasoning.split())
        return f"Thought ({words} words)"
