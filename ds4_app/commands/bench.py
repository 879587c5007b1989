"""``ds4-app bench``: fixed-concurrency waves against the embedded engine or any OpenAI-compatible URL.

Examples::

    ds4-app bench --model synth:tiny --concurrency 1,2,4 --waves 2 --max-tokens 64 --ignore-eos
    ds4-app bench --model DS4.gguf --backend cuda --prompts mixed --waves 2 --max-tokens 128
    ds4-app bench --url http://127.0.0.1:8080 --concurrency 1,4 --ignore-eos
    ds4-app bench --model DS4.gguf --compare --compare-set backend=reference   # A/B/A bracket

``--compare`` runs baseline, candidate, baseline (A1, B, A2); the candidate is the same command
with each ``--compare-set KEY=VALUE`` applied, where KEY is any option of this command written
without its dashes (``seed=1``, ``max-slots=4``, ``model=none``, ``url=http://...``). Reports go to
``--out`` (default ``bench/results/<timestamp>-<label>/``): bench.json, bench.md, outputs.jsonl and
bench.png when matplotlib is installed. Exit status 1 when a level is invalid (a failed request,
or a short completion with ``--ignore-eos``), or with ``--require-exact`` when outputs differ
across the arms of the bracket.
"""

from __future__ import annotations

import argparse
import copy
import os
import datetime as _dt
import re
import sys
from pathlib import Path
from urllib.parse import urlparse

# Options that shape the run or its reports, not the thing measured: the candidate cannot change them.
_NOT_OVERRIDABLE = {"out", "label", "compare", "compare_set", "require_exact", "progress", "chart", "handler",
                    "command", "bench_parser", "concurrency", "waves", "prompts"}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    from ..cli import add_engine_arguments

    p = sub.add_parser("bench", help="measure concurrent serving (waves, tok/s, TTFT, exactness)",
                       description="Measure concurrent serving with fixed-concurrency waves, as the seed does.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    add_engine_arguments(p)
    p.add_argument("--synth-seed", type=int, default=0, metavar="S", help="seed of a --model synth:PRESET (default 0)")
    t = p.add_argument_group("remote target")
    t.add_argument("--url", metavar="URL", help="bench an OpenAI-compatible server instead of the embedded engine")
    t.add_argument("--api-key", metavar="KEY", default=os.environ.get("DS4_APP_API_KEY"),
                   help="bearer token for --url (default: $DS4_APP_API_KEY)")
    t.add_argument("--remote-model", metavar="NAME", help="model name to send to --url (default: the server's first)")
    w = p.add_argument_group("workload")
    w.add_argument("--concurrency", default="1,2,4", metavar="LIST", help="levels, e.g. 1,2,4 or 1-4 (default 1,2,4)")
    w.add_argument("--waves", type=int, default=2, metavar="N", help="waves per level (default 2)")
    w.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens per request (default 128)")
    w.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-tokens; a level is valid only if every request does")
    w.add_argument("--prompts", default="replicated", metavar="replicated|mixed|FILE.jsonl",
                   help="replicated (one prompt in every lane), mixed (36 distinct, short to ~2k tokens) or a JSONL file")
    w.add_argument("--seed", type=int, default=0, help="sampling seed of every request (default 0)")
    w.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    w.add_argument("--top-k", type=int, default=0)
    w.add_argument("--top-p", type=float, default=1.0)
    w.add_argument("--thinking", action="store_true", help="thinking mode (reasoning before the answer)")
    w.add_argument("--warmup", type=int, default=1, metavar="N", help="unmeasured requests before each arm (default 1)")
    w.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="give up on a request after S seconds without an event (default 600)")
    c = p.add_argument_group("A/B/A comparison")
    c.add_argument("--compare", action="store_true", help="run baseline, candidate, baseline (A1, B, A2)")
    c.add_argument("--compare-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the candidate arm (repeatable; implies --compare)")
    c.add_argument("--require-exact", action="store_true", help="exit 1 if outputs differ across the bracket")
    o = p.add_argument_group("reports")
    o.add_argument("--out", metavar="DIR", help="report directory (default bench/results/<timestamp>-<label>/)")
    o.add_argument("--label", metavar="NAME", help="name of this run in reports (default: model and backend)")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    o.add_argument("--no-chart", dest="chart", action="store_false", help="do not draw bench.png")
    p.set_defaults(handler=run, bench_parser=p)


