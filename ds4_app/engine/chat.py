"""The DS4 chat format: rendering a conversation into a prompt, and parsing a reply as it streams.

DS4 ships no Jinja template; its official encoder (``encoding_dsv4.py``, `ds4_spec.md` §10)
renders messages as text with special-token strings, and the tokenizer matches those strings. For
a conversation without tools this comes down to::

    BOS  system-text  <｜User｜>u1<｜Assistant｜></think>a1<｜end▁of▁sentence｜>
         <｜User｜>u2<｜Assistant｜><think>                      (thinking mode)
         <｜User｜>u2<｜Assistant｜></think>                     (chat mode)

- the system message is raw text;
- every user turn is ``<｜User｜>`` + content, and is followed by ``<｜Assistant｜>`` when an
  assistant turn follows or when it is the last message; the marker after ``<｜Assistant｜>`` is
  ``<think>`` only for the last user turn in thinking mode, else ``</think>`` (an empty think);
- an assistant turn is content + ``<｜end▁of▁sentence｜>``; its reasoning is dropped, except for
  an assistant turn after the last user message in thinking mode, which carries
  reasoning + ``</think>`` before its content (it continues the ``<think>`` opened above).

Not rendered here: tools and tool results (DSML), response formats, task tokens, the
``latest_reminder`` role, and Think-Max (see `THINK_MAX_PREFIX`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ds4_app.engine.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
    StreamDecoder,
    Tokenizer,
)

ROLES = ("system", "user", "assistant")

# Think-Max ("reasoning effort: max") prepends a fixed paragraph to the first message in
# thinking mode (§10). We do not have that paragraph verbatim from a source we may copy, and an
# invented one would steer the model differently from its training, so Think-Max is not offered:
# this stays None until the exact text is added from the official encoder.
THINK_MAX_PREFIX: str | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a conversation. ``reasoning`` is an assistant turn's thinking text, if any."""

    role: str
    content: str
    reasoning: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str) or not isinstance(self.reasoning, str):
            raise ValueError("message content and reasoning must be strings")
        if self.reasoning and self.role != "assistant":
            raise ValueError(f"only assistant messages carry reasoning, not {self.role!r} ones")


def render_chat(messages: Sequence[Message], *, thinking: bool, add_bos: bool = True) -> str:
    """Render ``messages`` in the DS4 encoding (`ds4_spec.md` §10) as text with special tokens.

    When the last message is a user turn, the result is the *prompt for the next reply*: it ends
    with ``<｜Assistant｜><think>`` (thinking mode) or ``<｜Assistant｜></think>`` (chat mode), so
    the tokens the model generates next are the assistant's reply (in thinking mode: reasoning,
    then ``</think>``, then the answer, then EOS). When the last message is an assistant turn, the
    result is the complete transcript ending in ``<｜end▁of▁sentence｜>``, not a prompt to generate
    from. ``add_bos`` is False when the text continues a context that already began with BOS.
    """
    last_user = -1
    for i, m in enumerate(messages):
        if m.role == "user":
            last_user = i
    out: list[str] = [BOS_TOKEN] if add_bos else []
    n = len(messages)
    for i, m in enumerate(messages):
        if m.role == "system":
            out.append(m.content)
        elif m.role == "user":
            out.append(USER_TOKEN + m.content)
        else:
            if thinking and i > last_user:
                out.append(m.reasoning + THINK_END_TOKEN)
            out.append(m.content + EOS_TOKEN)
        # The assistant header goes after a user turn only when an assistant turn follows it
        # (written or about to be generated); consecutive user turns run together, as upstream.
        if m.role == "user" and (i + 1 == n or messages[i + 1].role == "assistant"):
            opens_thinking = thinking and i >= last_user
            out.append(ASSISTANT_TOKEN + (THINK_START_TOKEN if opens_thinking else THINK_END_TOKEN))
    return "".join(out)


