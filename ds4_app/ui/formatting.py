"""Small text formatters shared by the widgets and exports (numbers people read at a glance)."""

from __future__ import annotations

from typing import Any, Mapping

from ds4_app.engine.api import Finished


def rate(tok_s: float) -> str:
    """Tokens per second with sensible precision: ``0.8``, ``31.2``, ``1234``."""
    if tok_s >= 1000:
        return f"{tok_s:.0f}"
    return f"{tok_s:.1f}"


def seconds(s: float) -> str:
    """A duration: milliseconds below one second, else seconds."""
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def size(n_bytes: int) -> str:
    """Bytes in binary units (``512 B``, ``3.00 MiB``, ``12.5 GiB``)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, i = float(n_bytes), 0
    while value >= 1024 and i < len(units) - 1:
        value /= 1024
        i += 1
    if i == 0:
        return f"{int(value)} B"
    return f"{value:.2f} {units[i]}" if value < 10 else f"{value:.1f} {units[i]}"


def finish_meta(finished: Finished) -> dict[str, Any]:
    """What a stored reply keeps about how it ended (the ``meta`` JSON of its message row)."""
    u = finished.usage
    meta: dict[str, Any] = {
        "finish_reason": finished.finish_reason,
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "cached_tokens": u.cached_tokens,
        "ttft_s": round(u.ttft_s, 4),
        "decode_tok_s": round(u.decode_tok_s, 2),
    }
    if finished.error:
        meta["error"] = finished.error
    return meta


def finish_note(meta: Mapping[str, Any]) -> str:
    """One line under a reply: how it ended, tokens, time to first token and decode rate."""
    reason = str(meta.get("finish_reason", ""))
    if not reason:
        return ""
    parts = [{"stop": "done", "length": "max tokens reached"}.get(reason, reason)]
    if meta.get("completion_tokens"):
        cached = meta.get("cached_tokens") or 0
        prompt = f"{meta.get('prompt_tokens', 0)} prompt" + (f" ({cached} cached)" if cached else "")
        parts.append(f"{prompt} → {meta['completion_tokens']} tokens")
    if meta.get("ttft_s"):
        parts.append(f"TTFT {seconds(float(meta['ttft_s']))}")
    if meta.get("decode_tok_s"):
        parts.append(f"{rate(float(meta['decode_tok_s']))} tok/s")
    return " · ".join(parts)