# --- options to arms -----------------------------------------------------------------------


def parse_levels(text: str) -> tuple[int, ...]:
    """``1,2,4`` or ``1-4`` (or a mix) to a tuple of distinct levels in the order given."""
    levels: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"--concurrency: {part!r} is not a level or a range like 1-4")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo < 1 or hi < lo:
            raise ValueError(f"--concurrency: {part!r} must be levels >= 1, low to high")
        for c in range(lo, hi + 1):
            if c not in levels:
                levels.append(c)
    return tuple(levels)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(action: argparse.Action, key: str, value: str):
    """A KEY=VALUE override's value, converted and checked as the option itself would be."""
    low = value.strip().lower()
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if action.default is None and low in ("none", "auto", "default"):
            return None
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"--compare-set {key}: expected true or false, got {value!r}")
    if action.default is None and low in ("none", "null", ""):
        return None
    try:
        out = action.type(value) if action.type is not None else value
    except (TypeError, ValueError):
        raise ValueError(f"--compare-set {key}: {value!r} is not a valid value") from None
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"--compare-set {key}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return out


def apply_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    pairs: list[str]) -> tuple[argparse.Namespace, tuple[tuple[str, str], ...]]:
    """A copy of ``args`` with each ``KEY=VALUE`` applied (the candidate arm), and the overrides."""
    actions = {a.dest: a for a in parser._actions if a.dest not in (argparse.SUPPRESS, "help")}
    cand = copy.copy(args)
    applied: list[tuple[str, str]] = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        dest = key.strip().lstrip("-").replace("-", "_")
        if not sep or not dest:
            raise ValueError(f"--compare-set needs KEY=VALUE, got {pair!r}")
        if dest not in actions or dest in _NOT_OVERRIDABLE:
            allowed = sorted(d.replace("_", "-") for d in actions if d not in _NOT_OVERRIDABLE)
            raise ValueError(f"--compare-set: {key!r} cannot be set for the candidate; choose from {', '.join(allowed)}")
        setattr(cand, dest, _convert(actions[dest], key, value))
        applied.append((dest.replace("_", "-"), value))
    return cand, tuple(applied)


def target_spec(args: argparse.Namespace, max_concurrency: int):
    """The TargetSpec of parsed options."""
    from ..bench.target import TargetSpec

    return TargetSpec(model=args.model, backend=args.backend, max_slots=args.max_slots, max_ctx=args.max_ctx,
                      kv_pool_tokens=args.kv_pool_tokens, max_rows=args.max_rows, threads=args.threads,
                      qat_numerics=args.qat_numerics, max_queue=max(64, max_concurrency), synth_seed=args.synth_seed,
                      url=args.url, api_key=args.api_key, remote_model=args.remote_model)


def bench_plan(args: argparse.Namespace, levels: tuple[int, ...]):
    """The BenchPlan of parsed options."""
    from ..bench.runner import BenchPlan
    from ..engine.sampling import SamplerConfig

    sampling = SamplerConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                             max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    return BenchPlan(concurrency=levels, waves=args.waves, sampling=sampling, thinking=args.thinking,
                     warmup=args.warmup, request_timeout=args.request_timeout)


def check_synth(model: str | None) -> None:
    """ValueError naming the choices when ``synth:PRESET`` names no preset."""
    from ..bench.target import SYNTH_PREFIX
    from ..engine.presets import PRESETS

    if model is not None and model.startswith(SYNTH_PREFIX) and model[len(SYNTH_PREFIX):] not in PRESETS:
        raise ValueError(f"unknown synthetic preset {model!r}; choose from "
                         + ", ".join(SYNTH_PREFIX + k for k in PRESETS))


