"""A/B/A brackets: a candidate arm measured between two runs of the baseline.

Per level and metric: the candidate's change against the mean of the two baselines, and the
drift between the baselines (A2 against A1). A change is only worth reading when it clears
twice the drift (the seed's rule), which ``clears_2x_drift`` records.

Exactness: requests are matched by (wave, lane), which with the same fixture is the same prompt
in each arm; an output matches when its content and reasoning hashes, completion token count
and finish reason are equal. ``mismatches`` counts candidate outputs that differ from either
baseline, ``baseline_mismatches`` baseline outputs that differ between A1 and A2 (if those are
not zero, the setup itself is not deterministic and no exactness claim can be made).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from .metrics import LevelMetrics, RequestRecord
from .runner import LevelRun

# (metric, which direction is better) for every metric the bracket reports.
COMPARED_METRICS: tuple[tuple[str, str], ...] = (
    ("output_window_tok_s", "higher"),
    ("aggregate_tok_s", "higher"),
    ("ttft_p50_s", "lower"),
    ("ttft_p95_s", "lower"),
    ("ttft_max_s", "lower"),
    ("request_decode_tok_s", "higher"),
    ("prompt_tok_s_to_first", "higher"),
    ("native_prefill_tok_s", "higher"),
)


def pct_change(new: float | None, old: float | None) -> float | None:
    """(new / old - 1) in percent; None when either is missing or old is 0."""
    if new is None or old is None or old == 0:
        return None
    return (new / old - 1.0) * 100.0


@dataclass(frozen=True, slots=True)
class MetricChange:
    """One metric of one level across the bracket."""

    metric: str
    better: str  # "higher" or "lower"
    a1: float | None
    b: float | None
    a2: float | None
    baseline_mean: float | None
    change_pct: float | None  # B against the baseline mean
    drift_pct: float | None  # A2 against A1
    clears_2x_drift: bool | None


def metric_change(metric: str, better: str, a1: LevelMetrics, b: LevelMetrics, a2: LevelMetrics) -> MetricChange:
    """The bracket figures of ``metric`` for one level."""
    x1, xb, x2 = getattr(a1, metric), getattr(b, metric), getattr(a2, metric)
    mean = (x1 + x2) / 2 if x1 is not None and x2 is not None else None
    change = pct_change(xb, mean)
    drift = pct_change(x2, x1)
    clears = None if change is None or drift is None else abs(change) > 2 * abs(drift)
    return MetricChange(metric=metric, better=better, a1=x1, b=xb, a2=x2, baseline_mean=mean,
                        change_pct=change, drift_pct=drift, clears_2x_drift=clears)


def _identity(r: RequestRecord) -> tuple[str, int, str]:
    return (r.output_sha256, r.completion_tokens, r.finish_reason)


@dataclass(frozen=True, slots=True)
class LevelComparison:
    """The bracket of one concurrency level."""

    concurrency: int
    requests: int  # candidate requests compared
    mismatches: int  # candidate outputs differing from A1 or A2
    baseline_mismatches: int  # A1 vs A2
    same_prompts: bool  # every arm sent the same prompt set
    exact: bool
    mismatch_examples: tuple[str, ...]
    metrics: tuple[MetricChange, ...]

    def metric(self, name: str) -> MetricChange:
        """The figures of one metric by name."""
        for m in self.metrics:
            if m.metric == name:
                return m
        raise KeyError(name)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        d = asdict(self)
        d["mismatch_examples"] = list(self.mismatch_examples)
        d["metrics"] = {m.metric: asdict(m) for m in self.metrics}
        return d


def compare_level(a1: LevelRun, b: LevelRun, a2: LevelRun) -> LevelComparison:
    """Bracket one level (all three runs at the same concurrency)."""
    if not a1.concurrency == b.concurrency == a2.concurrency:
        raise ValueError("compare_level needs three runs of the same concurrency")
    base1 = {(r.wave, r.lane): r for r in a1.records}
    base2 = {(r.wave, r.lane): r for r in a2.records}
    mism, examples = 0, []
    for r in sorted(b.records, key=lambda r: (r.wave, r.lane)):
        key = (r.wave, r.lane)
        refs = [x for x in (base1.get(key), base2.get(key)) if x is not None]
        if len(refs) < 2 or any(_identity(x) != _identity(r) for x in refs):
            mism += 1
            if len(examples) < 5:
                ref = refs[0] if refs else None
                examples.append(
                    f"wave {r.wave} lane {r.lane} ({r.prompt_id}): candidate {r.output_sha256[:12]} "
                    f"{r.completion_tokens} tok {r.finish_reason}; baseline "
                    + (f"{ref.output_sha256[:12]} {ref.completion_tokens} tok {ref.finish_reason}" if ref else "missing"))
    base_mism = sum(1 for k in base1.keys() | base2.keys()
                    if k not in base1 or k not in base2 or _identity(base1[k]) != _identity(base2[k]))
    same_prompts = (a1.metrics.prompt_set_sha256 == b.metrics.prompt_set_sha256 == a2.metrics.prompt_set_sha256)
    return LevelComparison(
        concurrency=b.concurrency, requests=len(b.records), mismatches=mism, baseline_mismatches=base_mism,
        same_prompts=same_prompts, exact=mism == 0 and base_mism == 0 and same_prompts,
        mismatch_examples=tuple(examples),
        metrics=tuple(metric_change(name, better, a1.metrics, b.metrics, a2.metrics)
                      for name, better in COMPARED_METRICS))


def compare_arms(a1: Sequence[LevelRun], b: Sequence[LevelRun], a2: Sequence[LevelRun]) -> list[LevelComparison]:
    """Bracket every concurrency level present in all three arms, in the candidate's order."""
    by1 = {r.concurrency: r for r in a1}
    by2 = {r.concurrency: r for r in a2}
    return [compare_level(by1[r.concurrency], r, by2[r.concurrency]) for r in b
            if r.concurrency in by1 and r.concurrency in by2]
