"""Decode and prefill throughput of the GPU engine on a DS4 GGUF, each decode figure against its roofline.

    python3 ext/gpu/bench/engine_bench.py MODEL.gguf [--json OUT.json] [--ctx 600] [--steps 24]
                                                     [--long-ctx 2100] [--variants pdl=0:l2=0,pdl=1,...]
                                                     [--decode-tokens device|host|both]

Through Runner(backend="cuda"|"hip"), one engine step per runner.step call (host time, which
includes the plan upload, every kernel and the logits download). Method:

- copy bandwidth: a 4 GiB device-to-device copy through PyTorch (bytes read + written), median of
  10 timed with device events after 3 warm-ups; also a 4 GiB read-only reduction;
- prefill: a lone prompt of 2048 random tokens at 16 and at 64 rows a step (--prefill-rows: other
  sizes; logits for the last row of each step only), tok/s = 2048 / wall time;
- decode: 8 slots are prefilled with --ctx random tokens each, then for C = 1, 2, 4, 6, 8 the first C
  slots decode greedily for --steps timed steps after 3 warm-ups; tok/s = C / median step time; with
  each row, the median of each of the host's phases of a step (GpuEngine.host_phases: prepare, upload,
  launch, download, wait; "python": the call's time outside the engine's step). A
  step's greedy tokens come from the device (Runner.step_argmax: only C tokens cross the bus, as the
  service runs greedy requests), or with --decode-tokens host from the logits copied to the host and
  np.argmax there (every lane's 129280 floats a step: how the figures before GPU pass 16 were
  taken); `both` measures each (C, mode) both ways back to back (rows marked "tokens");
- prefill and decode in three modes (graphs, tall, staged, chunked): eager launches with the
  direct matvec and unit-by-unit weight loads (the reference), graphs + tall + staged with
  unit-by-unit loads (the default before the chunked loads), and graphs + tall + staged + chunked
  (the default); graphs: one CUDA graph per shape bucket, captured during the warm-up; tall:
  matvec's tall variant for q_b and the LM head; staged: matvec's staged kernel for products of 2+
  columns; chunked: Q8_0/Q4_K weights copied into shared memory as coalesced chunks; for each C
  the modes run back to back, so their contexts differ little;
- exactness on this model: from the same prompts (4 slots of 150 tokens, then 6 steps of fixed
  tokens at C = 4) every mode's logits against the reference mode, bit for bit;
- then the same for C = 1 and 8 after every slot is refilled with --long-ctx tokens (2100: the CSA
  indexer then scores 525 entries a lane and keeps 512);
- a profile: device time per kernel (PyTorch's CUPTI profiler) over 5 decode steps at C = 1 and 8
  (at the long context) and 2 prefill steps of --profile-rows rows (64), eager + tall + staged +
  chunked, into JSON.profile.txt;
- --variants: instead of the three modes, the default mode under each of several switch settings
  set in this one process (`pdl=0/1` programmatic dependent launch, `l2=0/1` the L2 prefetch,
  `mma=0/1` the tensor cores, `fuse=0/1` the fused launches, `persist=0/1` the direct matvec's
  persistent grid, `tall2=0/1` the tall matvec's two chunk stages, `int8=0/1` the integer Q8_0
  products, `imma=N` the fewest columns a Q8_0 product takes the integer tensor cores from,
  `immag=N` the fewest pairs per expert a grouped Q4_K product takes them from (0 never),
  `immarows=N` the fewest rows a call of at most 8 columns takes them from, `immaahead=0/1` and
  `immapersist=0/1` that narrow tile's operands a chunk ahead and its persistent grid,
  `planes=0/1` the producer-built planes (the prep launches they save), `branch=0/1` the step
  branches (the KV side and the shared expert on a second stream), `owngroups=N` the row groups
  a warp of the own grouped Q4_K kernel streams in one copy stream (routed experts; 0 chosen per
  launch), `ownstages=N` that kernel's copy stages (2..4), `ownwidth=N` its widest sub-part (1, 2,
  4, 8; setting these selects the own grouped kernel, so --variants runs it whatever
  DS4_GPU_MV_GROUPED says), `tall=0/1` the tall matvec variant and `tallk=N` the fewest elements
  a row it takes (0 any; -1 the default), `stagedmin=N` the fewest columns a product takes the
  staged kernel from, `hcfused=0/1` each mHC site (the post before it, its projection, its pre)
  fused into two launches, `routefused=0/1` the router's product, the route and the parts in one
  launch, `attnq=0/1` q's per-head norm and RoPE inside the attention's split kernel,
  `comppar=0/1` the compressors' parallel path on prompt steps, `attnheads=N` the attention's heads
  a split block (1, 2, 4; -1 the rule), `splitmin=N` its fewest keys a split (8..256 in steps of 8;
  -1 the default, 64), `immaindep=N` which prompt tiles take a unit's three MMAs independent of each
  other (a mask: 1 the wide Q8_0 tile, 2 the grouped Q4_K kernel, 4 the narrow Q8_0 tile; -1 the
  default, 2), `stagedrows=N` the fewest rows a matrix takes the staged kernel from at every width (-1
  the rule: 512, or 256 for 16-column chunks), `hcstreams=N` the mHC site's streams a sums thread (1 or
  2; -1 the default, 2); joined by ':', variants by ','; what a variant does not name is at its default):
  prefill and decode interleave the variants for each size, and the exactness check compares every
  variant's logits with the first one's, bit for bit (expected equal for all but `mma`, `int8`,
  `hcfused`, `splitmin` and `hcstreams`);
  the profile runs under each variant (JSON.profile-N.txt);
- roofline: the bytes a decode step must read: every tensor except the expert stacks and the
  embedding once; per MoE layer the expected distinct experts E (1 - (1 - K/E)^C) of each stack;
  C embedding rows; per lane and layer its attention keys (window and compressed rows, f16) and, on
  CSA layers, every indexer row it scores. Roofline time = bytes / copy bandwidth; the fraction is
  roofline time / measured step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ds4_app.engine import _native  # noqa: E402
from ds4_app.engine.gguf_file import ModelFile  # noqa: E402
from ds4_app.engine.plan import StepPlan  # noqa: E402
from ds4_app.engine.runner import Runner  # noqa: E402

SLOTS = 8
MAX_CTX = 4096
BLOCKS = MAX_CTX // 128


def bandwidth() -> dict[str, float]:
    """Device copy (read + write) and read bandwidth in GB/s, through PyTorch."""
    import torch

    n = 1 << 30  # floats: 4 GiB
    a = torch.rand(n, device="cuda")
    b = torch.empty_like(a)

    def timed(fn, reps=10) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        return statistics.median(times)

    t_copy = timed(lambda: b.copy_(a))
    t_read = timed(lambda: a.sum())
    out = {"copy_GBps": 2 * 4 * n / t_copy / 1e9, "read_GBps": 4 * n / t_read / 1e9}
    a = b = None  # free the 8 GiB before the model loads
    torch.cuda.empty_cache()
    return out


def step_bytes(mf: ModelFile, c: int, ctx: int) -> float:
    """Bytes one decode step of c lanes at context ctx must read (see the module docstring)."""
    cfg = mf.config
    e, k = cfg.n_expert, cfg.n_expert_used
    distinct = e * (1.0 - (1.0 - k / e) ** c)
    total = 0.0
    for t in mf.tensors.values():
        if t.name.endswith("_exps.weight"):
            total += t.nbytes / e * distinct
        elif t.name == "token_embd.weight":
            total += c * t.nbytes / cfg.n_vocab
        elif "tid2eid" in t.name:
            total += c * k * 4
        else:
            total += t.nbytes
    for r in cfg.compress_ratios:
        keys = min(ctx, 128) + (min(cfg.index_topk, ctx // 4) if r == 4 else ctx // 128 if r == 128 else 0)
        total += c * keys * cfg.head_dim * 2
        if r == 4:
            total += c * (ctx // 4) * cfg.index_head_dim * 2
    return total


def table(slot: int) -> list[int]:
    return [slot * BLOCKS + b for b in range(BLOCKS)]


def prefill(runner: Runner, slot: int, tokens: np.ndarray, rows: int) -> np.ndarray:
    logits = None
    for p0 in range(0, len(tokens), rows):
        p1 = min(len(tokens), p0 + rows)
        lanes = [(slot, int(tokens[k]), k, k == p1 - 1) for k in range(p0, p1)]
        logits = runner.step(StepPlan.build(lanes, {slot: table(slot)}, BLOCKS))
    return logits


def profile(runner: Runner, mf: ModelFile, nxt: dict, pos: dict, path: Path | None, prompt_rows: int = 64) -> dict:
    """Device time per kernel (PyTorch's CUPTI profiler) over 5 decode steps at C = 1 and C = 8 and
    2 prefill steps of `prompt_rows` rows; the tables go to path, the top kernels into the result."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def dev_time(e) -> float:
        for name in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
            if hasattr(e, name):
                return float(getattr(e, name))
        return 0.0

    out, text = {}, []
    cases = {"decode_c1": 1, "decode_c8": 8, f"prefill_{prompt_rows}": 0}
    for name, c in cases.items():
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5 if c else 2):
                if c:
                    lanes = [(s, nxt[s], pos[s], True) for s in range(c)]
                    logits = runner.step(StepPlan.build(lanes, {s: table(s) for s in range(c)}, BLOCKS))
                    for s in range(c):
                        nxt[s], pos[s] = int(np.argmax(logits[s])), pos[s] + 1
                else:
                    runner.reset_slot(SLOTS - 1)
                    lanes = [(SLOTS - 1, 5 + k, k, k == prompt_rows - 1) for k in range(prompt_rows)]
                    runner.step(StepPlan.build(lanes, {SLOTS - 1: table(SLOTS - 1)}, BLOCKS))
        rows = sorted(((e.key, e.count, dev_time(e)) for e in prof.key_averages()), key=lambda r: -r[2])
        total = sum(r[2] for r in rows)
        steps = 5 if c else 2
        out[name] = {"device_us_per_step": total / steps,
                     "top": [{"kernel": k[:120], "calls_per_step": n / steps, "us_per_step": t / steps}
                             for k, n, t in rows[:15]]}
        text.append(f"== {name}: {total / steps:.0f} us of device time per step")
        text += [f"{t / steps:9.1f} us  {n / steps:6.1f} calls  {k[:110]}" for k, n, t in rows[:25]]
    if path is not None:
        path.write_text("\n".join(text) + "\n")
    print("\n".join(text[:12]))
    return out


