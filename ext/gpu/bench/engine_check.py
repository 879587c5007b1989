"""GPU engine against the CPU engine on tiny models: where do they differ, if anywhere?

    python3 ext/gpu/bench/engine_check.py            per variant (tiny, sliding-window only, CSA
                                                      only, HCA only; QAT off/on): the logits error
                                                      of 300 steps each started from the CPU's
                                                      state (max, median, steps above 2e-3), of a
                                                      free run at 1 and 16 rows a step, and per
                                                      layer the largest difference of each part of
                                                      the slot state after the free run
    python3 ext/gpu/bench/engine_check.py --quick    one short mixed run (two slots, packed and
                                                      decode lanes, every layer kind), eager with
                                                      the direct matvec, then graphs + tall +
                                                      staged matvec, bit for bit: for
                                                      compute-sanitizer

Prints one line per finding; exit status 1 when any logits error exceeds 2e-3.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ds4_app.engine import _native  # noqa: E402
from ds4_app.engine.gguf_file import ModelFile  # noqa: E402
from ds4_app.engine.memory import plan_memory  # noqa: E402
from ds4_app.engine.plan import StepPlan  # noqa: E402
from ds4_app.engine.presets import tiny  # noqa: E402
from ds4_app.engine.synth import synthesize  # noqa: E402

MAX_CTX = 512
BLOCKS = MAX_CTX // 128
TOL = 2e-3


def two_layers(ratios: tuple[int, int]):
    return dataclasses.replace(tiny(), n_layer=2, compress_ratios=ratios, swiglu_clamp_exp=(10.0,) * 2,
                               swiglu_clamp_shexp=(10.0,) * 2)


VARIANTS = {"tiny": tiny(), "swa": two_layers((0, 0)), "csa": two_layers((4, 4)), "hca": two_layers((128, 128))}


def engines(mf: ModelFile, slots: int = 2, rows: int = 16):
    tensors = [(t.name, t.ggml_type, t.ne, t.offset) for t in mf.tensors.values()]
    n_pages = plan_memory(mf.config, max_slots=slots, max_ctx=MAX_CTX).n_pages
    cpu = _native.Engine(mf.config, str(mf.path), tensors, max_slots=slots, max_ctx=MAX_CTX, n_pages=n_pages,
                         max_rows=rows, n_threads=4)
    gpu = _native.GpuEngine(mf.config, str(mf.path), tensors, max_slots=slots, max_ctx=MAX_CTX, n_pages=n_pages,
                            max_rows=rows)
    return cpu, gpu


def feed(eng, tokens: np.ndarray, rows: int, slot: int = 0, pages=(0, 1, 2, 3)) -> np.ndarray:
    out = []
    for p0 in range(0, len(tokens), rows):
        lanes = [(slot, int(tokens[k]), k, True) for k in range(p0, min(len(tokens), p0 + rows))]
        out.append(eng.step(StepPlan.build(lanes, {slot: list(pages)}, BLOCKS)))
    return np.concatenate(out)


def rel(g: np.ndarray, w: np.ndarray) -> np.ndarray:
    g, w = g.astype(np.float64), w.astype(np.float64)
    return np.linalg.norm(g - w, axis=-1) / np.maximum(np.linalg.norm(w, axis=-1), 1e-30)


def state_diff(cpu, gpu, n_tokens: int) -> list[str]:
    table = np.asarray([0, 1, 2, 3], np.int32)
    want = _native._testing.export_slot_state(cpu, 0, table, n_tokens)
    got = _native._testing.gpu_export_slot_state(gpu, 0, table, n_tokens)
    lines = []
    for key in want:
        for layer, (g, w) in enumerate(zip(got[key], want[key])):
            if w is None or w.size == 0:
                continue
            fin = np.isfinite(w)
            if not np.array_equal(np.isfinite(g), fin):
                lines.append(f"  state {key}[{layer}]: non-finite pattern differs")
                continue
            scale = max(float(np.abs(w[fin]).max(initial=0.0)), 1e-6)
            d = float(np.abs(g[fin] - w[fin]).max(initial=0.0)) / scale
            exact = float(np.mean(g[fin] == w[fin])) if fin.any() else 1.0
            lines.append(f"  state {key}[{layer}]: max diff {d:.2e} of max |x|, {exact:.1%} bit-equal")
    return lines


def synced(cpu, gpu, tokens: np.ndarray) -> np.ndarray:
    """Per step: the error of a GPU step started from the CPU engine's state."""
    table = np.asarray([0, 1, 2, 3], np.int32)
    err = np.empty(len(tokens))
    for t, tok in enumerate(tokens):
        _native._testing.gpu_sync_slot(cpu, gpu, 0, table, t)
        plan = StepPlan.build([(0, int(tok), t, True)], {0: [0, 1, 2, 3]}, BLOCKS)
        err[t] = rel(gpu.step(plan), cpu.step(plan))[0]
    return err


