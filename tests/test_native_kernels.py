"""CPU kernels of the native module: dequantizers against gguf.quants, matmul against numpy,
batch-width and thread-count exactness, SIMD path choice and thread-pool chunking.

The scalar path is always tested; the AVX2 path wherever the CPU has it. Needs the built module
(`pip install --no-build-isolation -e . -C editable.mode=inplace`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing

# ggml type id -> (elements per block, bytes per block)
GEOMETRY = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 12: (256, 144), 39: (32, 17)}
NAMES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 12: "Q4_K", 39: "MXFP4"}
TYPES = list(GEOMETRY)
PATHS = ["scalar"] + (["avx2"] if T.path_supported("avx2") else [])


def _finite_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random half-precision bit patterns: every sign, zero, subnormals, up to 65504; no inf/NaN."""
    h = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    h = np.where((h & 0x7C00) == 0x7C00, h & 0xBFFF, h).astype(np.uint16)
    h[: min(n, 4)] = [0x0000, 0x8000, 0x0001, 0x7BFF][: min(n, 4)]  # +0, -0, tiny subnormal, max
    return h


def random_raw(t: int, n: int, rng: np.random.Generator, *, tame: bool = False) -> np.ndarray:
    """n elements of random ggml data of type t as uint8.

    tame=False covers the whole legal range (the dequantizer test); tame=True keeps values
    moderate so products can be compared with numpy to a tight tolerance (the matmul tests).
    """
    be, bb = GEOMETRY[t]
    nb = n // be
    if t == 0:
        x = rng.standard_normal(n).astype(np.float32)
        if not tame:
            x[:4] = [0.0, -0.0, 3.0e38, 1.0e-40]
        return x.view(np.uint8)
    if t == 1:
        if tame:
            return (rng.standard_normal(n) * 0.5).astype(np.float16).view(np.uint8)
        h = rng.integers(0, 1 << 16, n, dtype=np.uint16)  # includes +-inf, excludes NaN below
        h = np.where(((h & 0x7C00) == 0x7C00) & ((h & 0x03FF) != 0), h & 0xFC00, h).astype(np.uint16)
        return h.view(np.uint8)
    if t == 30:
        if tame:
            return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        b = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        b = np.where(((b & 0x7F80) == 0x7F80) & ((b & 0x007F) != 0), b & 0xFF80, b).astype(np.uint16)
        return b.view(np.uint8)
    raw = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
    if t == 8:
        d = (rng.uniform(-0.02, 0.02, nb).astype(np.float16).view(np.uint16) if tame else _finite_halves(rng, nb))
        raw[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    elif t == 12:
        if tame:
            dd = np.stack([rng.uniform(0.001, 0.02, nb), rng.uniform(0.0, 0.02, nb)], axis=1).astype(np.float16)
        else:
            dd = _finite_halves(rng, 2 * nb).view(np.float16).reshape(nb, 2)
        raw[:, 0:4] = dd.view(np.uint8).reshape(nb, 4)
    elif t == 39:
        if tame:
            raw[:, 0] = rng.integers(118, 130, nb)
        else:
            raw[: min(nb, 4), 0] = [0, 1, 2, 255][: min(nb, 4)]  # subnormal scales and the largest
    return raw.reshape(-1)


def gguf_ref(t: int, raw: np.ndarray, n: int) -> np.ndarray:
    be, bb = GEOMETRY[t]
    data = raw[: n // be * bb]
    if be > 1:
        data = data.reshape(-1, bb)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(gguf_dequantize(data, Q(t)), dtype=np.float32).reshape(-1)


# --- dequantizers ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_dequantize_bit_identical_to_gguf(t: int, path: str) -> None:
    rng = np.random.default_rng(1000 + t)
    be, _ = GEOMETRY[t]
    n = be * (97 if be > 1 else 4099)  # odd counts: SIMD bodies and scalar tails both run
    raw = random_raw(t, n, rng)
    ref = gguf_ref(t, raw, n)
    got = T.dequantize(t, raw, n, path)
    assert not np.isnan(ref).any()
    mismatch = np.nonzero(got.view(np.uint32) != ref.view(np.uint32))[0]
    assert mismatch.size == 0, (
        f"{NAMES[t]}/{path}: {mismatch.size} elements differ, first at {mismatch[0]}: "
        f"{got[mismatch[0]]!r} vs gguf {ref[mismatch[0]]!r}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", [1, 30], ids=["F16", "BF16"])
def test_every_16_bit_pattern_converts_as_numpy_does(t: int, path: str) -> None:
    # All 65536 patterns: zeros, subnormals, normals, infinities. NaNs must stay NaN (F16C
    # quiets signalling NaNs where numpy keeps the payload; weights never hold NaNs).
    h = np.arange(1 << 16, dtype=np.uint16)
    ref = gguf_ref(t, h.view(np.uint8), h.size)
    got = T.dequantize(t, h.view(np.uint8), h.size, path)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


def test_dequantize_rejects_partial_blocks_and_non_weight_types() -> None:
    raw = np.zeros(34 * 2, dtype=np.uint8)
    with pytest.raises(ValueError, match="whole number"):
        T.dequantize(8, raw, 40)
    with pytest.raises(ValueError, match="not a weight type"):
        T.dequantize(26, raw, 4)
    with pytest.raises(ValueError, match="shorter"):
        T.dequantize(8, raw, 96)


# --- matmul ------------------------------------------------------------------------------------


def _shape(t: int) -> tuple[int, int]:
    # Row widths that are not a multiple of the 256-element decode group (and, for the float
    # types, not of the 8-wide vectors either) exercise every tail.
    return {1: 621, 32: 608, 256: 768}[GEOMETRY[t][0]], 29


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_matmul_matches_numpy(t: int, path: str) -> None:
    rng = np.random.default_rng(2000 + t)
    ne0, ne1 = _shape(t)
    raw = random_raw(t, ne0 * ne1, rng, tame=True)
    w = gguf_ref(t, raw, ne0 * ne1).reshape(ne1, ne0).astype(np.float64)
    x = rng.standard_normal((5, ne0)).astype(np.float32)
    y = T.matmul(t, raw, ne0, ne1, x, 2, path)
    ref = x.astype(np.float64) @ w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T  # the dot products' condition
    assert y.shape == (5, ne1) and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= 1e-5 * scale), f"worst {np.max(np.abs(y - ref) / scale):.3g}"


WIDTHS = list(range(1, 17)) + [17, 33]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_matmul_columns_bit_identical_to_single_column(t: int, path: str) -> None:
    rng = np.random.default_rng(3000 + t)
    ne0, ne1 = _shape(t)
    raw = random_raw(t, ne0 * ne1, rng, tame=True)
    x = rng.standard_normal((max(WIDTHS), ne0)).astype(np.float32)
    single = np.stack([T.matmul(t, raw, ne0, ne1, x[c : c + 1], 1, path)[0] for c in range(max(WIDTHS))])
    for width in WIDTHS:
        # Different column subsets land each column on different positions of the 3/2/1 tiles.
        start = (width * 7) % (max(WIDTHS) - width + 1)
        y = T.matmul(t, raw, ne0, ne1, x[start : start + width], 1, path)
        assert np.array_equal(y.view(np.uint32), single[start : start + width].view(np.uint32)), (
            f"{NAMES[t]}/{path}: width {width} differs from single-column results")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_matmul_identical_across_thread_counts(t: int, path: str) -> None:
    rng = np.random.default_rng(4000 + t)
    for trial in range(3):
        be, _ = GEOMETRY[t]
        ne0 = int(rng.integers(1, 5)) * 256 + (int(rng.integers(0, 8)) * 32 if be != 256 else 0)
        ne0 += int(rng.integers(1, 31)) if be == 1 else 0
        ne1 = int(rng.integers(1, 80))
        ncols = int(rng.integers(1, 18))
        raw = random_raw(t, ne0 * ne1, rng, tame=True)
        x = rng.standard_normal((ncols, ne0)).astype(np.float32)
        y1 = T.matmul(t, raw, ne0, ne1, x, 1, path)
        for threads in (2, 3):
            y = T.matmul(t, raw, ne0, ne1, x, threads, path)
            assert np.array_equal(y.view(np.uint32), y1.view(np.uint32)), (
                f"{NAMES[t]}/{path} trial {trial}: {threads} threads differ from 1")


def test_matmul_rejects_bad_shapes() -> None:
    raw = np.zeros(34 * 4, dtype=np.uint8)
    with pytest.raises(ValueError):
        T.matmul(8, raw, 48, 2, np.zeros((1, 48), np.float32))  # not whole Q8_0 blocks
    with pytest.raises(ValueError):
        T.matmul(8, raw, 64, 2, np.zeros((1, 32), np.float32))  # X width mismatch
    with pytest.raises(ValueError):
        T.matmul(8, raw, 64, 3, np.zeros((1, 64), np.float32))  # data too short
    with pytest.raises(ValueError):
        T.matmul(8, raw, 64, 2, np.zeros((1, 64), np.float32), 1, "sse9")


# --- SIMD path choice --------------------------------------------------------------------------


def test_simd_path_is_fixed_per_process_and_default_is_the_best_supported() -> None:
    assert native.simd_path() in ("scalar", "avx2")
    if os.environ.get("DS4_SIMD", "auto") in ("auto", ""):
        assert native.simd_path() == ("avx2" if T.path_supported("avx2") else "scalar")


def test_ds4_simd_scalar_forces_the_scalar_path_for_the_whole_process() -> None:
    code = (
        "import numpy as np, ds4_app.engine._native as n\n"
        "T = n._testing\n"
        "rng = np.random.default_rng(5)\n"
        "raw = rng.standard_normal(64 * 300).astype(np.float16).view(np.uint8)\n"
        "x = rng.standard_normal((3, 300)).astype(np.float32)\n"
        "same = np.array_equal(T.matmul(1, raw, 300, 64, x, 2), T.matmul_scalar(1, raw, 300, 64, x, 2))\n"
        "print(n.simd_path(), same)\n"
    )
    env = dict(os.environ, DS4_SIMD="scalar")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["scalar", "True"]


@pytest.mark.skipif("avx2" not in PATHS, reason="no AVX2 on this CPU")
def test_avx2_and_scalar_paths_are_distinct_computations() -> None:
    # FMA rounds once where the scalar path rounds twice: over many rows some result must differ.
    # (If they never differed, the "avx2" path would not be running its own kernel.)
    rng = np.random.default_rng(6)
    ne0, ne1 = 1000, 64
    raw = rng.standard_normal(ne0 * ne1).astype(np.float32).view(np.uint8)
    x = rng.standard_normal((2, ne0)).astype(np.float32)
    assert not np.array_equal(T.matmul(0, raw, ne0, ne1, x, 1, "avx2"), T.matmul_scalar(0, raw, ne0, ne1, x, 1))


def _cpu_has_avx512() -> bool:
    """AVX-512 F/BW/VL/DQ per /proc/cpuinfo: where the avx2 path runs its 512-bit matmul kernels."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags)


_AVX512_CASES = """
import hashlib, sys
import numpy as np
sys.path.insert(0, "tests")
import test_native_kernels as tk
T = tk.T
for t in tk.TYPES:
    for width in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17):
        rng = np.random.default_rng(7000 + 31 * t + width)
        ne0 = {1: 640, 32: 608, 256: 768}[tk.GEOMETRY[t][0]]  # whole 32s: the fused kernels
        ne1 = 37
        raw = tk.random_raw(t, ne0 * ne1, rng, tame=True)
        x = rng.standard_normal((width, ne0)).astype(np.float32)
        for threads in (1, 2):
            y = T.matmul(t, raw, ne0, ne1, x, threads, "avx2")
            print(t, width, threads, hashlib.sha256(y.tobytes()).hexdigest()[:16])
