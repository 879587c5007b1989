"""Request parsing: an OpenAI-style JSON body in, a checked ``GenerationRequest`` out.

Each field is checked once here, with a 400 that names it (``param``) and says what is allowed.
Unknown fields are ignored (clients send many), but a field we do not support whose value would
change what the answer means (``n`` > 1, ``logprobs``, ``tools``, ``response_format`` other than
text, a non-empty ``logit_bias``, ``echo``, ``best_of`` > 1, ``suffix``) is refused rather than
silently dropped. Ranges follow the OpenAI API where it defines one (temperature 0-2, penalties
-2..2) and vLLM's elsewhere (repetition_penalty in (0, 2]).

Thinking is chosen by, in order of precedence: ``chat_template_kwargs.thinking`` (or
``enable_thinking``), ``thinking`` (a bool or ``{"type": "enabled"|"disabled"}``),
``reasoning_effort`` / ``reasoning.effort`` ("none"/"minimal" off, "low"/"medium"/"high" on),
then the server's default.

``session_id`` (a ds4-app extension, chat only) names a resident session: the slot stays resident
after the answer, and a next request with the same ``session_id`` whose messages continue the
conversation (the reply as returned, then new messages) prefills only the new tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from ds4_app.engine.api import GenerationRequest
from ds4_app.engine.chat import Message
from ds4_app.engine.sampling import SamplerConfig

from .errors import ApiError, bad_request

# /v1/completions without max_tokens generates 16 tokens, as the OpenAI API and vLLM do; chat
# generates until EOS or the end of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
_EFFORT_THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A checked request: what to generate and how to answer it."""

    kind: Literal["chat", "completion"]
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    model: str


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says why it is not one."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {_kind(body)}", code="invalid_json")
    return body


def parse_chat(body: dict[str, Any], *, models: Collection[str], model_name: str,
               default_thinking: bool = False) -> ParsedRequest:
    """Check a /v1/chat/completions body."""
    model = _model(body, models, model_name)
    _refuse_unsupported(body, chat=True)
    messages = _messages(body.get("messages"))
    stream, include_usage = _stream(body)
    thinking = _thinking(body, default_thinking)
    max_tokens = _opt_int(body, "max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", lo=1)
    sampling = _sampling(body, max_tokens)
    session = _session(body)
    return ParsedRequest("chat", GenerationRequest(messages=messages, sampling=sampling, thinking=thinking,
                                                   session=session),
                         stream, include_usage, model)


def parse_completion(body: dict[str, Any], *, models: Collection[str], model_name: str) -> ParsedRequest:
    """Check a /v1/completions body."""
    model = _model(body, models, model_name)
    _refuse_unsupported(body, chat=False)
    prompt = _prompt(body.get("prompt", _MISSING))
    stream, include_usage = _stream(body)
    max_tokens = _opt_int(body, "max_tokens", lo=1)
    sampling = _sampling(body, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    return ParsedRequest("completion", GenerationRequest(prompt=prompt, sampling=sampling), stream,
                         include_usage, model)


# --- pieces ---------------------------------------------------------------------------------

_MISSING = object()


def _kind(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _model(body: dict[str, Any], models: Collection[str], model_name: str) -> str:
    m = body.get("model")
    if m is None:
        return model_name
    if not isinstance(m, str):
        raise bad_request(f"model must be a string, got {_kind(m)}", "model")
    if m not in models:
        raise bad_request(f"model {m!r} is not served here; this server serves {model_name!r} "
                          "(see GET /v1/models)", "model", code="model_not_found")
    return m


def _refuse_unsupported(body: dict[str, Any], *, chat: bool) -> None:
    """400 for fields whose value would change the answer's meaning and that we do not implement."""
    n = body.get("n")
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool):
            raise bad_request(f"n must be an integer, got {_kind(n)}", "n")
        if n != 1:
            raise bad_request(f"n={n} is not supported: this server returns one choice; send {n} requests",
                              "n", code="unsupported_parameter")
    lp = body.get("logprobs")
    if lp not in (None, False):  # also lets 0 through (0 == False): "no logprobs" on /v1/completions
        raise bad_request("logprobs are not supported by this server", "logprobs", code="unsupported_parameter")
    if body.get("top_logprobs") not in (None, 0):
        raise bad_request("top_logprobs is not supported by this server", "top_logprobs",
                          code="unsupported_parameter")
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise bad_request(f"{name} (function calling) is not supported by this server", name,
                              code="unsupported_parameter")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise bad_request(f"{name} is not supported by this server (no tools)", name,
                              code="unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") != "text":
            kind = rf.get("type") if isinstance(rf, dict) else _kind(rf)
            raise bad_request(f"response_format {kind!r} is not supported; only {{\"type\": \"text\"}}",
                              "response_format", code="unsupported_parameter")
    lb = body.get("logit_bias")
    if lb not in (None, {}):
        raise bad_request("logit_bias is not supported by this server", "logit_bias", code="unsupported_parameter")
    if body.get("audio") is not None:
        raise bad_request("audio output is not supported", "audio", code="unsupported_parameter")
    if not chat:
        if body.get("echo") not in (None, False):
            raise bad_request("echo is not supported by this server", "echo", code="unsupported_parameter")
        bo = body.get("best_of")
        if bo not in (None, 1):
            raise bad_request("best_of other than 1 is not supported", "best_of", code="unsupported_parameter")
        if body.get("suffix") not in (None, ""):
            raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix",
                              code="unsupported_parameter")


