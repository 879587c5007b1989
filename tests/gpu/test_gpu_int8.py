"""The integer Q8_0 and Q4_K products (ext/gpu/xplanes.cuh) against float64, the fp32 path and themselves.

Marked ``gpu`` (conftest skips them without a CUDA/HIP build and a device). Hook (``_testing``):
``gpu_set_matvec_int8(on) -> bool``, process-wide (DS4_GPU_MV_INT8=0 turns the switch off; it is
on by default). With it on, a Q8_0 product turns each 32-element unit of X into three planes of
signed bytes (x = 2^(E-22) * (p0 + 2^8 p1 + 2^16 p2) to 2^-23 of the unit's largest |x|) and sums
q * p in integers (a Q4_K product the same per half sub-block, with the half's sum of m for the
min term); with it off, every weight is decoded to fp32 and multiplied in.

The rest of the GPU suite runs with the switch at its default (on): the width, staged, tall,
chunked, batched and grouped bit-identities of test_gpu_kernels.py hold for the integer path there;
here they are checked again with the switch off, so both arithmetics keep them.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.test_gpu_kernels import GEOMETRY, scale_of, tame_raw

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing
pytestmark = pytest.mark.gpu

Q8_0, Q4_K = 8, 12


@pytest.fixture
def int8_switch():
    """Set the switch inside a test; back to the default (on) after it."""
    yield T.gpu_set_matvec_int8
    T.gpu_set_matvec_int8(True)


def exact(raw: np.ndarray, ne0: int, ne1: int, x: np.ndarray, t: int = Q8_0) -> np.ndarray:
    """The products in float64 from the CPU dequantizer's weights (the exact weight values)."""
    w = T.dequantize(t, raw, ne0 * ne1).reshape(ne1, ne0).astype(np.float64)
    return x.astype(np.float64) @ w.T


def test_int8_switch_reads_back(int8_switch) -> None:
    assert int8_switch(False) is False
    assert int8_switch(True) is True


