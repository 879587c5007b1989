"""Arms of a bench run: one plain arm, or the A/B/A bracket (baseline, candidate, baseline).

An arm is a target plus a plan; the candidate of a bracket is the baseline with overrides (for
example another seed or backend). Arms run one after the other on the same prompt set, each
with its own warm-up, and each records what the target said it was (backend, device, model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .metrics import LevelMetrics
from .progress import Progress
from .prompts import PromptSet
from .runner import BenchPlan, LevelRun, run_levels
from .target import TargetSpec, Targets, engine_info


_COUNTERS = ("steps", "prompt_tokens_total", "generation_tokens_total", "requests_finished", "evictions",
             "preemptions")


@dataclass(frozen=True, slots=True)
class ArmSpec:
    """One arm: its name (A, A1, B, A2), role and what it runs."""

    name: str
    role: str  # "baseline", "candidate" or "run"
    target: TargetSpec
    plan: BenchPlan
    overrides: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ArmResult:
    """What one arm measured."""

    spec: ArmSpec
    levels: tuple[LevelRun, ...]
    engine: dict
    notes: tuple[str, ...] = field(default=())

    def level(self, concurrency: int) -> LevelMetrics:
        """The metrics of one level by its concurrency."""
        for r in self.levels:
            if r.concurrency == concurrency:
                return r.metrics
        raise KeyError(concurrency)

    @property
    def valid(self) -> bool:
        """True when every level is valid."""
        return all(r.metrics.valid for r in self.levels)


def bracket(baseline: ArmSpec, candidate_target: TargetSpec, candidate_plan: BenchPlan,
            overrides: tuple[tuple[str, str], ...]) -> list[ArmSpec]:
    """The A1, B, A2 arm specs of a bracket around ``baseline``."""
    a1 = ArmSpec("A1", "baseline", baseline.target, baseline.plan)
    b = ArmSpec("B", "candidate", candidate_target, candidate_plan, overrides)
    a2 = ArmSpec("A2", "baseline", baseline.target, baseline.plan)
    return [a1, b, a2]


def run_arms(arms: list[ArmSpec], prompt_set: PromptSet, *, progress: Progress | None = None) -> list[ArmResult]:
    """Run the arms in order, reusing an open target between arms that share it."""
    results = []
    with Targets() as targets:
        for arm in arms:
            opened = targets.get(arm.target)
            label = f"{arm.name} " if len(arms) > 1 else ""
            before = engine_info(opened.client)
            levels = run_levels(opened.client, prompt_set, arm.plan, progress=progress, label=label)
            after = engine_info(opened.client)
            # The engine may be shared with an earlier arm: its counters are cumulative, so keep
            # this arm's own share (steps, tokens, evictions, preemptions) beside the totals.
            after["this_arm"] = {k: after[k] - before[k] for k in _COUNTERS if k in after and k in before}
            results.append(ArmResult(spec=arm, levels=tuple(levels), engine=after, notes=tuple(opened.notes)))
    return results