def _messages(raw: Any) -> tuple[Message, ...]:
    if raw is None:
        raise bad_request("messages is required: a non-empty array of {role, content}", "messages")
    if not isinstance(raw, list):
        raise bad_request(f"messages must be an array, got {_kind(raw)}", "messages")
    if not raw:
        raise bad_request("messages is empty: send at least one message", "messages")
    out: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object, got {_kind(m)}", where)
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role in ("tool", "function"):
            raise bad_request(f"{where}: {role} messages are not supported (no function calling)", f"{where}.role")
        if role not in ("system", "user", "assistant"):
            raise bad_request(f"{where}.role must be one of system, user, assistant (or developer), "
                              f"got {role!r}", f"{where}.role")
        if m.get("tool_calls") not in (None, []):
            raise bad_request(f"{where}: tool_calls are not supported", f"{where}.tool_calls")
        content = _content(m.get("content", _MISSING), role, where)
        reasoning = ""
        if role == "assistant":
            r = m.get("reasoning_content", m.get("reasoning"))
            if r is not None:
                if not isinstance(r, str):
                    raise bad_request(f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
                reasoning = r
        out.append(Message(role, content, reasoning))
    if out[-1].role != "user":
        raise bad_request(f"the last message must have role 'user', got {out[-1].role!r}; continuing an "
                          "assistant or system message is not supported", f"messages[{len(out) - 1}].role")
    return tuple(out)


def _content(c: Any, role: str, where: str) -> str:
    if isinstance(c, str):
        return c
    if c is _MISSING or c is None:
        if role == "assistant":
            return ""
        raise bad_request(f"{where}.content is required for a {role} message", f"{where}.content")
    if isinstance(c, list):
        texts: list[str] = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _kind(part)
                raise bad_request(f"{where}.content[{j}]: only text parts are supported, got {kind!r}",
                                  f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where}.content must be a string or an array of text parts, got {_kind(c)}",
                      f"{where}.content")