# (graphs, tall, staged, chunked)
MODES = [(False, False, False, False), (True, True, True, False), (True, True, True, True)]
REFERENCE = MODES[0]


def set_mode(runner: Runner, graphs: bool, tall: bool, staged: bool, chunked: bool) -> None:
    runner._impl.use_graphs = graphs
    runner._impl.use_tall_matvec = tall
    runner._impl.use_staged_matvec = staged
    _native._testing.gpu_set_matvec_chunked(chunked)


def mode_name(graphs: bool, tall: bool, staged: bool, chunked: bool) -> str:
    return f"graphs={int(graphs)} tall={int(tall)} staged={int(staged)} chunked={int(chunked)}"


# The switches a --variants entry may name, each with its setter; unnamed ones go back to the default
# (l2's: the engine's; -1: the integer tensor cores' setters go back to the library's, imma.h).
SWITCH_DEFAULTS = {"pdl": True, "l2": None, "mma": False, "fuse": True, "persist": True,
                   "tall2": False, "int8": True, "imma": -1, "immag": -1, "immarows": -1, "immaahead": -1,
                   "immapersist": -1, "planes": True, "branch": True, "owngroups": -1,
                   "ownstages": -1, "ownwidth": -1, "tall": True, "tallk": -1, "stagedmin": 2,
                   "hcfused": True, "routefused": True, "attnq": True, "comppar": True, "attnheads": -1,
                   "splitmin": -1, "immaindep": -1, "stagedrows": -1, "hcstreams": -1}


