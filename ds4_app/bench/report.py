"""Bench reports: raw JSON, a Markdown table, a PNG chart (optional), and the outputs themselves.

Files in the output directory:
- ``bench.json``: every metric of every level and arm, per-wave and per-request figures, the
  command line, git commit, machine, what the target reported (backend, device, model), the
  A/B/A comparison if any, and notes;
- ``bench.md``: the tables a pull request quotes (per arm, and the A/B/A bracket);
- ``bench.png``: tok/s and p95 TTFT against concurrency, drawn with matplotlib when it is
  installed (the ``chart`` extra); otherwise skipped, and both reports say so;
- ``outputs.jsonl``: each request's content and reasoning text with its hashes, for diffing arms.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from .arms import ArmResult
from .compare import LevelComparison
from .prompts import PromptSet

SCHEMA = "ds4-app-bench/1"
CHART_SKIPPED = "matplotlib is not installed (pip install 'ds4-app[chart]'); the PNG chart was skipped"


def git_info(start: Path | None = None) -> dict:
    """The commit of the checkout this package runs from, and whether it has local changes."""
    where = start or Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                                timeout=5)
        if commit.returncode != 0:
            return {"commit": None}
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                capture_output=True, text=True, timeout=5)
        return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}


def _cpuinfo() -> tuple[str | None, int | None]:
    """CPU model name and physical core count from /proc/cpuinfo (Linux); Nones elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, None
    model, cores, phys = None, set(), None
    for line in text.splitlines():
        k, _, v = line.partition(":")
        k, v = k.strip(), v.strip()
        if k == "model name" and model is None:
            model = v
        elif k == "physical id":
            phys = v
        elif k == "core id":
            cores.add((phys, v))
    return model, (len(cores) or None)


def machine_info() -> dict:
    """CPU model, cores, OS and Python of the machine running the bench client."""
    model, physical = _cpuinfo()
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "cores_logical": os.cpu_count(),
        "cores_physical": physical,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def _plan_dict(arm: ArmResult) -> dict:
    p = arm.spec.plan
    d = {"concurrency": list(p.concurrency), "waves": p.waves, "thinking": p.thinking, "warmup": p.warmup,
         "request_timeout_s": p.request_timeout}
    d["sampling"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(p.sampling).items()}
    return d


def build_report(arms: Sequence[ArmResult], comparison: Sequence[LevelComparison] | None, *,
                 prompt_set: PromptSet, label: str, command: Sequence[str], chart: str | None,
                 chart_skipped: str | None, notes: Sequence[str] = ()) -> dict:
    """The JSON report as a dict (see the module docstring)."""
    all_notes = list(notes)
    for a in arms:
        for n in a.notes:
            if n not in all_notes:
                all_notes.append(n)
    if chart_skipped:
        all_notes.append(chart_skipped)
    out = {
        "schema": SCHEMA,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "label": label,
        "command": list(command),
        "git": git_info(),
        "machine": machine_info(),
        "prompts": {"name": prompt_set.name, "replicated": prompt_set.replicated,
                    "count": len(prompt_set.prompts)},
        "arms": [],
        "comparison": None,
        "files": {"json": "bench.json", "markdown": "bench.md", "chart": chart, "outputs": "outputs.jsonl"},
        "chart_skipped": chart_skipped,
        "valid": all(a.valid for a in arms),
        "notes": all_notes,
    }
    for a in arms:
        levels = []
        for run in a.levels:
            t0 = min(r.t_start for r in run.records)
            levels.append({"concurrency": run.concurrency, "metrics": run.metrics.to_dict(),
                           "requests": [r.to_dict(t0) for r in sorted(run.records, key=lambda r: (r.wave, r.lane))]})
        out["arms"].append({"name": a.spec.name, "role": a.spec.role, "overrides": dict(a.spec.overrides),
                            "target": a.spec.target.describe(), "plan": _plan_dict(a), "engine": a.engine,
                            "valid": a.valid, "levels": levels})
    if comparison is not None:
        out["comparison"] = {
            "baselines": ["A1", "A2"], "candidate": "B",
            "overrides": dict(next((a.spec.overrides for a in arms if a.spec.role == "candidate"), ())),
            "exact": all(c.exact for c in comparison),
            "mismatches": sum(c.mismatches for c in comparison),
            "baseline_mismatches": sum(c.baseline_mismatches for c in comparison),
            "levels": [c.to_dict() for c in comparison],
        }
    return out


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}%"