@pytest.mark.parametrize("t", [Q8_0, Q4_K], ids=["Q8_0", "Q4_K"])
@pytest.mark.parametrize("ne0, ne1", [(4096, 300), (1024, 2100), (8192, 64)])
def test_int8_error_is_the_size_of_fp32_rounding(int8_switch, t: int, ne0: int, ne1: int) -> None:
    """Both paths within 2^-18 of sum |w x| of the float64 products, and the integer path's largest
    error no more than four times the fp32 path's (it rounds the activations to 2^-23 of each unit's
    largest and then 3 times a unit, where fp32 rounds 32 times a unit; Q4_K's min term is a
    separate product, rounded once more)."""
    rng = np.random.default_rng()
    raw = tame_raw(t, ne0 * ne1, rng)
    x = rng.standard_normal((5, ne0)).astype(np.float32)
    x[1] *= 1e-20  # far below 1 and far above it: the unit scale follows the data
    x[2] *= 1e20
    x[3, : ne0 // 2] *= 1e-6  # one unit's worth of very different magnitudes in a column
    want = exact(raw, ne0, ne1, x, t)
    bound = scale_of(t, raw, ne0, ne1, x)
    int8_switch(True)
    got_i = T.gpu_matmul(t, raw, ne0, ne1, x).astype(np.float64)
    int8_switch(False)
    got_f = T.gpu_matmul(t, raw, ne0, ne1, x).astype(np.float64)
    err_i, err_f = np.abs(got_i - want) / bound, np.abs(got_f - want) / bound
    assert err_i.max() <= 2.0**-18, err_i.max()
    assert err_f.max() <= 2.0**-18, err_f.max()
    assert err_i.max() <= 4 * err_f.max() + 2.0**-30, (err_i.max(), err_f.max())
    assert not np.array_equal(got_i, got_f)  # the switch does change the arithmetic


def test_int8_zero_tiny_and_nonfinite_units(int8_switch) -> None:
    """A zero column gives zeros; subnormal and near-overflow columns stay within the bound; an inf
    or NaN in a unit makes the rows NaN (as fp32 arithmetic would), and no other column is touched."""
    rng = np.random.default_rng()
    ne0, ne1 = 1024, 96
    raw = tame_raw(Q8_0, ne0 * ne1, rng)
    x = rng.standard_normal((5, ne0)).astype(np.float32)
    x[0] = 0.0
    x[1] *= np.float32(1e-42)  # subnormals
    x[2] = x[2] / np.abs(x[2]).max() * np.float32(3e34)  # sums stay below the float range (|d q| <= 2.6)
    x[3, 100] = np.inf
    x[4, 700] = np.nan
    int8_switch(True)
    y = T.gpu_matmul(Q8_0, raw, ne0, ne1, x)
    assert (y[0] == 0).all()
    want = exact(raw, ne0, ne1, x[1:3])
    bound = scale_of(Q8_0, raw, ne0, ne1, x[1:3])
    # Units whose largest |x| is below 2^-100 are resolved to 2^-123 absolute (the unit scale is
    # clamped at 2^-122; xplanes.cuh): far below anything a model produces, and below what fp32
    # resolves relative to any O(1) activation beside them.
    w_abs = np.abs(T.dequantize(Q8_0, raw, ne0 * ne1).reshape(ne1, ne0).astype(np.float64)).sum(axis=1)
    assert (np.abs(y[1].astype(np.float64) - want[0]) <= 2.0**-20 * bound[0] + 2.0**-122 * w_abs).all()
    assert (np.abs(y[2].astype(np.float64) - want[1]) <= 2.0**-20 * bound[1]).all()
    assert np.isnan(y[3]).all() and np.isnan(y[4]).all()


@pytest.mark.parametrize("on", [False, True], ids=["fp32", "int8"])
def test_both_paths_keep_q8_width_staged_tall_and_grouped_identities(int8_switch, on: bool) -> None:
    """Under either setting: columns of 1..16-wide launches equal single columns (direct, staged and
    tall kernels), batched members equal their own launches, grouped pairs equal their dense
    products (the grouped Q8_0 kernel builds the planes lane by lane: the same bytes)."""
    int8_switch(on)
    rng = np.random.default_rng()
    ne0, ne1 = 2048, 17000  # tall from 16384 rows, staged from 512
    raw = tame_raw(Q8_0, ne0 * ne1, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)
    single = np.concatenate([T.gpu_matmul(Q8_0, raw, ne0, ne1, x[c : c + 1]) for c in range(16)])
    for width in (2, 5, 16):
        for kw in (dict(staged=False), dict(staged=True), dict(staged=False, tall=True)):
            y = T.gpu_matmul(Q8_0, raw, ne0, ne1, x[:width], **kw)
            assert np.array_equal(y.view(np.uint32), single[:width].view(np.uint32)), (on, width, kw)

    rows, n_batch = 512, 4
    member_bytes = ne0 // 32 * 34 * rows
    xb = rng.standard_normal((3, n_batch * ne0)).astype(np.float32)
    got = T.gpu_matmul_batched(Q8_0, raw[: n_batch * member_bytes], ne0, rows * n_batch, n_batch, xb)
    for i in range(n_batch):
        own = T.gpu_matmul(Q8_0, raw[i * member_bytes : (i + 1) * member_bytes], ne0, rows, xb[:, i * ne0 : (i + 1) * ne0])
        assert np.array_equal(got[:, i * rows : (i + 1) * rows].view(np.uint32), own.view(np.uint32)), (on, i)

    n_expert, n_lanes, ge1 = 4, 5, 200
    expert_bytes = ne0 // GEOMETRY[Q8_0][0] * GEOMETRY[Q8_0][1] * ge1
    pair_expert = rng.integers(0, n_expert, n_lanes * 3).astype(np.int32)
    x_row = np.repeat(np.arange(n_lanes, dtype=np.int32), 3)
    y = T.gpu_matmul_grouped(Q8_0, raw[: n_expert * expert_bytes], ne0, ge1, n_expert, x[:n_lanes], pair_expert, x_row, 8)
    for p, (e, r) in enumerate(zip(pair_expert, x_row)):
        one = T.gpu_matmul(Q8_0, raw[e * expert_bytes : (e + 1) * expert_bytes], ne0, ge1, x[r : r + 1])[0]
        assert np.array_equal(one.view(np.uint32), y[p].view(np.uint32)), (on, p)


def test_multi_product_launch_equals_its_products(int8_switch) -> None:
    """matvec_multi makes one set of planes for all its Q8_0 products (beside an F16 one): each output
    equals its own matvec, fused and with fusion off."""
    rng = np.random.default_rng()
    ne0 = 1024
    shapes = [(Q8_0, 640), (1, 256), (Q8_0, 96)]
    raws = [tame_raw(t, ne0 * r, rng) for t, r in shapes]
    x = rng.standard_normal((3, ne0)).astype(np.float32)
    for on in (True, False):
        int8_switch(on)
        want = [T.gpu_matmul(t, raw, ne0, r, x) for (t, r), raw in zip(shapes, raws)]
        for fuse in (True, False):
            T.gpu_set_matvec_fuse(fuse)
            got, _ = T.gpu_matmul_multi([(t, raw, r) for (t, r), raw in zip(shapes, raws)], ne0, x, staged=False)
            for g, w in zip(got, want):
                assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (on, fuse)
        T.gpu_set_matvec_fuse(True)


@pytest.mark.parametrize("ne0", [2048, 2304], ids=["K2048", "K2304"])
@pytest.mark.parametrize("on", [False, True], ids=["fp32", "int8"])
def test_both_paths_keep_q4k_identities(int8_switch, on: bool, ne0: int) -> None:
    """Q4_K under either setting: columns of wide launches equal single columns (direct and staged),
    grouped pairs through the own kernel (planes made once for X's rows) and through the pass-5
    kernel (planes built lane by lane) equal their dense products, and the fused gate/up pair equals
    the two grouped products. K = 2304 (72 units) ends each row in a pass of 8 units, where the
    integer path's lane pairs swap their halves with the rest of the warp idle."""
    int8_switch(on)
    rng = np.random.default_rng()
    ne1, n_expert, n_lanes = 600, 4, 6
    raw = tame_raw(Q4_K, ne0 * ne1 * n_expert, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)
    expert_bytes = ne0 // 256 * 144 * ne1
    w0 = raw[:expert_bytes]
    single = np.concatenate([T.gpu_matmul(Q4_K, w0, ne0, ne1, x[c : c + 1]) for c in range(16)])
    for width in (3, 16):
        for staged in (False, True):
            y = T.gpu_matmul(Q4_K, w0, ne0, ne1, x[:width], staged=staged)
            assert np.array_equal(y.view(np.uint32), single[:width].view(np.uint32)), (on, width, staged)
    pair_expert = rng.integers(0, n_expert, n_lanes * 3).astype(np.int32)
    x_row = np.repeat(np.arange(n_lanes, dtype=np.int32), 3)
    want = np.stack([T.gpu_matmul(Q4_K, raw[e * expert_bytes : (e + 1) * expert_bytes], ne0, ne1, x[r : r + 1])[0]
                     for e, r in zip(pair_expert, x_row)])
    for variant in (1, 0):  # the own kernel, pass 5
        T.gpu_set_matvec_grouped(variant)
        y = T.gpu_matmul_grouped(Q4_K, raw, ne0, ne1, n_expert, x[:n_lanes], pair_expert, x_row, 8)
        assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), (on, variant)
    T.gpu_set_matvec_grouped(1)
    raw_up = tame_raw(Q4_K, ne0 * ne1 * n_expert, rng)
    g, u, fused = T.gpu_matmul_grouped_pair(Q4_K, raw, raw_up, ne0, ne1, n_expert, x[:n_lanes], pair_expert, x_row, 8, 4)
    assert fused
    assert np.array_equal(g.view(np.uint32), want.view(np.uint32)), on
    u_want = T.gpu_matmul_grouped(Q4_K, raw_up, ne0, ne1, n_expert, x[:n_lanes], pair_expert, x_row, 8)
    assert np.array_equal(u.view(np.uint32), u_want.view(np.uint32)), on