"""


@pytest.mark.skipif("avx2" not in PATHS or not _cpu_has_avx512(), reason="no AVX-512 on this CPU")
def test_avx512_matmul_kernels_are_bit_identical_to_the_256_bit_ones() -> None:
    # The avx2 path runs 512-bit twins of its fused kernels where the CPU has AVX-512 (the same
    # lanes, order and reduction); DS4_AVX512=0 keeps the 256-bit ones. Every type, 1-17 columns
    # (the twins tile up to 8, the 256-bit kernels 3 or 6), 1 and 2 threads: the same bits.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for env in (dict(os.environ, DS4_AVX512="0"), {k: v for k, v in os.environ.items() if k != "DS4_AVX512"}):
        out = subprocess.run([sys.executable, "-c", _AVX512_CASES], env=env, cwd=root, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.splitlines())
    assert len(runs[0]) == len(TYPES) * 11 * 2
    assert runs[0] == runs[1], next(f"{a} != {b}" for a, b in zip(*runs) if a != b)


_AVX512_ENGINE = """
import hashlib, sys
import numpy as np
from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine.plan import StepPlan
from ds4_app.engine.synth import synthesize
import ds4_app.engine._native as native
path = sys.argv[1]
mf = ModelFile.open(path)
tensors = [(t.name, t.ggml_type, t.ne, t.offset) for t in mf.tensors.values()]
h = hashlib.sha256()
rng = np.random.default_rng(0)
for lanes, threads in ((1, 2), (3, 2)):  # 1 lane: heads split between threads; 3: slots in parallel
    eng = native.Engine(mf.config, path, tensors, max_slots=3, max_ctx=256, n_pages=6, max_rows=16,
                        n_threads=threads)
    tables = {s: [2 * s, 2 * s + 1] for s in range(lanes)}
    for t in range(140):
        plan = [(s, int(rng.integers(0, mf.config.n_vocab)), t, True) for s in range(lanes)]
        h.update(eng.step(StepPlan.build(plan, tables, 2)).tobytes())