def markdown(report: dict) -> str:
    """The Markdown report: context lines, one table per arm, the bracket table, notes."""
    lines = [f"# ds4-app bench: {report['label']}", ""]
    g = report["git"]
    m = report["machine"]
    commit = (g.get("commit") or "unknown")[:12] + (" (dirty)" if g.get("dirty") else "")
    lines.append(f"- commit {commit}; {report['created_utc']}")
    lines.append(f"- machine: {m['cpu']}, {m['cores_physical'] or '?'} physical / {m['cores_logical']} logical cores, "
                 f"{m['platform']}")
    p = report["prompts"]
    first = report["arms"][0]
    plan = first["plan"]
    s = plan["sampling"]
    lines.append(f"- prompts: {p['name']} ({'replicated' if p['replicated'] else 'distinct'}, {p['count']} in file); "
                 f"{plan['waves']} wave(s) per level; max_tokens {s['max_tokens']}"
                 f"{' with ignore_eos' if s['ignore_eos'] else ''}; temperature {s['temperature']}, seed {s['seed']}")
    lines.append(f"- command: `{' '.join(report['command'])}`")
    lines.append("")
    for arm in report["arms"]:
        e = arm["engine"]
        parts = [f"{k} {e[k]}" for k in ("backend", "device", "model") if e.get(k)]
        if (e.get("step_limits") or {}).get("max_rows"):
            parts.append(f"{e['step_limits']['max_rows']} rows a step")
        what = ", ".join(parts)
        over = ", ".join(f"{k}={v}" for k, v in arm["overrides"].items())
        lines.append(f"## Arm {arm['name']} ({arm['role']}{'; ' + over if over else ''})")
        lines.append("")
        if what:
            lines.append(f"Target: {what}.")
            lines.append("")
        lines.append("| C | requests | valid | output-window tok/s | aggregate tok/s | TTFT p50 s | TTFT p95 s "
                     "| TTFT max s | request decode tok/s | prompt tok/s to first | native prefill tok/s | output set |")
        lines.append("|--:|--:|:-:|--:|--:|--:|--:|--:|--:|--:|--:|:--|")
        for lv in arm["levels"]:
            x = lv["metrics"]
            lines.append(
                f"| {x['concurrency']} | {x['requests']} | {'yes' if x['valid'] else 'NO'} "
                f"| {_f(x['output_window_tok_s'])} | {_f(x['aggregate_tok_s'])} | {_f(x['ttft_p50_s'], '.3f')} "
                f"| {_f(x['ttft_p95_s'], '.3f')} | {_f(x['ttft_max_s'], '.3f')} | {_f(x['request_decode_tok_s'])} "
                f"| {_f(x['prompt_tok_s_to_first'])} | {_f(x['native_prefill_tok_s'])} "
                f"| `{x['output_set_sha256'][:12]}` |")
        bad = [f"C={lv['metrics']['concurrency']}: {'; '.join(lv['metrics']['invalid_reasons'])}"
               for lv in arm["levels"] if not lv["metrics"]["valid"]]
        if bad:
            lines.append("")
            lines.extend(f"- invalid {b}" for b in bad)
        lines.append("")
    cmp_ = report["comparison"]
    if cmp_ is not None:
        over = ", ".join(f"{k}={v}" for k, v in cmp_["overrides"].items()) or "none (same configuration)"
        lines.append("## A/B/A bracket")
        lines.append("")
        lines.append(f"Candidate B = baseline with {over}. Change is B against the mean of A1 and A2; drift is A2 "
                     "against A1; a change is marked * when it clears twice the drift.")
        lines.append("")
        lines.append("| C | A1 output tok/s | B output tok/s | A2 output tok/s | B vs bracket | A2 vs A1 drift "
                     "| p95 TTFT change | p95 TTFT drift | exact output |")
        lines.append("|--:|--:|--:|--:|--:|--:|--:|--:|:--|")
        for lv in cmp_["levels"]:
            ow = lv["metrics"]["output_window_tok_s"]
            tt = lv["metrics"]["ttft_p95_s"]
            star = "*" if ow["clears_2x_drift"] else ""
            tstar = "*" if tt["clears_2x_drift"] else ""
            ok = lv["requests"] - lv["mismatches"]
            exact = f"{'yes' if lv['exact'] else 'no'} ({ok}/{lv['requests']}"
            exact += f"; baselines differ in {lv['baseline_mismatches']})" if lv["baseline_mismatches"] else ")"
            if not lv["same_prompts"]:
                exact += " prompts differ"
            lines.append(f"| {lv['concurrency']} | {_f(ow['a1'])} | {_f(ow['b'])} | {_f(ow['a2'])} "
                         f"| {_pct(ow['change_pct'])}{star} | {_pct(ow['drift_pct'])} | {_pct(tt['change_pct'])}{tstar} "
                         f"| {_pct(tt['drift_pct'])} | {exact} |")
        lines.append("")
    if report.get("files", {}).get("chart"):
        lines.append(f"![throughput and p95 TTFT against concurrency]({report['files']['chart']})")
        lines.append("")
    if report["notes"]:
        lines.append("## Notes")
        lines.append("")
        lines.extend(f"- {n}" for n in report["notes"])
        lines.append("")
    return "\n".join(lines)