def test_engine_on_either_path_matches_the_cpu_and_is_batch_invariant(int8_switch, tmp_path) -> None:
    """The engine on the tiny preset with each setting: every step from the CPU engine's state
    within 2e-3 relative, a sequence's logits bit-identical alone and beside two others, graph
    replay equal to eager launches (the switch is part of the graph key: flipping it captures new
    graphs), and the two settings within 2e-3 of each other."""
    from ds4_app.engine.plan import StepPlan
    from ds4_app.engine.presets import tiny
    from ds4_app.engine.synth import synthesize
    from ds4_app.engine.gguf_file import ModelFile
    from tests.engine_cases import PAGES_PER_SEQ, Seq, prompt, run
    from tests.gpu.test_gpu_engine import cpu_engine, gpu_engine, rel_err

    path = tmp_path / "tiny.gguf"
    synthesize(tiny(), path, seed=7)
    mf = ModelFile.open(path)
    cpu, gpu = cpu_engine(mf, max_slots=4), gpu_engine(mf, max_slots=4)
    tokens = prompt(mf, 3, 60)
    table = [5, 0, 7, 2]
    logits = {}
    for on in (True, False):
        int8_switch(on)
        for t, tok in enumerate(tokens):
            native._testing.gpu_sync_slot(cpu, gpu, 1, np.asarray(table, np.int32), t)
            plan = StepPlan.build([(1, int(tok), t, True)], {1: table}, PAGES_PER_SEQ)
            want, got = cpu.step(plan), gpu.step(plan)
            assert rel_err(got, want)[0] <= 2e-3, (on, t)
        runs = {}
        for graphs in (False, True):
            gpu.use_graphs = graphs
            captured = gpu.graphs_captured
            alone = Seq(prompt(mf, 5, 40), slot=0, pages=[1, 3], rows=4)
            for s in (0, 1, 2):
                gpu.reset_slot(s)
            a = run(gpu, [alone])[0]
            for s in (0, 1, 2):
                gpu.reset_slot(s)
            beside = run(gpu, [Seq(prompt(mf, 5, 40), slot=0, pages=[1, 3], rows=4),
                               Seq(prompt(mf, 6, 30), slot=1, pages=[4, 6], rows=1),
                               Seq(prompt(mf, 7, 25), slot=2, pages=[8, 9], rows=2, start=3)])[0]
            assert np.array_equal(a.view(np.uint32), beside.view(np.uint32)), (on, graphs)
            if graphs:
                assert gpu.graphs_captured > captured, on
            runs[graphs] = a
        assert np.array_equal(runs[False].view(np.uint32), runs[True].view(np.uint32)), on
        logits[on] = runs[False]
    assert not np.array_equal(logits[True], logits[False])
    assert (rel_err(logits[True], logits[False]) <= 2e-3).all()