def set_variant(runner: Runner, spec: str, l2_default: bool) -> None:
    want = dict(SWITCH_DEFAULTS, l2=l2_default)
    for item in filter(None, spec.split(":")):
        key, _, value = item.partition("=")
        if key not in want:
            raise SystemExit(f"--variants: unknown switch {key!r} (one of {', '.join(want)})")
        if key in ("imma", "immag", "immarows", "owngroups", "ownstages", "ownwidth", "tallk", "stagedmin",
                   "attnheads", "splitmin", "immaindep", "stagedrows", "hcstreams"):
            want[key] = int(value)
        elif key in ("immaahead", "immapersist"):
            want[key] = int(value != "0")
        else:
            want[key] = value != "0"
    _native._testing.gpu_set_pdl(want["pdl"])
    runner._impl.use_l2_prefetch = want["l2"]
    runner._impl.use_branches = want["branch"]
    _native._testing.gpu_set_matvec_mma(want["mma"])
    _native._testing.gpu_set_matvec_fuse(want["fuse"])
    _native._testing.gpu_set_matvec_persistent(want["persist"])
    _native._testing.gpu_set_matvec_tall_stages(2 if want["tall2"] else 1)
    _native._testing.gpu_set_matvec_int8(want["int8"])
    _native._testing.gpu_set_matvec_imma(want["imma"])
    _native._testing.gpu_set_matvec_imma_grouped(want["immag"])
    _native._testing.gpu_set_matvec_imma_narrow(want["immarows"], want["immaahead"], want["immapersist"])
    _native._testing.gpu_set_planes_fused(want["planes"])
    _native._testing.gpu_set_matvec_grouped_groups(want["owngroups"])
    _native._testing.gpu_set_matvec_grouped(1, want["ownstages"], want["ownwidth"])
    runner._impl.use_tall_matvec = want["tall"]
    _native._testing.gpu_set_matvec_tall_min_k(want["tallk"])
    runner._impl.staged_min_cols = want["stagedmin"]
    runner._impl.use_hc_fused = want["hcfused"]
    runner._impl.use_route_fused = want["routefused"]
    runner._impl.use_attn_q_fused = want["attnq"]
    runner._impl.use_parallel_compressor = want["comppar"]
    _native._testing.gpu_set_attn_heads(want["attnheads"])
    _native._testing.gpu_set_attn_split_min(want["splitmin"])
    _native._testing.gpu_set_matvec_imma_indep(want["immaindep"])
    _native._testing.gpu_set_matvec_staged_min_rows(want["stagedrows"])
    _native._testing.gpu_set_hc_site_streams(want["hcstreams"])