def chart_available() -> bool:
    """True when matplotlib can be imported (the optional ``chart`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw_chart(report: dict, path: Path) -> None:
    """tok/s (output-window solid, aggregate dashed) and p95 TTFT against concurrency, per arm."""
    # The object API with an Agg canvas: no pyplot, so no global backend or figure state is touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax_tok, ax_ttft = fig.subplots(1, 2)
    for arm in report["arms"]:
        cs = [lv["metrics"]["concurrency"] for lv in arm["levels"]]

        def series(key: str) -> list[float]:
            return [float("nan") if lv["metrics"][key] is None else lv["metrics"][key] for lv in arm["levels"]]

        line, = ax_tok.plot(cs, series("output_window_tok_s"), marker="o", label=f"{arm['name']} output-window")
        ax_tok.plot(cs, series("aggregate_tok_s"), marker="s", linestyle="--", color=line.get_color(),
                    label=f"{arm['name']} aggregate")
        ax_ttft.plot(cs, series("ttft_p95_s"), marker="o", color=line.get_color(), label=arm["name"])
    ax_tok.set_xlabel("concurrency")
    ax_tok.set_ylabel("tok/s")
    ax_tok.set_title("throughput")
    ax_tok.legend(fontsize="small")
    ax_ttft.set_xlabel("concurrency")
    ax_ttft.set_ylabel("seconds")
    ax_ttft.set_title("p95 TTFT")
    ax_ttft.legend(fontsize="small")
    for ax in (ax_tok, ax_ttft):
        ax.grid(alpha=0.3)
        ax.set_xticks(sorted({lv["metrics"]["concurrency"] for a in report["arms"] for lv in a["levels"]}))
    fig.suptitle(f"ds4-app bench: {report['label']}")
    fig.tight_layout()
    fig.savefig(path)


@dataclass(frozen=True, slots=True)
class ReportFiles:
    """Where the reports were written."""

    out_dir: Path
    json: Path
    markdown: Path
    outputs: Path
    chart: Path | None
    chart_skipped: str | None


def write_reports(out_dir: Path, arms: Sequence[ArmResult], comparison: Sequence[LevelComparison] | None, *,
                  prompt_set: PromptSet, label: str, command: Sequence[str], notes: Sequence[str] = (),
                  chart: bool = True) -> ReportFiles:
    """Write bench.json, bench.md, outputs.jsonl and (when possible) bench.png into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    chart_path: Path | None = out_dir / "bench.png"
    skipped: str | None = None
    if not chart:
        chart_path, skipped = None, "chart disabled (--no-chart)"
    elif not chart_available():
        chart_path, skipped = None, CHART_SKIPPED
    report = build_report(arms, comparison, prompt_set=prompt_set, label=label, command=command,
                          chart=chart_path.name if chart_path else None, chart_skipped=skipped, notes=notes)
    if chart_path is not None:
        draw_chart(report, chart_path)
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    md_path = out_dir / "bench.md"
    md_path.write_text(markdown(report), encoding="utf-8")
    outputs = out_dir / "outputs.jsonl"
    with outputs.open("w", encoding="utf-8") as f:
        for a in arms:
            for run in a.levels:
                for r in sorted(run.records, key=lambda r: (r.wave, r.lane)):
                    f.write(json.dumps({
                        "arm": a.spec.name, "concurrency": run.concurrency, "wave": r.wave, "lane": r.lane,
                        "prompt_id": r.prompt_id, "finish_reason": r.finish_reason,
                        "completion_tokens": r.completion_tokens, "output_sha256": r.output_sha256,
                        "content_sha256": r.content_sha256, "reasoning_sha256": r.reasoning_sha256,
                        "content": r.content, "reasoning": r.reasoning}, ensure_ascii=False) + "\n")
    return ReportFiles(out_dir=out_dir, json=json_path, markdown=md_path, outputs=outputs, chart=chart_path,
                       chart_skipped=skipped)
