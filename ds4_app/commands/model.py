"""``ds4-app model synth|inspect``: write a synthetic DS4 GGUF, or describe one.

``synth --preset P --seed N --out FILE [--qat]`` writes a deterministic random model of a preset
(``tiny`` for tests, ``flash-l4``, ``flash``). ``inspect FILE [--slots N --ctx C] [--json]``
validates a file and prints its config, tensor types, parameter count, size and memory plan.
A bad file or bad argument is one line on stderr (``ds4-app: error: ...``) and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..engine.gguf_file import ModelFileError, format_bytes


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``model`` command with its ``synth`` and ``inspect`` subcommands."""
    from ..engine.presets import PRESETS

    p = sub.add_parser("model", help="synthesize or inspect DS4 model files",
                       description="Synthesize or inspect DS4 GGUF model files.")
    msub = p.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)

    s = msub.add_parser("synth", help="write a deterministic random DS4 GGUF",
                        description="Write a deterministic random DS4 GGUF (same seed, same bytes).")
    s.add_argument("--preset", required=True, choices=list(PRESETS), help="model shape")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--out", required=True, metavar="FILE", help="output GGUF path")
    s.add_argument("--qat", action="store_true",
                   help="mark the model for the FP8/FP4 quantization round trips (ds4app.qat_numerics)")
    s.add_argument("--type", action="append", default=[], metavar="ROLE_OR_TENSOR=TYPE", dest="types",
                   help="override a storage type, e.g. exps_down=Q8_0 or 'blk.*.attn_kv.weight=F16'")
    s.set_defaults(handler=run_synth)

    i = msub.add_parser("inspect", help="validate a DS4 GGUF and print its config and memory plan",
                        description="Validate a DS4 GGUF and print its config, tensor types and memory plan.")
    i.add_argument("file", metavar="FILE", help="GGUF model file")
    i.add_argument("--slots", type=int, default=6, metavar="N", help="concurrent sequences for the plan (default 6)")
    i.add_argument("--ctx", type=int, default=4096, metavar="C", help="context per sequence for the plan (default 4096)")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(handler=run_inspect)


def _fail(msg: str) -> int:
    print(f"ds4-app: error: {' '.join(str(msg).split())}", file=sys.stderr)
    return 2


def run_synth(args: argparse.Namespace) -> int:
    """Handler of ``model synth``; returns the exit code."""
    from ..engine.synth import estimate_file_size, synthesize

    try:
        types: dict[str, str] = {}
        for item in args.types:
            key, sep, val = item.partition("=")
            if not sep or not key or not val:
                raise ValueError(f"--type expects ROLE_OR_TENSOR=TYPE, got {item!r}")
            types[key] = val
        total = estimate_file_size(args.preset, types or None)
        show = sys.stderr.isatty() and total > (1 << 30)
        last = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if show and (now - last[0] > 0.5 or done == total):
                last[0] = now
                print(f"\rwriting {args.out}: {100 * done // total}% ({format_bytes(done)})",
                      end="", file=sys.stderr, flush=True)

        t0 = time.monotonic()
        synthesize(args.preset, args.out, seed=args.seed, types=types or None, qat_numerics=args.qat,
                   progress=progress)
        if show:
            print(file=sys.stderr)
    except (ValueError, OSError, ModelFileError) as e:
        return _fail(str(e))
    print(f"wrote {args.out}: preset {args.preset}, seed {args.seed}, "
          f"{format_bytes(total)} of weights in {time.monotonic() - t0:.1f} s")
    return 0


def _memory_plan(cfg: Any, slots: int, ctx: int, weight_bytes: int) -> Any:
    """The engine's memory plan, or None while ``engine.memory`` is not available."""
    try:
        from ..engine.memory import plan_memory
    except ImportError:
        return None
    return plan_memory(cfg, max_slots=slots, max_ctx=ctx, kv_pool_tokens=None, weights_bytes=weight_bytes)


def run_inspect(args: argparse.Namespace) -> int:
    """Handler of ``model inspect``; returns the exit code."""
    from ..engine.gguf_file import ModelFile

    try:
        if args.slots < 1 or args.ctx < 1:
            raise ValueError("--slots and --ctx must be positive")
        mf = ModelFile.open(args.file)
        plan = _memory_plan(mf.config, args.slots, args.ctx, mf.weight_bytes)
    except (ValueError, OSError, ModelFileError) as e:
        return _fail(str(e))
    cfg = mf.config
    info: dict[str, Any] = {
        "path": str(mf.path),
        "file_size": mf.file_size,
        "name": mf.metadata.get("general.name"),
        "config": cfg.summary(),
        "types": mf.type_counts(),
        "n_tensors": len(mf.tensors),
        "n_extra_tensors": len(mf.extra_tensors),
        "param_count": mf.param_count,
        "weight_bytes": mf.weight_bytes,
        "memory": None if plan is None else {
            "max_slots": args.slots, "max_ctx": args.ctx, "sections": dict(plan.sections),
            "total": int(plan.total), "n_pages": int(plan.n_pages)},
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0

    out = [
        f"file        {mf.path} ({format_bytes(mf.file_size)})",
        f"name        {info['name'] or '-'}",
        f"model       deepseek4: {cfg.n_layer} layers, d {cfg.n_embd}, vocab {cfg.n_vocab}, "
        f"{cfg.n_head} heads x {cfg.head_dim}, {cfg.n_expert} experts ({cfg.n_expert_used} per token"
        f"{', 1 shared' if cfg.n_expert_shared else ''})",
        f"params      {mf.param_count:,} in {len(mf.tensors)} tensors, {format_bytes(mf.weight_bytes)}"
        + (f" (+{len(mf.extra_tensors)} MTP tensors, not used)" if mf.extra_tensors else ""),
        "types       " + ", ".join(f"{k} {v}" for k, v in mf.type_counts().items()),
        "config",
    ]
    for key, val in cfg.summary().items():
        if isinstance(val, tuple) and len(set(val)) == 1 and len(val) > 1:
            val = f"{val[0]} x {len(val)}"
        elif isinstance(val, tuple):
            val = ",".join(str(v) for v in val)
        out.append(f"  {key:<22}{val}")
    if plan is None:
        out.append("memory plan (unavailable: engine.memory is not installed)")
    else:
        out.append(f"memory plan ({args.slots} slots x {args.ctx} ctx, {plan.n_pages} pages)")
        for k, v in plan.sections.items():
            out.append(f"  {k:<22}{format_bytes(v)}")
        out.append(f"  {'total':<22}{format_bytes(plan.total)}")
    print("\n".join(out))
    return 0