def encode_chat(
    messages: Sequence[Message], tokenizer: Tokenizer, *, thinking: bool, add_bos: bool = True
) -> list[int]:
    """Token ids of `render_chat`; BOS is added by id rather than by matching its string."""
    ids = tokenizer.encode(render_chat(messages, thinking=thinking, add_bos=False))
    return [tokenizer.bos_id, *ids] if add_bos else ids


@dataclass(frozen=True, slots=True)
class Delta:
    """A piece of newly generated text, on the reasoning or the content channel."""

    kind: Literal["reasoning", "content"]
    text: str


class ReplyParser:
    """Splits a streamed reply into reasoning and content, one generated token at a time.

    In thinking mode the reply starts inside the reasoning (the prompt opened ``<think>``) and
    switches to content at ``</think>``. In chat mode it starts as content; a ``<think>`` …
    ``</think>`` pair the model emits anyway still goes to reasoning, never to content.
    ``<think>``, ``</think>``, EOS and the structural markers (BOS, ``<｜User｜>``,
    ``<｜Assistant｜>``) never appear as text; other special tokens (``｜DSML｜``, task tokens) do,
    since tool-call markup is made of them. Tokens after EOS are ignored. Each channel has its own
    `StreamDecoder`, so no UTF-8 character is ever split.
    """

    __slots__ = (
        "_decoders",
        "_channel",
        "_eos",
        "_think_start",
        "_think_end",
        "_hidden",
        "_done",
        "_parts",
    )

    def __init__(self, tokenizer: Tokenizer, *, thinking: bool) -> None:
        self._decoders: dict[str, StreamDecoder] = {
            "reasoning": tokenizer.stream_decoder(),
            "content": tokenizer.stream_decoder(),
        }
        self._channel: Literal["reasoning", "content"] = "reasoning" if thinking else "content"
        self._eos = tokenizer.eos_id
        self._think_start = _optional_id(tokenizer, THINK_START_TOKEN)
        self._think_end = _optional_id(tokenizer, THINK_END_TOKEN)
        hidden = {tokenizer.bos_id, tokenizer.eos_id}
        for s in (BOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN):
            tid = _optional_id(tokenizer, s)
            if tid is not None:
                hidden.add(tid)
        self._hidden = frozenset(hidden)
        self._done = False
        self._parts: dict[str, list[str]] = {"reasoning": [], "content": []}

    @property
    def finished(self) -> bool:
        """True once EOS was fed or `finish` was called."""
        return self._done

    @property
    def in_reasoning(self) -> bool:
        """True while generated text goes to the reasoning channel."""
        return self._channel == "reasoning"

    @property
    def reasoning(self) -> str:
        """All reasoning text emitted so far."""
        return "".join(self._parts["reasoning"])

    @property
    def content(self) -> str:
        """All content text emitted so far."""
        return "".join(self._parts["content"])

    def feed(self, token_id: int) -> list[Delta]:
        """Consume one generated token; return the deltas it completes (often one, maybe none)."""
        if self._done:
            return []
        if token_id == self._eos:
            return self.finish()
        if token_id == self._think_start:
            return self._switch("reasoning")
        if token_id == self._think_end:
            return self._switch("content")
        if token_id in self._hidden:
            return []
        return self._emit(self._channel, self._decoders[self._channel].push(token_id))

    def finish(self) -> list[Delta]:
        """End of reply: flush both channels (held-back bytes of a cut-off character as U+FFFD)."""
        if self._done:
            return []
        self._done = True
        out = self._emit("reasoning", self._decoders["reasoning"].flush())
        out += self._emit("content", self._decoders["content"].flush())
        return out

    def _switch(self, channel: Literal["reasoning", "content"]) -> list[Delta]:
        out = self._emit(self._channel, self._decoders[self._channel].flush())
        self._channel = channel
        return out

    def _emit(self, kind: Literal["reasoning", "content"], text: str) -> list[Delta]:
        if not text:
            return []
        self._parts[kind].append(text)
        return [Delta(kind, text)]


def _optional_id(tokenizer: Tokenizer, s: str) -> int | None:
    try:
        return tokenizer.token_id(s)
    except KeyError:
        return None
