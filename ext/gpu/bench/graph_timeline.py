"""Where a replayed decode step's time goes: every kernel of a few graph-replayed steps at concurrency C,
on the device's own clock (PyTorch's CUPTI profiler), as a timeline and as the time each kernel adds
to the step.

    python3 ext/gpu/bench/graph_timeline.py MODEL.gguf [--c 1,8] [--steps 4] [--variants ",l2ahead=0"]
                                            [--prompt-rows N] [--json OUT.json]

The first C slots take a 600-token prompt, decode greedily through warm-up steps (which capture the
bucket's graph), then --steps steps run under the profiler. A step's kernels are the events from one
embedding kernel to the next. With programmatic dependent launch a kernel's start is when its blocks
became resident (they may then wait for its predecessor), so the time a kernel adds to the step is
its end minus the latest end of any kernel before it (0 if that is later: it ran beside the chain):
those differences add up to the step's span. (A replayed graph runs its branches on streams of its
own choosing, so streams tell nothing here.) Per step: the span (first start to last end), the GPU
idle time inside it (no kernel running) and the gap from the previous step's last kernel (host time
between steps: the tokens' or logits' download, the plan, the upload and the graph launch; inflated
by the profiler).

With --prompt-rows N, prompt steps instead of decode: each profiled step prefills a fresh slot with N
tokens of a random prompt at positions 0..N-1 in one step (N <= 4096; the bucket's graph captured in
a warm-up prefill first), and C is reported as "pN".

Prints, per C and variant, the mean span, idle and gap, and the kernels of one step in order; the JSON
holds every step's rows (name, stream, start and end relative to the step, duration, added).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_bench import BLOCKS, MAX_CTX, SLOTS, prefill, set_variant, table  # noqa: E402

from ds4_app.engine import _native  # noqa: E402
from ds4_app.engine.gguf_file import ModelFile  # noqa: E402
from ds4_app.engine.plan import StepPlan  # noqa: E402
from ds4_app.engine.runner import Runner  # noqa: E402


def kernel_events(trace_path: Path) -> list[dict]:
    """The kernels of a Chrome trace PyTorch exported: name, stream, start and end (us)."""
    trace = json.loads(trace_path.read_text())
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy"):
            out.append({"name": e["name"], "stream": int(e.get("args", {}).get("stream", e.get("tid", 0))),
                        "t0": float(e["ts"]), "t1": float(e["ts"]) + float(e["dur"]), "kind": e["cat"]})
    return sorted(out, key=lambda k: k["t0"])


def split_steps(events: list[dict]) -> list[list[dict]]:
    """The events from each embedding kernel to the next (a step's first kernel is its embedding)."""
    steps, cur = [], None
    for e in events:
        if e["kind"] == "kernel" and "embed_kernel" in e["name"]:
            cur = []
            steps.append(cur)
        if cur is not None:
            cur.append(e)
    return steps


def analyse(step: list[dict], prev_end: float | None) -> dict:
    kernels = [e for e in step if e["kind"] == "kernel"]
    t0 = min(e["t0"] for e in kernels)
    t1 = max(e["t1"] for e in kernels)
    # GPU idle inside the span: the complement of the union of kernel intervals.
    busy, last = 0.0, t0
    for e in sorted(kernels, key=lambda k: k["t0"]):
        if e["t1"] <= last:
            continue
        busy += e["t1"] - max(e["t0"], last)
        last = e["t1"]
    rows, latest = [], t0
    for e in sorted(kernels, key=lambda k: k["t1"]):
        added = max(0.0, e["t1"] - latest)
        latest = max(latest, e["t1"])
        rows.append({"name": e["name"][:110], "stream": e["stream"], "start": e["t0"] - t0, "end": e["t1"] - t0,
                     "dur": e["t1"] - e["t0"], "added": added})
    return {"span_us": t1 - t0, "idle_us": (t1 - t0) - busy, "gap_before_us": None if prev_end is None else t0 - prev_end,
            "kernels": len(kernels), "rows": rows, "end": t1}


def short(name: str) -> str:
    """A kernel's name without its namespaces and argument list."""
    name = name.replace("(anonymous namespace)::", "").replace("ds4::gpu::", "").replace("void ", "")
    return name.split("(")[0][:60]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--c", default="1,8", help="concurrencies, comma-separated")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=600)
    ap.add_argument("--variants", default="", help="engine_bench --variants entries (',' apart; '' the defaults)")
    ap.add_argument("--prompt-rows", type=int, default=0, help="profile prompt steps of this many rows instead")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    mf = ModelFile.open(args.model)
    rows = args.prompt_rows
    if rows and args.steps + 1 > SLOTS:
        raise SystemExit(f"--prompt-rows: at most {SLOTS - 1} steps (a fresh slot each)")
    runner = Runner(mf, backend=_native.gpu_backend(), max_slots=SLOTS, max_ctx=MAX_CTX, max_rows=max(64, rows))
    l2_default = bool(runner._impl.use_l2_prefetch)
    rng = np.random.default_rng(0)
    nxt, pos = {}, {}
    cs = [1] if rows else [int(c) for c in args.c.split(",")]
    if not rows:
        for s in range(max(cs)):
            logits = prefill(runner, s, rng.integers(0, mf.config.n_vocab, args.ctx), 64)
            nxt[s], pos[s] = int(np.argmax(logits[-1])), args.ctx
    fresh = []  # prompt steps: the slots not yet prefilled

    def reset_slots() -> None:  # prompt steps: every slot fresh again (outside the profiled steps)
        for s in range(SLOTS):
            runner.reset_slot(s)
        fresh[:] = range(SLOTS)

    def step(c: int) -> None:  # greedy tokens from the device, as engine_bench's decode takes them
        if rows:
            prefill(runner, fresh.pop(), rng.integers(0, mf.config.n_vocab, rows), rows)
            return
        lanes = [(s, nxt[s], pos[s], True) for s in range(c)]
        got = runner.step_argmax(StepPlan.build(lanes, {s: table(s) for s in range(c)}, BLOCKS))
        for s in range(c):
            nxt[s], pos[s] = int(got[s]), pos[s] + 1

    result = {"model": args.model, "runs": []}
    for variant in args.variants.split(","):
        set_variant(runner, variant, l2_default)
        for c in cs:
            if rows:
                reset_slots()
            for _ in range(4):  # the bucket's graph is captured in the first
                step(c)
            if rows:  # the profiled steps each take a fresh slot, with no reset among them
                reset_slots()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps + 1):
                    step(c)
                torch.cuda.synchronize()
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / "trace.json"
                prof.export_chrome_trace(str(path))
                steps = split_steps(kernel_events(path))
            done, prev = [], None
            for st in steps:
                a = analyse(st, prev)
                prev = a.pop("end")
                done.append(a)
            done = done[1:] if len(done) > 1 else done  # the first has no gap before it
            mean = lambda k: statistics.mean(d[k] for d in done)  # noqa: E731
            run = {"c": f"p{rows}" if rows else c, "variant": variant, "span_us": mean("span_us"), "idle_us": mean("idle_us"),
                   "gap_before_us": mean("gap_before_us") if done[0]["gap_before_us"] is not None else None,
                   "kernels": done[0]["kernels"], "steps": done}
            result["runs"].append(run)
            print(f"== C={run['c']} [{variant}]: span {run['span_us']:.1f} us, idle inside {run['idle_us']:.1f} us, "
                  f"gap before {run['gap_before_us'] or 0:.1f} us, {run['kernels']} kernels", flush=True)
            by = defaultdict(lambda: [0, 0.0, 0.0])
            for r in done[0]["rows"]:
                b = by[short(r["name"])]
                b[0] += 1
                b[1] += r["added"]
                b[2] += r["dur"]
            for name, (n, added, dur) in sorted(by.items(), key=lambda kv: -kv[1][1]):
                print(f"   {added:8.1f} us added {dur:8.1f} us running {n:4d}x {name}")
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
