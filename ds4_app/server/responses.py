"""Response bodies: OpenAI chat/text completion objects, stream chunks and usage with timings.

Reasoning (thinking) text goes to ``reasoning_content`` (in ``message`` or ``delta`` for chat,
in the choice for text completions), never into ``content``. ``usage`` carries the OpenAI
fields plus ``prompt_tokens_details.cached_tokens`` (tokens a resident session did not have to
prefill again) and ``timings``: queue, time to first token, prefill and decode durations in
milliseconds with their rates in tokens/s, as measured by the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ds4_app.engine.api import Finished, Usage

from .schemas import ParsedRequest


def usage_body(u: Usage) -> dict[str, Any]:
    """OpenAI usage plus cached tokens and engine timings."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "timings": {
            "queue_ms": round(u.queue_s * 1e3, 3),
            "ttft_ms": round(u.ttft_s * 1e3, 3),
            "prefill_ms": round(u.prefill_s * 1e3, 3),
            "prefill_tokens": u.prompt_tokens - u.cached_tokens,
            "prefill_tok_s": round(u.prefill_tok_s, 3),
            "decode_ms": round(u.decode_s * 1e3, 3),
            "decode_tok_s": round(u.decode_tok_s, 3),
            "total_ms": round(u.total_s * 1e3, 3),
        },
    }


class ResponseBuilder:
    """Builds the bodies of one request's answer (one choice, index 0), streamed or whole."""

    __slots__ = ("parsed", "id", "created", "_chat")

    def __init__(self, parsed: ParsedRequest) -> None:
        self.parsed = parsed
        self._chat = parsed.kind == "chat"
        self.id = ("chatcmpl-" if self._chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    # --- whole answers ---
    def complete(self, content: str, reasoning: str, fin: Finished) -> dict[str, Any]:
        """The non-streamed answer."""
        if self._chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = reasoning
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                      "finish_reason": fin.finish_reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": fin.finish_reason}
            if reasoning:
                choice["reasoning_content"] = reasoning
        return {**self._head(False), "choices": [choice], "usage": usage_body(fin.usage)}

    # --- stream chunks ---
    def first_chunk(self) -> dict[str, Any] | None:
        """The role chunk that opens a chat stream (text completions have none)."""
        if not self._chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None)

    def delta_chunk(self, kind: str, text: str) -> dict[str, Any]:
        """A chunk carrying one piece of content or reasoning."""
        key = "content" if kind == "content" else "reasoning_content"
        if self._chat:
            return self._chunk({key: text}, None)
        return self._text_chunk(key, text, None)

    def final_chunks(self, fin: Finished) -> list[dict[str, Any]]:
        """The finish_reason chunk, then (with include_usage) the usage chunk with no choices."""
        if self._chat:
            out = [self._chunk({}, fin.finish_reason)]
        else:
            out = [self._text_chunk("text", "", fin.finish_reason)]
        if self.parsed.include_usage:
            out.append({**self._head(True), "choices": [], "usage": usage_body(fin.usage)})
        return out

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self._chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.parsed.model}

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        body = {**self._head(True),
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if self.parsed.include_usage:
            body["usage"] = None  # OpenAI: every chunk but the last carries usage: null
        return body

    def _text_chunk(self, key: str, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
        if key == "reasoning_content":
            choice["reasoning_content"] = text
        else:
            choice["text"] = text
        body = {**self._head(True), "choices": [choice]}
        if self.parsed.include_usage:
            body["usage"] = None
        return body