def full() -> int:
    bad = 0
    for kind, block in (("fp8", 64), ("fp4", 32), ("hadamard", 128), ("f16", 64)):
        from ds4_app.engine.reference import numerics as N

        x = (np.random.default_rng(1).standard_normal((64, block)) * np.logspace(-8, 5, 64)[:, None]).astype(np.float32)
        ref = {"fp8": lambda a: N.fp8_e4m3_roundtrip(a, 64), "fp4": lambda a: N.fp4_roundtrip(a, 32),
               "hadamard": N.hadamard, "f16": N.round_f16}[kind](x)
        got = _native._testing.gpu_qat(kind, x)
        print(f"round trip {kind:8s}: {int(np.sum(got != ref))} of {x.size} values differ from the reference")
        bad += int(np.sum(got != ref) > 0)
    with tempfile.TemporaryDirectory() as tmp:
        for variant, qat in [("swa", False), ("hca", False), ("csa", False), ("csa", True), ("tiny", False),
                             ("tiny", True)]:
            path = Path(tmp) / f"{variant}-{int(qat)}.gguf"
            synthesize(VARIANTS[variant], path, seed=11, qat_numerics=qat)
            mf = ModelFile.open(path)
            tokens = np.random.default_rng(3).integers(0, mf.config.n_vocab, 300)
            tag = f"{variant:5s} qat={int(qat)}"
            try:
                err = synced(*engines(mf), tokens)
                over = np.nonzero(err > TOL)[0]
                print(f"{tag} synced : max {err.max():.2e} median {np.median(err):.2e}, steps over {TOL}: "
                      f"{over.tolist()[:10]}")
                bad += int(len(over) > (2 if qat else 0))
            except Exception as e:  # report and go on: later variants still say something
                print(f"{tag} synced : FAILED {type(e).__name__}: {e}")
                bad += 1
            for rows in (1, 16):
                cpu, gpu = engines(mf)
                try:
                    want = feed(cpu, tokens, rows)
                    got = feed(gpu, tokens, rows)
                except Exception as e:
                    print(f"{tag} rows={rows:2d}: FAILED {type(e).__name__}: {e}")
                    bad += 1
                    continue
                err = rel(got, want)
                over = np.nonzero(err > TOL)[0]
                same = np.mean([np.argmax(a) == np.argmax(b) for a, b in zip(got, want)])
                print(f"{tag} rows={rows:2d}: free run max {err.max():.2e} (step {int(err.argmax())}) median "
                      f"{np.median(err):.2e}, first step over {TOL}: {over[0] if over.size else -1}, "
                      f"finite {np.isfinite(got).all()}, argmax agree {same:.1%}")
                bad += int(not qat and (err.max() > TOL or not np.isfinite(got).all()))
                if rows == 16 and mf.config.index_head_dim > 0:
                    for line in state_diff(cpu, gpu, len(tokens)):
                        print(line)
    return 1 if bad else 0


def quick() -> int:
    """A short QAT run through every kernel, for compute-sanitizer: eager launches with the direct
    matvec, then again with CUDA graph replay, matvec's tall variant and its staged kernel (the LM
    head has 16448 rows here; up to 20 lanes a step). Exit 1 on
    non-finite logits or when the second pass differs from the first in any bit (QAT free runs part
    from the CPU legitimately after a rounding flip, so that error is printed, not judged)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-q.gguf"
        synthesize(dataclasses.replace(tiny(), n_vocab=16384 + 64), path, seed=2, qat_numerics=True)
        mf = ModelFile.open(path)
        cpu, gpu = engines(mf, slots=2, rows=24)
        rng = np.random.default_rng(0)
        a, b = rng.integers(0, mf.config.n_vocab, 150), rng.integers(0, mf.config.n_vocab, 60)
        passes = []
        worst, finite = 0.0, True
        for graphs_and_tall in (False, True):
            gpu.use_graphs = graphs_and_tall
            gpu.use_tall_matvec = graphs_and_tall
            gpu.use_staged_matvec = graphs_and_tall
            gpu.reset_slot(0)
            gpu.reset_slot(1)
            pa = pb = 0
            out = []
            while pa < len(a) or pb < len(b):
                lanes = [(0, int(a[k]), k, True) for k in range(pa, min(len(a), pa + 16))]
                lanes += [(1, int(b[k]), k, True) for k in range(pb, min(len(b), pb + 4))]
                plan = StepPlan.build(lanes, {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}, BLOCKS)
                got = gpu.step(plan)
                out.append(got)
                finite = finite and bool(np.isfinite(got).all())
                if not graphs_and_tall:
                    worst = max(worst, float(rel(got, cpu.step(plan)).max()))
                pa, pb = min(len(a), pa + 16), min(len(b), pb + 4)
            passes.append(np.concatenate(out))
        same = bool(np.array_equal(passes[0].view(np.uint32), passes[1].view(np.uint32)))
        print(f"quick: max rel err {worst:.2e} over {len(a)} + {len(b)} tokens (QAT on), finite {finite}; "
              f"graphs + tall + staged pass bit-identical to eager: {same} ({gpu.graphs_captured} graphs)")
        return 0 if finite and same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(f"backend {_native.gpu_backend()}, device visible: {_native.gpu_available()}")
    return quick() if args.quick else full()


if __name__ == "__main__":
    sys.exit(main())
