"""The native CPU engine's exactness invariants, plan checks and model-file errors.

Parity with the numpy reference lives in tests/test_native_parity.py (teacher-forced at every
step). Here, exactness needs no tolerance: a sequence's logits are bit-identical alone, beside up
to five others, with its prompt in 1, 4 or 16 rows per step, on 1 or 2 threads, in any slot and on
any pages, and in a slot reused after reset_slot. The QAT round trips and RoPE are checked bit for
bit against the reference's functions.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine.memory import plan_memory
from ds4_app.engine.plan import StepPlan
from ds4_app.engine.synth import synthesize
from tests.engine_cases import MAX_CTX, PAGES_PER_SEQ, Seq, prompt, round_trip_samples, run, tensor_entries

native = pytest.importorskip("ds4_app.engine._native")

ROOT = Path(__file__).resolve().parents[1]


def make_engine(mf: ModelFile, *, max_slots: int = 6, n_pages: int | None = None, max_rows: int = 16,
                n_threads: int = 2, tensors=None, path=None):
    if n_pages is None:
        n_pages = plan_memory(mf.config, max_slots=max_slots, max_ctx=MAX_CTX).n_pages
    return native.Engine(mf.config, str(path or mf.path), tensors or tensor_entries(mf), max_slots=max_slots,
                         max_ctx=MAX_CTX, n_pages=n_pages, max_rows=max_rows, n_threads=n_threads)


_models: dict[tuple[int, bool], ModelFile] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("native_engine")


def tiny_model(model_dir: Path, seed: int, qat: bool = False) -> ModelFile:
    key = (seed, qat)
    if key not in _models:
        path = model_dir / f"tiny-{seed}-{int(qat)}.gguf"
        synthesize("tiny", path, seed=seed, qat_numerics=qat)
        mf = ModelFile.open(path)
        try:
            make_engine(mf, max_slots=1, max_rows=1, n_threads=1)
        except RuntimeError as e:
            if "no engine" in str(e):
                pytest.skip("this _native build has no engine")
            raise
        _models[key] = mf
    return _models[key]


# --- exactness invariants -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def invariance_case(model_dir: Path):
    mf = tiny_model(model_dir, 5)
    target = prompt(mf, 50, 200)
    baseline = run(make_engine(mf, n_threads=1), [Seq(target, slot=0, pages=[0, 1])])[0]
    return mf, target, baseline


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_batch_invariance(invariance_case, data) -> None:
    mf, target, baseline = invariance_case
    n_other = data.draw(st.integers(0, 5), label="neighbours")
    slots = data.draw(st.permutations(range(6)), label="slots")
    pages = data.draw(st.permutations(range(6 * PAGES_PER_SEQ)), label="pages")
    seqs = [Seq(target, slot=slots[0], pages=list(pages[:2]), rows=data.draw(st.sampled_from([1, 4, 16])),
                start=data.draw(st.integers(0, 10)))]
    for i in range(1, n_other + 1):
        length = data.draw(st.integers(1, 160), label=f"len{i}")
        seqs.append(Seq(prompt(mf, 1000 + i, length), slot=slots[i],
                        pages=list(pages[2 * i:2 * i + 2]), rows=data.draw(st.sampled_from([1, 4]), label=f"rows{i}"),
                        start=data.draw(st.integers(0, 20), label=f"start{i}")))
    got = run(make_engine(mf, n_threads=2, max_rows=40), seqs)[0]  # up to 16 + 5 * 4 rows a step
    assert np.array_equal(got, baseline)


def test_slot_reuse_matches_a_fresh_engine(invariance_case) -> None:
    mf, target, baseline = invariance_case
    eng = make_engine(mf, max_slots=2)
    run(eng, [Seq(prompt(mf, 7, 170), slot=0, pages=[0, 1]), Seq(prompt(mf, 8, 60), slot=1, pages=[2])])
    eng.reset_slot(0)
    # the new sequence gets the old one's slot and pages (in another order) plus a page the other slot used
    got = run(eng, [Seq(target, slot=0, pages=[1, 2], rows=4)])[0]
    assert np.array_equal(got, baseline)


def test_bad_plan_is_refused_before_any_state_changes(invariance_case) -> None:
    mf, target, baseline = invariance_case
    eng = make_engine(mf, max_slots=2)
    first = run(eng, [Seq(target[:131], slot=0, pages=[0, 1], rows=16)])[0]
    # position 131 closes the CSA block 128..131, which lives on logical page 1
    bad = StepPlan.build([(0, int(target[131]), 131, True)], {0: [0]}, PAGES_PER_SEQ)
    with pytest.raises(ValueError, match="unassigned"):
        eng.step(bad)
    shared = StepPlan.build([(0, int(target[131]), 131, True), (1, 5, 0, True)], {0: [0, 1], 1: [1]}, PAGES_PER_SEQ)
    with pytest.raises(ValueError, match="twice"):
        eng.step(shared)
    tail = []
    for k in range(131, len(target)):
        tail.append(eng.step(StepPlan.build([(0, int(target[k]), k, True)], {0: [0, 1]}, PAGES_PER_SEQ))[0])
    assert np.array_equal(np.concatenate([first, np.stack(tail)]), baseline)


# --- model file checks ----------------------------------------------------------------------------

def test_bad_weights_are_one_line_errors(model_dir: Path, tmp_path: Path) -> None:
    mf = tiny_model(model_dir, 5)
    tensors = tensor_entries(mf)
    with pytest.raises(RuntimeError, match="missing tensor blk.2.attn_kv.weight"):
        make_engine(mf, tensors=[t for t in tensors if t[0] != "blk.2.attn_kv.weight"])
    wrong = [(n, ty, (ne[0], ne[1] + 1) if n == "blk.1.attn_q_a.weight" else ne, off) for n, ty, ne, off in tensors]
    with pytest.raises(RuntimeError, match="blk.1.attn_q_a.weight has shape"):
        make_engine(mf, tensors=wrong)
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(mf.path, cut)
    with open(cut, "r+b") as f:
        f.truncate(mf.file_size - 1000)
    with pytest.raises(RuntimeError, match="truncated at tensor"):
        make_engine(mf, path=cut)


# --- the QAT round trips and small ops, bit for bit ---------------------------------------------

_DRIVER = r"""
#include "ops.h"
extern "C" {
void t_fp8(float* x, long n) { ds4::fp8_round_trip(x, n); }
void t_fp4(float* x, long n) { ds4::fp4_round_trip(x, n); }
void t_had(float* x, long n) { ds4::hadamard(x, n); }
void t_f16(float* x, long n) { ds4::round_f16(x, n); }
void t_f16_row(const float* x, unsigned short* y, long n) { ds4::f32_to_f16_row(x, y, n); }
void t_f16_each(const float* x, unsigned short* y, long n) { for (long i = 0; i < n; ++i) y[i] = ds4::f32_to_f16(x[i]); }
void t_rope(float* x, long n, const double* inv, int half, long pos, int inverse) {
  ds4::RopeTable r;
  r.init(inv, half, pos);
  for (long i = 0; i < n; i += 2 * half) r.apply(x + i, inverse != 0);
}
}
"""


@pytest.fixture(scope="module")
def ops_lib(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is needed to build the ops driver")
    d = tmp_path_factory.mktemp("ops")
    (d / "driver.cpp").write_text(_DRIVER)
    lib = d / "libops.so"
    subprocess.run([gxx, "-std=c++17", "-O2", "-ffp-contract=off", "-shared", "-fPIC",
                    f"-I{ROOT / 'ext/engine'}", f"-I{ROOT / 'ext/include'}", str(d / "driver.cpp"),
                    str(ROOT / "ext/engine/ops.cpp"), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def _call(lib, fn: str, x: np.ndarray, *extra) -> np.ndarray:
    y = np.ascontiguousarray(x, dtype=np.float32).copy()
    getattr(lib, fn)(y.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), ctypes.c_long(y.size), *extra)
    return y


def test_qat_round_trips_match_the_reference_bit_for_bit(ops_lib) -> None:
    from ds4_app.engine.reference import numerics as N

    for x in round_trip_samples(64, 0):
        assert np.array_equal(_call(ops_lib, "t_fp8", x), N.fp8_e4m3_roundtrip(x, 64))
        assert np.array_equal(_call(ops_lib, "t_f16", x), N.round_f16(x))
    for x in round_trip_samples(32, 0):
        assert np.array_equal(_call(ops_lib, "t_fp4", x), N.fp4_roundtrip(x, 32))
    for x in round_trip_samples(128, 0):
        rows = x.reshape(-1, 128)
        got = np.stack([_call(ops_lib, "t_had", r) for r in rows])
        assert np.array_equal(got, N.hadamard(rows))


def test_f16_rows_match_one_value_at_a_time(ops_lib) -> None:
    """f32_to_f16_row (vcvtps2ph where the CPU has F16C) gives f32_to_f16's bits for every float:
    ties, subnormals, the overflow edge, infinities and NaNs (which only the scalar way quiets
    with one bit), in groups of 8 and in the tail."""
    edges = np.array([0.0, -0.0, 65504.0, 65519.996, 65520.0, -65520.0, 2.0 ** -24, 2.0 ** -25,
                      1.5 * 2.0 ** -25, 2.0 ** -14, 2.0 ** -14 - 2.0 ** -25, np.inf, -np.inf, 1e-30], np.float32)
    nan_bits = np.array([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FA00000], np.uint32).view(np.float32)
    rng = np.random.default_rng(2)
    ties = (np.arange(1024, 2048, dtype=np.float32) + 0.5) * np.float32(2.0 ** -10)  # halfway between halves
    x = np.concatenate([edges, nan_bits, ties, rng.standard_normal(997).astype(np.float32) * 1e3,
                        rng.standard_normal(301).astype(np.float32) * 1e-6])
    for lo in (0, 3):  # groups of 8 starting at a NaN and away from it, and odd tails
        xs = np.ascontiguousarray(x[lo:])
        got, want = (np.zeros(xs.size, np.uint16) for _ in range(2))
        for fn, out in (("t_f16_row", got), ("t_f16_each", want)):
            getattr(ops_lib, fn)(xs.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(xs.size))
        assert np.array_equal(got, want)
        finite = np.isfinite(xs) | np.isinf(xs)
        assert np.array_equal(got[finite], xs[finite].astype(np.float16).view(np.uint16))


def test_rope_matches_the_reference_bit_for_bit(ops_lib) -> None:
    from ds4_app.engine.presets import tiny
    from ds4_app.engine.reference import rope_rotate

    cfg = tiny()
    x = np.random.default_rng(1).standard_normal((5, cfg.rope_dim)).astype(np.float32)
    for layer in range(cfg.n_layer):
        inv = np.asarray(cfg.rope(layer).inv_freqs(cfg.rope_dim), dtype=np.float64)
        ptr = inv.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
        for pos in (0, 1, 127, 4095, 1048575):
            for inverse in (False, True):
                got = _call(ops_lib, "t_rope", x, ptr, ctypes.c_int(inv.size), ctypes.c_long(pos), ctypes.c_int(inverse))
                assert np.array_equal(got, rope_rotate(x, pos, inv, inverse=inverse))
