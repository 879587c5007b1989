"""Digests of the GPU's integer products and of a tiny engine run, to prove two builds give the same bits.

    python3 ext/gpu/bench/bits_digest.py OUT.json                 write the digests
    python3 ext/gpu/bench/bits_digest.py OUT.json --against A.json  and compare them with A's

A change meant to keep every bit (a cheaper instruction sequence for the same float operations)
runs this on the build before and after it; exit status 1 when any digest differs. The cases are
fixed by their seeds: Q8_0 and Q4_K products at 1 to 300 columns on the SIMT kernels and on the
tensor cores, grouped Q4_K and Q8_0 products on either kernel, and the tiny preset's prompts and
decode steps, eager and under graphs. The products' "normal" digests leave out the edge-case
columns (tiny, huge and nonfinite activations), for a change that keeps the bits of every ordinary
value but not of the underflows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ds4_app.engine import _native  # noqa: E402
from tests.gpu.test_gpu_kernels import tame_raw  # noqa: E402

T = _native._testing
Q8_0, Q4_K = 8, 12


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()[:16]


EDGE = 4  # the activation rows below this are the edge cases; the "normal" digests leave them out


def activations(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Normal rows but for rows 1-3: a tiny row, a huge one and one with an inf (every unit-scale
    branch)."""
    x = rng.standard_normal((n, k)).astype(np.float32)
    if n > 3:
        x[1] *= 1e-30
        x[2] *= 1e20
        x[3, 5] = np.inf
    return x


def dense_cases(out: dict) -> None:
    for t, name in ((Q8_0, "q8_0"), (Q4_K, "q4_k")):
        for ne0, ne1 in ((4096, 1000), (2048, 3000)):
            rng = np.random.default_rng(ne0 + ne1 + t)
            raw = tame_raw(t, ne0 * ne1, rng)
            x = activations(rng, 300, ne0)
            for width in (1, 3, 8, 16, 64, 300):
                for imma in (0, 1):
                    T.gpu_set_matvec_imma(imma)
                    y = T.gpu_matmul(t, raw, ne0, ne1, x[:width])
                    out[f"{name} {ne0}x{ne1} w{width} imma{imma}"] = digest(y)
                    if width > 4:
                        out[f"{name} {ne0}x{ne1} w{width} imma{imma} normal"] = digest(y[EDGE:])
    T.gpu_set_matvec_imma(-1)


def grouped_cases(out: dict) -> None:
    for t, name in ((Q4_K, "q4_k"), (Q8_0, "q8_0")):
        for ne0, ne1, n_expert in ((2048, 4096, 4), (4096, 1024, 6)):
            rng = np.random.default_rng(ne0 + ne1 + n_expert + t)
            raw = tame_raw(t, ne0 * ne1 * n_expert, rng)
            x = activations(rng, 96, ne0)
            pe = rng.integers(0, n_expert, 96 * 3).astype(np.int32)
            xr = np.repeat(np.arange(96, dtype=np.int32), 3)
            for imma in (0, 1):
                T.gpu_set_matvec_imma_grouped(imma)
                y = T.gpu_matmul_grouped(t, raw, ne0, ne1, n_expert, x, pe, xr, 8)
                out[f"grouped {name} {ne0}x{ne1}x{n_expert} imma{imma}"] = digest(y)
                out[f"grouped {name} {ne0}x{ne1}x{n_expert} imma{imma} normal"] = digest(y[xr >= EDGE])
    T.gpu_set_matvec_imma_grouped(-1)


def engine_cases(out: dict) -> None:
    from ds4_app.engine.gguf_file import ModelFile
    from ds4_app.engine.presets import tiny
    from ds4_app.engine.synth import synthesize
    from tests.engine_cases import Seq, prompt, run
    from tests.gpu.test_gpu_engine import gpu_engine

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tiny.gguf"
        synthesize(tiny(), path, seed=21)
        mf = ModelFile.open(path)
        gpu = gpu_engine(mf, max_slots=2, max_rows=80)
        for imma in (False, True):
            # the defaults, or the tensor cores taking every Q8_0 call of 4 columns and up and every
            # grouped Q4_K call
            T.gpu_set_matvec_imma(4 if imma else -1)
            T.gpu_set_matvec_imma_grouped(1 if imma else -1)
            for graphs in (False, True):
                gpu.use_graphs = graphs
                for rows in (1, 40):
                    gpu.reset_slot(0)
                    gpu.reset_slot(1)
                    logits = run(gpu, [Seq(prompt(mf, 5, 90), slot=0, pages=[1, 3], rows=rows),
                                       Seq(prompt(mf, 6, 70), slot=1, pages=[4, 6], rows=max(1, rows // 2))])
                    key = f"engine tiny rows{rows} graphs{int(graphs)} imma{int(imma)}"
                    out[key] = digest(np.concatenate(logits))
        T.gpu_set_matvec_imma(-1)
        T.gpu_set_matvec_imma_grouped(-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--against", help="digests of another build to compare with")
    args = ap.parse_args()
    out: dict[str, str] = {}
    dense_cases(out)
    grouped_cases(out)
    engine_cases(out)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(out)} digests -> {args.out}")
    if not args.against:
        return 0
    want = json.loads(Path(args.against).read_text())
    differ = [k for k in want if out.get(k) != want[k]]
    missing = [k for k in out if k not in want]
    for k in differ:
        print(f"DIFFERS: {k}: {want[k]} -> {out.get(k)}")
    print(f"{len(want) - len(differ)} of {len(want)} digests equal; {len(missing)} new")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
