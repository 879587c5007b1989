"""One eager decode step at concurrency C, bracketed for a profiler: the target of
`ncu --profile-from-start off` (or nsys with the CUDA profiler range).

    ncu --profile-from-start off --section SpeedOfLight --csv --page details \
        python3 ext/gpu/bench/ncu_step.py MODEL.gguf C [--variant owngroups=4:...]

Each of the first C slots takes a 64-token prompt and 3 greedy steps (graphs off, so every kernel
is its own launch), then one more step runs between cudaProfilerStart and cudaProfilerStop. The
variant is an engine_bench --variants entry (the same switches, set the same way). With
--prompt-rows N the profiled step is instead one prompt step of N rows (C is then ignored), after
one unprofiled step of the same shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_bench import BLOCKS, MAX_CTX, SLOTS, prefill, set_variant, table  # noqa: E402

from ds4_app.engine import _native  # noqa: E402
from ds4_app.engine.gguf_file import ModelFile  # noqa: E402
from ds4_app.engine.plan import StepPlan  # noqa: E402
from ds4_app.engine.runner import Runner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("c", type=int, help="lanes in the profiled step (1..8)")
    ap.add_argument("--variant", default="", help="an engine_bench --variants entry")
    ap.add_argument("--prompt-rows", type=int, default=0, help="profile a prompt step of this many rows instead")
    args = ap.parse_args()
    import torch  # the CUDA profiler range

    mf = ModelFile.open(args.model)
    rows = args.prompt_rows
    runner = Runner(mf, backend=_native.gpu_backend(), max_slots=SLOTS, max_ctx=MAX_CTX, max_rows=max(64, rows))
    runner._impl.use_graphs = False
    set_variant(runner, args.variant, runner._impl.use_l2_prefetch)
    rng = np.random.default_rng(0)
    if rows > 0:
        tokens = rng.integers(0, mf.config.n_vocab, 2 * rows)
        prefill(runner, 0, tokens[:rows], rows)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        lanes = [(0, int(tokens[k]), k, k == 2 * rows - 1) for k in range(rows, 2 * rows)]
        runner.step(StepPlan.build(lanes, {0: table(0)}, BLOCKS))
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("done", flush=True)
        return 0
    nxt, pos = {}, {}
    for s in range(args.c):
        logits = prefill(runner, s, rng.integers(0, mf.config.n_vocab, 64), 64)
        nxt[s], pos[s] = int(np.argmax(logits[-1])), 64

    def step() -> None:
        lanes = [(s, nxt[s], pos[s], True) for s in range(args.c)]
        logits = runner.step(StepPlan.build(lanes, {s: table(s) for s in range(args.c)}, BLOCKS))
        for s in range(args.c):
            nxt[s], pos[s] = int(np.argmax(logits[s])), pos[s] + 1

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
