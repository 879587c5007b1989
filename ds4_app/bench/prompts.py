"""Bench prompts: loading a fixture and choosing the prompts of each wave.

A fixture is JSONL, one prompt per line, in one of three shapes:
``{"text": "..."}`` (one user message), ``{"messages": [{"role": ..., "content": ...}, ...]}``
(a conversation) or ``{"prompt": "..."}`` (raw completion text, no chat template). An optional
``id`` names the prompt in reports.

Two kinds of selection (serving_notes §4):
- replicated: the same prompt in every lane of every wave;
- distinct: wave w of a level at concurrency C takes prompts [w*C, (w+1)*C) of the fixture, so a
  prompt is never reused within a level. Every level starts again from prompt 0, which makes the
  C=1 prompts a prefix of the C=2 ones, and so on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..engine.api import GenerationRequest
from ..engine.chat import Message
from ..engine.sampling import SamplerConfig
from .fixtures import MIXED, REPLICATED


class PromptError(ValueError):
    """A fixture that cannot be used (one line that names the file and the problem)."""


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """One prompt of a fixture: chat messages, or raw text when ``raw`` is set."""

    id: str
    messages: tuple[Message, ...] = ()
    raw: str | None = None

    def request(self, sampling: SamplerConfig, *, thinking: bool = False) -> GenerationRequest:
        """A fresh GenerationRequest (a new request id each call) for this prompt."""
        if self.raw is not None:
            return GenerationRequest(prompt=self.raw, sampling=sampling)
        return GenerationRequest(messages=self.messages, sampling=sampling, thinking=thinking)

    @property
    def sha256(self) -> str:
        """Hash of exactly what is sent (roles and texts, or the raw text)."""
        if self.raw is not None:
            body = json.dumps({"prompt": self.raw}, ensure_ascii=False)
        else:
            body = json.dumps({"messages": [[m.role, m.content] for m in self.messages]}, ensure_ascii=False)
        return hashlib.sha256(body.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class PromptSet:
    """A loaded fixture; ``replicated`` means every lane sends ``prompts[0]``."""

    name: str
    prompts: tuple[BenchPrompt, ...]
    replicated: bool

    def waves(self, concurrency: int, n_waves: int) -> list[list[BenchPrompt]]:
        """The prompts of each wave of one level (``n_waves`` lists of ``concurrency`` prompts)."""
        if concurrency < 1 or n_waves < 1:
            raise PromptError("concurrency and waves must be at least 1")
        if self.replicated:
            return [[self.prompts[0]] * concurrency for _ in range(n_waves)]
        need = concurrency * n_waves
        if need > len(self.prompts):
            raise PromptError(f"{self.name} has {len(self.prompts)} prompts; concurrency {concurrency} x "
                              f"{n_waves} waves needs {need} distinct prompts (use fewer waves or a larger file)")
        return [list(self.prompts[w * concurrency:(w + 1) * concurrency]) for w in range(n_waves)]


def _parse_line(obj: object, where: str, index: int) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: expected a JSON object")
    pid = str(obj.get("id", f"p{index:03d}"))
    shapes = [k for k in ("text", "messages", "prompt") if k in obj]
    if len(shapes) != 1:
        raise PromptError(f"{where}: needs exactly one of \"text\", \"messages\" or \"prompt\"")
    kind = shapes[0]
    if kind == "prompt":
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise PromptError(f"{where}: \"prompt\" must be a non-empty string")
        return BenchPrompt(id=pid, raw=obj["prompt"])
    if kind == "text":
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise PromptError(f"{where}: \"text\" must be a non-empty string")
        return BenchPrompt(id=pid, messages=(Message("user", obj["text"]),))
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise PromptError(f"{where}: \"messages\" must be a non-empty list")
    try:
        parsed = tuple(Message(str(m["role"]), str(m["content"])) for m in msgs)
    except (KeyError, TypeError, ValueError) as e:
        raise PromptError(f"{where}: bad message ({e})") from None
    return BenchPrompt(id=pid, messages=parsed)


def read_jsonl(path: Path, name: str | None = None, *, replicated: bool = False) -> PromptSet:
    """Load a JSONL fixture; PromptError names the file and line of any problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PromptError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    prompts: list[BenchPrompt] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{where}: not JSON ({e.msg})") from None
        prompts.append(_parse_line(obj, where, len(prompts)))
    if not prompts:
        raise PromptError(f"{path}: no prompts")
    return PromptSet(name=name or path.name, prompts=tuple(prompts), replicated=replicated)


def load_prompts(spec: str) -> PromptSet:
    """``replicated`` and ``mixed`` are the shipped fixtures; anything else is a JSONL path.

    A file given by path is used as distinct prompts; a file of one line is replicated."""
    if spec == "replicated":
        return read_jsonl(REPLICATED, "replicated", replicated=True)
    if spec == "mixed":
        return read_jsonl(MIXED, "mixed-36", replicated=False)
    ps = read_jsonl(Path(spec))
    return PromptSet(ps.name, ps.prompts, replicated=len(ps.prompts) == 1)