print(h.hexdigest())
"""


@pytest.mark.skipif("avx2" not in PATHS or not _cpu_has_avx512(), reason="no AVX-512 on this CPU")
def test_avx512_engine_steps_are_bit_identical_to_the_256_bit_ones(tmp_path) -> None:
    # The engine with every AVX-512 twin (matmul, attention) against DS4_AVX512=0: 140 steps of
    # 1 and 3 lanes, past the CSA/HCA emissions and the indexer's choice, logits bit for bit.
    from ds4_app.engine.synth import synthesize

    path = tmp_path / "tiny.gguf"
    synthesize("tiny", path, seed=2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digests = []
    for env in (dict(os.environ, DS4_AVX512="0"), {k: v for k, v in os.environ.items() if k != "DS4_AVX512"}):
        out = subprocess.run([sys.executable, "-c", _AVX512_ENGINE, str(path)], env=env, cwd=root,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        digests.append(out.stdout.strip())
    assert len(digests[0]) == 64 and digests[0] == digests[1]


# --- thread pool -------------------------------------------------------------------------------


@pytest.mark.parametrize("threads,n,grain", [(2, 100, 1), (3, 10, 1), (4, 7, 1), (2, 100, 60), (3, 1, 1),
                                             (2, 5, 100), (4, 1000, 3)])
def test_parallel_for_static_contiguous_chunks(threads: int, n: int, grain: int) -> None:
    chunks = T.pool_chunks(threads, n, grain)
    k = min(threads, -(-n // grain))
    expected = [(i * n // k, (i + 1) * n // k) for i in range(k)]
    assert chunks == [c for c in expected if c[0] < c[1]]


def test_physical_cores_is_positive_and_bounded_by_the_cpu_count() -> None:
    cores = native.physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)


@pytest.mark.parametrize("bad", [0, 5, 9])
def test_parallel_for_rethrows_a_chunk_error_and_the_pool_stays_usable(bad: int) -> None:
    # The C++ exception arrives as RuntimeError (except +) after a second job ran every index.
    with pytest.raises(RuntimeError, match="rethrown after a second job covered 10"):
        T.pool_throw(3, 10, bad)


@pytest.mark.parametrize("k", [1, 7, 8, 16, 17, 64])
def test_indexer_topk_picks_the_best_by_score_then_index(k) -> None:
    """Both ways of ds4::indexer_topk (one pass for k <= 16, nth_element above) pick the k best
    entries by (score descending, index ascending), with many ties, returned ascending."""
    rng = np.random.default_rng(k)
    for n in (k, k + 1, 150, 301):
        for scores in (rng.integers(0, 5, n).astype(np.float32), rng.standard_normal(n).astype(np.float32),
                       np.arange(n, dtype=np.float32), -np.arange(n, dtype=np.float32), np.zeros(n, np.float32)):
            want = np.sort(np.lexsort((np.arange(n), -scores))[:k])
            assert np.array_equal(native._testing.indexer_topk(scores, k), want), (n, k)