def _prompt(p: Any) -> str:
    if p is _MISSING or p is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(p, list):
        if len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        elif p and all(isinstance(x, str) for x in p):
            raise bad_request(f"batched prompts ({len(p)}) are not supported: send one request per prompt",
                              "prompt", code="unsupported_parameter")
        else:
            raise bad_request("prompt must be a string; token-id prompts are not supported", "prompt")
    if not isinstance(p, str):
        raise bad_request(f"prompt must be a string, got {_kind(p)}", "prompt")
    if not p:
        raise bad_request("prompt is empty", "prompt")
    return p


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _opt_bool(body, "stream") or False
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(so, dict):
        raise bad_request(f"stream_options must be an object, got {_kind(so)}", "stream_options")
    iu = so.get("include_usage")
    if iu is not None and not isinstance(iu, bool):
        raise bad_request("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    return stream, bool(iu)


def _thinking(body: dict[str, Any], default: bool) -> bool:
    ctk = body.get("chat_template_kwargs")
    if ctk is not None:
        if not isinstance(ctk, dict):
            raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
        for key in ("thinking", "enable_thinking"):
            if key in ctk and ctk[key] is not None:
                if not isinstance(ctk[key], bool):
                    raise bad_request(f"chat_template_kwargs.{key} must be a boolean", f"chat_template_kwargs.{key}")
                return ctk[key]
    t = body.get("thinking")
    if t is not None:
        if isinstance(t, bool):
            return t
        if isinstance(t, dict) and t.get("type") in ("enabled", "disabled"):
            return t["type"] == "enabled"
        raise bad_request('thinking must be a boolean or {"type": "enabled"|"disabled"}', "thinking")
    effort, param = body.get("reasoning_effort"), "reasoning_effort"
    if effort is None and isinstance(body.get("reasoning"), dict):
        effort, param = body["reasoning"].get("effort"), "reasoning.effort"
    if effort is not None:
        if effort in ("max", "xhigh"):
            raise bad_request(f"{param} {effort!r} (Think-Max) is not supported; use high", param,
                              code="unsupported_parameter")
        if effort not in _EFFORT_THINKING:
            raise bad_request(f"{param} must be one of {', '.join(_EFFORT_THINKING)}, got {effort!r}", param)
        return _EFFORT_THINKING[effort]
    return default


def _sampling(body: dict[str, Any], max_tokens: int | None) -> SamplerConfig:
    temperature = _opt_num(body, "temperature", 0.0, 2.0)
    top_p = _opt_num(body, "top_p", 0.0, 1.0, lo_open=True)
    min_p = _opt_num(body, "min_p", 0.0, 1.0)
    presence = _opt_num(body, "presence_penalty", -2.0, 2.0)
    frequency = _opt_num(body, "frequency_penalty", -2.0, 2.0)
    rep_name = "repetition_penalty" if "repetition_penalty" in body else "repeat_penalty"  # llama.cpp's name
    repetition = _opt_num(body, rep_name, 0.0, 2.0, lo_open=True)
    top_k = _opt_int(body, "top_k", lo=-1)
    last_n = _opt_int(body, "repeat_last_n", lo=-1)
    seed = _opt_int(body, "seed", lo=-1, hi=2**64 - 1)
    ignore_eos = _opt_bool(body, "ignore_eos")
    stop = _stop(body.get("stop"))
    kwargs: dict[str, Any] = {
        "temperature": temperature, "top_p": top_p, "min_p": min_p, "presence_penalty": presence,
        "frequency_penalty": frequency, "repetition_penalty": repetition,
        # -1 means "off" for top_k in vLLM and "random" for seed in llama.cpp; ours are 0 and None.
        "top_k": 0 if top_k == -1 else top_k, "penalty_last_n": last_n,
        "seed": None if seed == -1 else seed, "ignore_eos": ignore_eos,
    }
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    try:
        return SamplerConfig(max_tokens=max_tokens, stop=stop, **kwargs)
    except ValueError as e:  # a combination the sampler refuses; the ranges above catch single fields
        raise bad_request(str(e)) from None


def _stop(s: Any) -> tuple[str, ...]:
    if s is None:
        return ()
    items = [s] if isinstance(s, str) else s
    if not isinstance(items, list):
        raise bad_request(f"stop must be a string or an array of strings, got {_kind(s)}", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS}", "stop")
    for x in items:
        if not isinstance(x, str) or not x:
            raise bad_request("stop strings must be non-empty strings", "stop")
    return tuple(items)


MAX_SESSION_ID = 128


def _session(body: dict[str, Any]) -> str | None:
    v = body.get("session_id")
    if v is None:
        return None
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_SESSION_ID:
        raise bad_request(f"session_id must be a string of 1 to {MAX_SESSION_ID} characters, got {_kind(v)}",
                          "session_id")
    return v


def _opt_bool(body: dict[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad_request(f"{name} must be a boolean, got {_kind(v)}", name)
    return v


def _opt_num(body: dict[str, Any], name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"{name} must be a number, got {_kind(v)}", name)
    if v < lo or (lo_open and v == lo) or v > hi:
        raise bad_request(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", name)
    return float(v)


def _opt_int(body: dict[str, Any], name: str, *, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # JSON has one number type; 256.0 is an integer
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{name} must be an integer, got {_kind(v)}", name)
    if v < lo or (hi is not None and v > hi):
        raise bad_request(f"{name} must be >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {v}",
                          name)
    return v


__all__ = ["ApiError", "ParsedRequest", "parse_chat", "parse_completion", "parse_json"]