class Runs:
    """What prefill and decode iterate over: the three modes, or the default mode under each variant."""

    def __init__(self, runner: Runner, variants: list[str]):
        self.runner, self.variants = runner, variants
        self.l2_default = bool(getattr(runner._impl, "use_l2_prefetch", False))
        self.items = [(m, None) for m in MODES] if not variants else [(MODES[-1], v) for v in variants]

    def set(self, item) -> str:
        mode, variant = item
        set_mode(self.runner, *mode)
        if variant is not None:
            set_variant(self.runner, variant, self.l2_default)
        return mode_name(*mode) + (f" [{variant}]" if variant is not None else "")

    def reset(self) -> None:
        set_mode(self.runner, *REFERENCE)
        if self.variants:
            set_variant(self.runner, "", self.l2_default)


def fixed_logits(runner: Runner, mf: ModelFile) -> np.ndarray:
    """The exactness checks' logits: 4 slots prefilled with the same 150 tokens 32 rows a step, then
    6 steps of fixed tokens at C = 4; the slots are reset first."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, mf.config.n_vocab, 150) for _ in range(4)]
    feed = rng.integers(0, mf.config.n_vocab, (6, 4))
    out = []
    for s in range(4):
        runner.reset_slot(s)
        out.append(prefill(runner, s, prompts[s], 32))
    for k in range(6):
        lanes = [(s, int(feed[k, s]), 150 + k, True) for s in range(4)]
        out.append(runner.step(StepPlan.build(lanes, {s: table(s) for s in range(4)}, BLOCKS)))
    return np.concatenate(out)


def compare_logits(runner: Runner, mf: ModelFile, settings: list, apply, label: str) -> list[dict]:
    """fixed_logits under each setting (apply(setting) -> its name), against the first one's bit for
    bit; the slots are reset after."""
    results, base = [], None
    for setting in settings:
        name = apply(setting)
        got = fixed_logits(runner, mf)
        base = got if base is None else base
        row = {label: name, "bit_identical": bool(np.array_equal(got.view(np.uint32), base.view(np.uint32))),
               "max_abs_diff": float(np.abs(got.astype(np.float64) - base).max()), "finite": bool(np.isfinite(got).all())}
        results.append(row)
        print(f"exactness {name}: bit-identical to the first {row['bit_identical']}, "
              f"max |diff| {row['max_abs_diff']:.3g}, finite {row['finite']}", flush=True)
    for s in range(4):
        runner.reset_slot(s)
    return results


def exactness(runner: Runner, mf: ModelFile) -> list[dict]:
    """Each mode's logits from the same prompts against the reference mode, bit for bit."""

    def apply(mode) -> str:
        set_mode(runner, *mode)
        return mode_name(*mode)

    results = compare_logits(runner, mf, MODES, apply, "mode")
    set_mode(runner, *REFERENCE)
    return results


