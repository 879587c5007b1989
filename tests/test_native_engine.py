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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine.memory import plan_memory
from ds4_app.engine.plan import StepPlan
from ds4_app.engine.synth import synthesize

native = pytest.importorskip("ds4_app.engine._native")

ROOT = Path(__file__).resolve().parents[1]
MAX_CTX = 512
PAGES_PER_SEQ = MAX_CTX // 128


def _tensors(mf: ModelFile) -> list[tuple[str, int, tuple[int, ...], int]]:
    return [(t.name, t.ggml_type, t.ne, t.offset) for t in mf.tensors.values()]


def make_engine(mf: ModelFile, *, max_slots: int = 6, n_pages: int | None = None, max_rows: int = 16,
                n_threads: int = 2, tensors=None, path=None):
    if n_pages is None:
        n_pages = plan_memory(mf.config, max_slots=max_slots, max_ctx=MAX_CTX).n_pages
    return native.Engine(mf.config, str(path or mf.path), tensors or _tensors(mf), max_slots=max_slots,
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


@dataclass
class Seq:
    """A sequence fed to the engine: its tokens, slot, pages, rows per step and start step."""

    tokens: np.ndarray
    slot: int
    pages: list[int]
    rows: int = 1
    start: int = 0


def run(eng, seqs: list[Seq]) -> list[np.ndarray]:
    """Feed every sequence (all lanes want logits) until done; logits [len, n_vocab] per sequence."""
    out = [np.empty((len(s.tokens), eng.n_vocab), np.float32) for s in seqs]
    pos = [0] * len(seqs)
    step = 0
    while any(p < len(s.tokens) for p, s in zip(pos, seqs)):
        lanes, owner = [], []
        for i, s in enumerate(seqs):
            if step < s.start:
                continue
            for k in range(pos[i], min(len(s.tokens), pos[i] + s.rows)):
                lanes.append((s.slot, int(s.tokens[k]), k, True))
                owner.append((i, k))
        step += 1
        if not lanes:
            continue
        tables = {s.slot: s.pages for i, s in enumerate(seqs) if any(o[0] == i for o in owner)}
        logits = eng.step(StepPlan.build(lanes, tables, PAGES_PER_SEQ))
        for row, (i, k) in enumerate(owner):
            out[i][k] = logits[row]
            pos[i] = k + 1
    return out


def prompt(mf: ModelFile, seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, mf.config.n_vocab, n)


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
    tensors = _tensors(mf)
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


def _samples(block: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = [(rng.standard_normal(block * 64) * s).astype(np.float32) for s in (1e-30, 1e-6, 1e-2, 1.0, 300.0, 1e5)]
    # exact ties of the FP4 grid and halfway f16 values, zeros, a lone outlier per block
    ties = np.tile(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0, 0.0, -0.0], np.float32), block)
    out.append(ties[: (ties.size // block) * block])
    spiky = np.zeros(block * 4, np.float32)
    spiky[::block] = 1000.0
    spiky[1::block] = 1e-3
    out.append(spiky)
    halfway = (np.arange(1, block * 4 + 1, dtype=np.float32) + 0.5) * np.float32(2.0 ** -10)
    out.append(halfway.astype(np.float32))
    return out


def test_qat_round_trips_match_the_reference_bit_for_bit(ops_lib) -> None:
    from ds4_app.engine.reference import numerics as N

    for x in _samples(64):
        assert np.array_equal(_call(ops_lib, "t_fp8", x), N.fp8_e4m3_roundtrip(x, 64))
        assert np.array_equal(_call(ops_lib, "t_f16", x), N.round_f16(x))
    for x in _samples(32):
        assert np.array_equal(_call(ops_lib, "t_fp4", x), N.fp4_roundtrip(x, 32))
    for x in _samples(128):
        rows = x.reshape(-1, 128)
        got = np.stack([_call(ops_lib, "t_had", r) for r in rows])
        assert np.array_equal(got, N.hadamard(rows))


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
