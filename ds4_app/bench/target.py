"""What a bench arm runs against: the embedded engine (a model file or ``synth:PRESET``) or a URL.

``Targets`` keeps at most one target open at a time and reuses it while consecutive arms ask for
the same one (an A/B/A whose candidate only changes sampling loads the model once), and closes it
before opening a different one (two real models never share memory). ``synth:PRESET`` models are
written once per bench run into a temporary directory, which is deleted when ``Targets`` closes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field

from ..engine.api import EngineClient

SYNTH_PREFIX = "synth:"


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """Where requests go. With ``url`` set the engine options are not used."""

    model: str | None = None
    backend: str = "cpu"
    max_slots: int = 6
    max_ctx: int = 4096
    kv_pool_tokens: int | None = None
    max_rows: int | None = None  # rows a step; None: the backend's default (16 cpu, 512 cuda / hip)
    threads: int = 0
    qat_numerics: bool | None = None
    max_queue: int = 64
    synth_seed: int = 0
    url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    remote_model: str | None = None

    def __post_init__(self) -> None:
        if self.url is not None and self.model is not None:
            raise ValueError("--model and --url are exclusive: bench either the embedded engine or a server")
        if self.model is not None and self.model.startswith(SYNTH_PREFIX) and not self.model[len(SYNTH_PREFIX):]:
            raise ValueError("synth: needs a preset name, e.g. --model synth:tiny")

    @property
    def key(self) -> tuple:
        """Two specs with the same key are served by the same open engine."""
        return tuple(v for k, v in self._fields() if k != "api_key")

    def _fields(self):
        return [(k, getattr(self, k)) for k in self.__dataclass_fields__]

    def describe(self) -> dict:
        """JSON-ready description (never the API key)."""
        d = asdict(self)
        d.pop("api_key")
        if self.url is not None:
            for k in ("model", "backend", "max_slots", "max_ctx", "kv_pool_tokens", "max_rows", "threads",
                      "qat_numerics", "max_queue", "synth_seed"):
                d.pop(k)
        else:
            d.pop("url")
            d.pop("remote_model")
            if not (self.model or "").startswith(SYNTH_PREFIX):
                d.pop("synth_seed")
        return d


@dataclass(slots=True)
class OpenTarget:
    """An open client, what it is, and notes for the report."""

    spec: TargetSpec
    client: EngineClient
    notes: list[str]


def engine_info(client: EngineClient) -> dict:
    """Backend, device, model and step limits as the target reports them (StatsSnapshot; zeros for
    a remote server that does not say), plus its counters."""
    try:
        s = client.stats()
    except Exception as e:  # noqa: BLE001 - a remote target may not expose stats; the run still counts
        return {"stats_error": f"{type(e).__name__}: {e}"}
    return {
        "backend": s.backend, "device": s.device, "model": s.model, "max_slots": s.max_slots,
        "max_ctx": s.max_ctx, "step_limits": {"max_rows": s.max_rows, "max_seqs": s.max_seqs,
                                              "rows_per_prompt": s.rows_per_prompt,
                                              "lone_prompt_rows": s.lone_prompt_rows},
        "pool_pages": s.pool.n_pages, "steps": s.steps,
        "prompt_tokens_total": s.prompt_tokens_total, "generation_tokens_total": s.generation_tokens_total,
        "requests_finished": s.requests_finished, "evictions": s.pool.evictions,
        "preemptions": s.pool.preemptions, "memory_bytes": dict(s.memory),
    }


class Targets:
    """Opens targets on demand, one at a time; a context manager that cleans up everything."""

    def __init__(self) -> None:
        self._tmp: str | None = None
        self._synth: dict[tuple[str, int], str] = {}
        self._open: OpenTarget | None = None

    def __enter__(self) -> "Targets":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get(self, spec: TargetSpec) -> OpenTarget:
        """The open target for ``spec``, reusing the current one when it is the same."""
        if self._open is not None and self._open.spec.key == spec.key:
            return self._open
        self._close_current()
        self._open = self._connect(spec) if spec.url is not None else self._engine(spec)
        return self._open

    def close(self) -> None:
        """Close the open target and delete any synthesized model."""
        self._close_current()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _close_current(self) -> None:
        if self._open is not None:
            cur, self._open = self._open, None
            cur.client.close()

    def _model_path(self, spec: TargetSpec, notes: list[str]) -> str | None:
        if spec.model is None or not spec.model.startswith(SYNTH_PREFIX):
            return spec.model
        preset = spec.model[len(SYNTH_PREFIX):]
        key = (preset, spec.synth_seed)
        if key not in self._synth:
            from ..engine.synth import synthesize

            if self._tmp is None:
                self._tmp = tempfile.mkdtemp(prefix="ds4-bench-")
            path = os.path.join(self._tmp, f"synth-{preset}-seed{spec.synth_seed}.gguf")
            synthesize(preset, path, seed=spec.synth_seed)
            self._synth[key] = path
        notes.append(f"model synth:{preset} (seed {spec.synth_seed}) was synthesized into a temporary file, "
                     "not in memory, and deleted after the run")
        return self._synth[key]

    def _engine(self, spec: TargetSpec) -> OpenTarget:
        from ..engine.service import EngineService

        notes: list[str] = []
        path = self._model_path(spec, notes)
        svc = EngineService.open(path, backend=spec.backend, max_slots=spec.max_slots, max_ctx=spec.max_ctx,
                                 kv_pool_tokens=spec.kv_pool_tokens, max_rows=spec.max_rows, threads=spec.threads,
                                 qat_numerics=spec.qat_numerics, max_queue=spec.max_queue)
        return OpenTarget(spec=spec, client=svc, notes=notes)

    def _connect(self, spec: TargetSpec) -> OpenTarget:
        from ..engine.remote import RemoteEngine

        client = RemoteEngine(spec.url, api_key=spec.api_key, model=spec.remote_model)
        return OpenTarget(spec=spec, client=client, notes=[f"target: OpenAI-compatible server at {spec.url}"])