def variant_exactness(runner: Runner, mf: ModelFile, runs: Runs) -> list[dict]:
    """The same logits under each variant (default mode), against the first variant bit for bit."""
    results = compare_logits(runner, mf, runs.items, runs.set, "variant")
    runs.reset()
    return results


def host_phase_medians(times: list[float], phases: list[dict]) -> dict:
    """The median of each host phase of the engine's steps (GpuEngine.host_phases, microseconds), and
    "python": the step's time outside the engine's step call (the binding's checks, the arrays)."""
    out = {k: statistics.median(p[k] for p in phases) for k in phases[0]} if phases and phases[0] else {}
    if out:
        out["python"] = statistics.median(t * 1e6 - sum(p.values()) for t, p in zip(times, phases))
    return out


def decode(runner: Runner, mf: ModelFile, nxt: dict, pos: dict, concurrencies, steps: int,
           copy_bw: float | None, runs: Runs, tokens: str = "device") -> list[dict]:
    """Greedy decode of the first C slots for each C, in each mode (or variant) back to back: step
    times, tok/s and the roofline fraction. tokens: where the greedy tokens are taken ("device",
    "host", or "both": each way in turn)."""
    rows = []
    ways = ["device", "host"] if tokens == "both" else [tokens]
    for c, item, way in ((c, m, w) for c in concurrencies for m in runs.items for w in ways):
        name = runs.set(item)
        times, phases = [], []
        for i in range(3 + steps):
            lanes = [(s, nxt[s], pos[s], True) for s in range(c)]
            plan = StepPlan.build(lanes, {s: table(s) for s in range(c)}, BLOCKS)
            t0 = time.perf_counter()
            if way == "device":
                got = runner.step_argmax(plan)
                dt = time.perf_counter() - t0
                picked = [int(t) for t in got]
            else:
                logits = runner.step(plan)
                dt = time.perf_counter() - t0
                picked = [int(np.argmax(logits[s])) for s in range(c)]
            if i >= 3:
                times.append(dt)
                phases.append(runner._impl.host_phases())
            for s in range(c):
                nxt[s], pos[s] = picked[s], pos[s] + 1
        step = statistics.median(times)
        nbytes = step_bytes(mf, c, pos[0])
        row = {"concurrency": c, "mode": name, "tokens": way, "step_ms_median": step * 1e3,
               "step_ms_min": min(times) * 1e3, "tok_s": c / step, "bytes_per_step": nbytes, "context": pos[0],
               "host_us_median": host_phase_medians(times, phases)}
        if copy_bw:
            roof = nbytes / (copy_bw * 1e9)
            row.update(roofline_ms=roof * 1e3, fraction_of_roofline=roof / step)
        rows.append(row)
        print(f"decode C={c} {row['mode']} tokens={way}: {row['tok_s']:.1f} tok/s, step {step * 1e3:.2f} ms "
              f"(min {min(times) * 1e3:.2f}), "
              f"{nbytes / 1e9:.3f} GB/step" + (f", roofline {row['roofline_ms']:.3f} ms = "
                                                f"{row['fraction_of_roofline']:.1%}" if copy_bw else ""), flush=True)
        print("  host us (median): " + ", ".join(f"{k} {v:.1f}" for k, v in row["host_us_median"].items()), flush=True)
    runs.reset()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--json")
    ap.add_argument("--ctx", type=int, default=600)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--decode-tokens", choices=("device", "host", "both"), default="device",
                    help="where decode takes its greedy tokens (module docstring)")
    ap.add_argument("--long-ctx", type=int, default=2100, help="a second decode context (0: none)")
    ap.add_argument("--variants", default="", help="switch settings to compare in one process (module docstring)")
    ap.add_argument("--profile-rows", type=int, default=64, help="prompt rows of the profiled prefill steps")
    ap.add_argument("--prefill-rows", default="16,64",
                    help="prompt rows a prefill step, comma-separated (the runner's max_rows is the largest, at least 64)")
    ap.add_argument("--prefill-only", action="store_true", help="stop after the prefill figures")
    args = ap.parse_args()
    result: dict = {"model": args.model}
    try:
        result["bandwidth"] = bandwidth()
    except Exception as e:  # no PyTorch: the rooflines are left out
        result["bandwidth"] = {"error": f"{type(e).__name__}: {e}"}
    print("bandwidth:", result["bandwidth"], flush=True)

    mf = ModelFile.open(args.model)
    t0 = time.perf_counter()
    prefill_rows = [int(r) for r in args.prefill_rows.split(",")]
    runner = Runner(mf, backend=_native.gpu_backend(), max_slots=SLOTS, max_ctx=MAX_CTX,
                    max_rows=max(64, *prefill_rows))
    result["load_s"] = time.perf_counter() - t0
    result["device"] = runner.device
    result["memory_plan"] = runner.memory_plan.sections
    print(f"{runner!r}: loaded in {result['load_s']:.1f} s", flush=True)
    rng = np.random.default_rng(0)

    def save() -> None:  # after each part, so a call cut short still returns what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))

    runs = Runs(runner, [v for v in args.variants.split(",") if v or args.variants])
    result["exactness"] = exactness(runner, mf)
    if runs.variants:
        result["variant_exactness"] = variant_exactness(runner, mf, runs)
    save()

    result["prefill"] = []
    for item in runs.items:
        name = runs.set(item)
        for rows in prefill_rows:
            runner.reset_slot(SLOTS - 1)
            prompt = rng.integers(0, mf.config.n_vocab, 2048)
            prefill(runner, SLOTS - 1, prompt[:2 * rows], rows)  # warm-up (and the graph capture)
            runner.reset_slot(SLOTS - 1)
            t0 = time.perf_counter()
            prefill(runner, SLOTS - 1, prompt, rows)
            dt = time.perf_counter() - t0
            result["prefill"].append({"mode": name, "rows_per_step": rows,
                                      "tokens": len(prompt),
                                      "seconds": dt, "tok_s": len(prompt) / dt})
            print(f"prefill {rows} rows/step {name}: "
                  f"{len(prompt) / dt:.0f} tok/s",
                  flush=True)
    runner.reset_slot(SLOTS - 1)
    runs.reset()
    save()
    if args.prefill_only:
        return 0

    nxt, pos = {}, {}
    for s in range(SLOTS):
        logits = prefill(runner, s, rng.integers(0, mf.config.n_vocab, args.ctx), 64)
        nxt[s], pos[s] = int(np.argmax(logits[-1])), args.ctx
    copy_bw = result["bandwidth"].get("copy_GBps")
    result["decode"] = decode(runner, mf, nxt, pos, (1, 2, 4, 6, 8), args.steps, copy_bw, runs, args.decode_tokens)
    save()
    if args.long_ctx:
        for s in range(SLOTS):
            runner.reset_slot(s)
            logits = prefill(runner, s, rng.integers(0, mf.config.n_vocab, args.long_ctx), 64)
            nxt[s], pos[s] = int(np.argmax(logits[-1])), args.long_ctx
        print(f"-- decode at {args.long_ctx}", flush=True)
        result["decode_long"] = decode(runner, mf, nxt, pos, (1, 8), args.steps, copy_bw, runs, args.decode_tokens)
    result["graphs_captured"] = runner._impl.graphs_captured
    save()
    set_mode(runner, False, True, True, True)
    for k, variant in enumerate(runs.variants or [None]):
        key, suffix = ("profile", ".profile.txt") if variant is None else (f"profile {variant}", f".profile-{k}.txt")
        if variant is not None:
            set_variant(runner, variant, runs.l2_default)
        try:
            result[key] = profile(runner, mf, nxt, pos, Path(args.json).with_suffix(suffix) if args.json else None,
                                  args.profile_rows)
        except Exception as e:  # the profile is a diagnostic; the figures above stand without it
            result[key] = {"error": f"{type(e).__name__}: {e}"}
            print("profile:", result[key])
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
