"""Per-session settings: the system prompt, sampling and thinking mode of one chat.

Stored as JSON in the session's row; turned into a ``SamplerConfig`` for every request. Checked
once where built (``__post_init__`` builds the sampler, so a value the engine would refuse is
refused here, with the sampler's own one-line message).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ds4_app.engine.sampling import SamplerConfig

# DS4's card recommends temperature 1.0 and top_p 1.0 (ds4_spec.md); 4096 new tokens at most per
# reply, as the server's default, so a runaway reply cannot hold a slot forever.
DEFAULT_MAX_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """What one chat sends with each request. ``seed`` None draws a fresh seed per reply."""

    system_prompt: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int | None = None
    thinking: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.system_prompt, str):
            raise ValueError("system prompt must be text")
        if not isinstance(self.thinking, bool):
            raise ValueError(f"thinking must be true or false, got {self.thinking!r}")
        self.sampler()  # raises ValueError("sampler: ...") for any value the engine would refuse

    def sampler(self) -> SamplerConfig:
        """The engine's sampling settings for one reply of this session."""
        return SamplerConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                             min_p=self.min_p, seed=self.seed, max_tokens=self.max_tokens)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the stored form)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SessionSettings":
        """Build from a stored dict; unknown keys (from a newer version) are ignored and missing
        keys take their defaults, so old rows keep loading."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def summary(self) -> str:
        """One line for headers and exports: the values that differ from greedy defaults."""
        parts = [f"temperature {self.temperature:g}", f"top-p {self.top_p:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.min_p:
            parts.append(f"min-p {self.min_p:g}")
        parts.append(f"max tokens {self.max_tokens}")
        parts.append(f"seed {self.seed}" if self.seed is not None else "random seed")
        parts.append("thinking on" if self.thinking else "thinking off")
        return " · ".join(parts)