def default_label(args: argparse.Namespace) -> str:
    """A short name: the model (file stem or synth preset) and backend, or the server's host."""
    if args.url:
        u = urlparse(args.url)
        return f"url-{u.hostname or 'server'}{'-' + str(u.port) if u.port else ''}"
    model = args.model or "default"
    stem = model.replace(":", "-") if model.startswith("synth:") else Path(model).stem
    return f"{stem}-{args.backend}"


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """An equivalent ``ds4-app bench`` command: every option that differs from its default (no API key)."""
    out = ["ds4-app", "bench"]
    for a in parser._actions:
        if not a.option_strings or a.dest in ("help", "api_key"):
            continue
        v = getattr(args, a.dest, a.default)
        if v == a.default:
            continue
        flag = a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]
        if isinstance(a, argparse.BooleanOptionalAction):
            out.append(flag if v else "--no-" + flag[2:])
        elif isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out.append(flag)
        elif isinstance(a, argparse._AppendAction):
            for item in v:
                out += [flag, str(item)]
        else:
            out += [flag, str(v)]
    return out


# --- the command ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run the bench (one arm, or an A/B/A bracket), write the reports, print the tables."""
    from ..bench.arms import ArmSpec, bracket, run_arms
    from ..bench.compare import compare_arms
    from ..bench.progress import Progress
    from ..bench.prompts import PromptError, load_prompts
    from ..bench.report import write_reports
    from ..cli import UserError, check_engine_arguments

    parser: argparse.ArgumentParser = args.bench_parser
    try:
        levels = parse_levels(args.concurrency)
        prompt_set = load_prompts(args.prompts)
        for c in levels:
            prompt_set.waves(c, args.waves)
        check_synth(args.model)
        base_target = target_spec(args, max(levels))
        base_plan = bench_plan(args, levels)
        arms = [ArmSpec("A", "run", base_target, base_plan)]
        overrides: tuple[tuple[str, str], ...] = ()
        if args.compare or args.compare_set:
            cand_args, overrides = apply_overrides(parser, args, args.compare_set)
            try:
                check_engine_arguments(cand_args)
            except UserError as e:
                raise UserError(f"--compare-set: {e}") from None
            check_synth(cand_args.model)
            arms = bracket(arms[0], target_spec(cand_args, max(levels)), bench_plan(cand_args, levels), overrides)
    except (ValueError, PromptError) as e:
        raise UserError(str(e)) from None

    label = args.label or default_label(args)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-") or "bench"
    out_dir = Path(args.out) if args.out else (
        Path("bench") / "results" / f"{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{safe}")
    progress = Progress(sum(a.plan.total_requests for a in arms), enabled=args.progress)
    try:
        results = run_arms(arms, prompt_set, progress=progress)
    finally:
        progress.close()
    comparison = compare_arms(results[0].levels, results[1].levels, results[2].levels) if len(results) == 3 else None
    notes = []
    by_target: dict[tuple, list[str]] = {}
    for arm in arms:
        by_target.setdefault(arm.target.key, []).append(arm.name)
    for arm in arms:
        names = by_target.pop(arm.target.key, None)
        if names is None:  # already noted with an earlier arm on the same target
            continue
        t, who = arm.target, "arm" + ("s " if len(names) > 1 else " ") + ", ".join(names)
        if t.url is None and max(levels) > t.max_slots:
            notes.append(f"{who}: concurrency {max(levels)} exceeds --max-slots {t.max_slots}, so "
                         "requests beyond the slots queued inside the engine (their TTFT includes the wait)")
        if t.url is not None:
            notes.append(f"{who}: native timings are the server's usage timings where it reports them, "
                         "else the remote client's own estimates; the machine recorded is the bench client's")
    files = write_reports(out_dir, results, comparison, prompt_set=prompt_set, label=label,
                          command=command_line(parser, args), notes=notes, chart=args.chart)
    print(files.markdown.read_text(encoding="utf-8"))
    print(f"reports: {files.out_dir}/ (bench.json, bench.md, outputs.jsonl"
          + (", bench.png)" if files.chart else f"); {files.chart_skipped}"))
    status = 0
    if not all(r.valid for r in results):
        print("ds4-app bench: some levels are invalid (see the reports)", file=sys.stderr)
        status = 1
    if comparison is not None and args.require_exact and not all(c.exact for c in comparison):
        print("ds4-app bench: outputs differ across the A/B/A bracket", file=sys.stderr)
        status = 1
    return status
