"""Fused matvec launches (ext/gpu/matvec_fused.cu) against the launches they replace, bit for bit.

Marked ``gpu`` (conftest skips them without a CUDA/HIP build and a device). Hooks (``_testing``):

- ``gpu_matmul_multi([(ggml_type, raw, ne1), ...], ne0, X, tall, staged) -> ([Y_i], launches)``:
  up to 8 products of one X; each Y_i must equal ``gpu_matmul`` of that product alone;
- ``gpu_matmul_grouped_pair(t, raw_gate, raw_up, ne0, ne1, n_expert, X, pair_expert, x_row, max_part,
  max_cols, swiglu_limit) -> (G, U, fused)``: the routed experts' gate and up in one launch, G and U
  equal to two ``gpu_matmul_grouped`` calls, or with ``swiglu_limit`` G equal to ``gpu_swiglu`` of
  those two (lane_ops.cu's kernel);
- ``gpu_set_matvec_fuse(on)``: fusion on/off process-wide (DS4_GPU_MV_FUSE=0);
- the engine: a GpuEngine's logits with fusion on and off, eager and under graphs.

Each test also checks that the fused launch really ran where it should (launch counts, ``fused``),
so a silent fallback to the separate launches cannot pass for the fused path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.engine_cases import MAX_CTX, Seq, prompt, run_fresh, tensor_entries
from tests.gpu.test_gpu_kernels import NAMES, TYPES, tame_raw

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing
pytestmark = pytest.mark.gpu

Q8_0, Q4_K, MXFP4, F16, BF16, F32 = 8, 12, 39, 1, 30, 0


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def alone(products, ne0: int, x: np.ndarray, **kw) -> list[np.ndarray]:
    """Each product through matvec on its own (the direct kernel unless kw says otherwise)."""
    return [T.gpu_matmul(t, raw, ne0, ne1, x, **kw) for t, raw, ne1 in products]


def products_of(types_rows: list[tuple[int, int]], ne0: int, rng: np.random.Generator):
    return [(t, tame_raw(t, ne0 * rows, rng), rows) for t, rows in types_rows]


@pytest.fixture
def restore_switches():
    """Put the process-wide matvec switches back to their defaults after a test."""
    yield
    T.gpu_set_matvec_fuse(True)
    T.gpu_set_matvec_chunked(True)
    T.gpu_set_matvec_grouped(1, -1, -1)
    T.gpu_set_matvec_grouped_groups(-1)


# --- matvec_multi ---------------------------------------------------------------------------------

@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unit-loads"])
def test_multi_equals_each_product_alone(t: int, chunked: bool, restore_switches) -> None:
    """Four products of one type with ragged row counts (k-slices 4, 4, 2 and a partial last row
    block each) at every width 1..16, staged on and off: every output has the bits of the product's
    own launch; at one column (no staged kernel) they run as one launch."""
    rng = np.random.default_rng()
    ne0 = 4096
    products = products_of([(t, 77), (t, 600), (t, 2100), (t, 33)], ne0, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)
    T.gpu_set_matvec_chunked(chunked)
    for width in range(1, 17):
        want = alone(products, ne0, x[:width], staged=False)
        for staged in (None, False):
            got, launches = T.gpu_matmul_multi(products, ne0, x[:width], staged=staged)
            for i, (g, w) in enumerate(zip(got, want)):
                assert np.array_equal(bits(g), bits(w)), (NAMES[t], width, staged, i)
            if width == 1 or (staged is False and width <= 8):
                assert launches == 1, (NAMES[t], width, staged, launches)


@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_multi_one_k_slice_shapes(t: int) -> None:
    """K = 256 (one k-slice for every row count: fewer than 64 units), eight products, widths 1..8."""
    rng = np.random.default_rng()
    ne0 = 256
    products = products_of([(t, r) for r in (1, 5, 64, 129, 300, 1000, 17, 2)], ne0, rng)
    x = rng.standard_normal((8, ne0)).astype(np.float32)
    for width in range(1, 9):
        want = alone(products, ne0, x[:width], staged=False)
        got, launches = T.gpu_matmul_multi(products, ne0, x[:width], staged=False)
        assert launches == 1
        for g, w in zip(got, want):
            assert np.array_equal(bits(g), bits(w)), (NAMES[t], width)


@pytest.mark.parametrize("mix, fused_launches", [
    ([(Q8_0, 1024), (Q8_0, 512), (F16, 1024), (F16, 1024), (F16, 64), (F16, 256), (F16, 256)], 1),  # flash-l4 u, CSA
    ([(Q8_0, 64), (Q8_0, 128), (BF16, 256), (BF16, 256), (F16, 4), (F16, 128), (F16, 128)], 2),  # the tiny mix
    ([(Q8_0, 300), (BF16, 77), (BF16, 2100)], 1),
    ([(F16, 96), (Q4_K, 40), (MXFP4, 600), (F32, 24), (BF16, 130), (Q8_0, 70), (MXFP4, 9)], 5),
], ids=["q8-f16", "q8-bf16-f16", "q8-bf16", "six-types"])
def test_multi_mixed_types(mix, fused_launches: int) -> None:
    """Products of different types share X: each has its own launch's bits; Q8_0 shares its launch
    with F16 (else BF16), every other type runs as one launch of its own."""
    rng = np.random.default_rng()
    ne0 = 512
    products = products_of(mix, ne0, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)
    for width in (1, 2, 3, 4, 7, 8, 9, 16):
        want = alone(products, ne0, x[:width], staged=False)
        for staged in (None, False):
            got, launches = T.gpu_matmul_multi(products, ne0, x[:width], staged=staged)
            for i, (g, w) in enumerate(zip(got, want)):
                assert np.array_equal(bits(g), bits(w)), (width, staged, i)
            if width == 1:
                assert launches == fused_launches


@pytest.mark.parametrize("t_small", [F16, BF16, Q8_0], ids=["F16", "BF16", "Q8_0"])
def test_multi_tall_products(t_small: int) -> None:
    """q_b beside the indexer's queries: a Q8_0 matrix tall enough for the tall variant (16384 rows and
    a partial block) with a shorter one, tall on and off, direct and staged: the same bits as each
    alone, one launch at one column (the tall rows per warp then serve both)."""
    rng = np.random.default_rng()
    ne0 = 256
    products = products_of([(Q8_0, 16384 + 40), (t_small, 8192 + 3)], ne0, rng)
    x = rng.standard_normal((8, ne0)).astype(np.float32)
    for width in (1, 2, 4, 5, 8):
        want = alone(products, ne0, x[:width], staged=False)
        for tall in (False, True):
            for staged in (None, False):
                got, launches = T.gpu_matmul_multi(products, ne0, x[:width], tall=tall, staged=staged)
                for g, w in zip(got, want):
                    assert np.array_equal(bits(g), bits(w)), (width, tall, staged)
                if width == 1:
                    assert launches == 1


def test_multi_with_fusion_off_makes_the_separate_launches(restore_switches) -> None:
    rng = np.random.default_rng()
    ne0 = 1024
    products = products_of([(Q8_0, 1024), (Q8_0, 512), (F16, 256)], ne0, rng)
    x = rng.standard_normal((4, ne0)).astype(np.float32)
    fused, n_fused = T.gpu_matmul_multi(products, ne0, x[:1])
    T.gpu_set_matvec_fuse(False)
    separate, n_separate = T.gpu_matmul_multi(products, ne0, x[:1])
    assert (n_fused, n_separate) == (1, 3)
    for a, b in zip(fused, separate):
        assert np.array_equal(bits(a), bits(b))


def test_multi_takes_up_to_eight_products() -> None:
    rng = np.random.default_rng()
    raw = tame_raw(Q8_0, 512 * 64, rng)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    ys, launches = T.gpu_matmul_multi([(Q8_0, raw, 64)] * 8, 512, x)
    assert launches == 1 and all(np.array_equal(bits(y), bits(ys[0])) for y in ys)
    with pytest.raises(ValueError):
        T.gpu_matmul_multi([(Q8_0, raw, 64)] * 9, 512, x)


# --- grouped gate/up (+ SwiGLU) -------------------------------------------------------------------

def routing(n_lanes: int, per_lane: int, n_expert: int, rng: np.random.Generator, repeats: bool):
    if repeats:  # a lane may route twice to one expert: parts wider than the lanes
        pe = rng.integers(0, n_expert, n_lanes * per_lane)
    else:
        pe = np.concatenate([rng.choice(n_expert, per_lane, replace=False) for _ in range(n_lanes)])
    return pe.astype(np.int32), np.repeat(np.arange(n_lanes, dtype=np.int32), per_lane)


def swiglu_ref(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    if limit > 0:
        g64, u64 = np.minimum(g64, limit), np.clip(u64, -limit, limit)
    return g64 / (1.0 + np.exp(-g64)) * u64


# (ne0, ne1, n_expert, fused): the tiny model's experts (one k-slice), two k-slices with a partial
# last row block, one k-slice over flash-l4's gate/up height; and a shape the own body does not take
# (4 k-slices), where the separate launches run.
PAIR_SHAPES = [(256, 256, 8, True), (2048, 203, 4, True), (1024, 2056, 6, True), (4096, 512, 3, False)]


@pytest.mark.parametrize("ne0, ne1, n_expert, served", PAIR_SHAPES, ids=["tiny", "ks2-partial", "ks1-tall", "ks4"])
def test_grouped_pair_equals_two_grouped_launches(ne0: int, ne1: int, n_expert: int, served: bool) -> None:
    """Gate and up in one launch give each pair the bits of two matvec_grouped calls; with the SwiGLU
    in the store, the swiglu kernel's bits on those; every kernel width, parts of 8 and of 1, lanes
    routing twice to one expert; fused exactly where the own body takes the shape."""
    rng = np.random.default_rng()
    raw_g, raw_u = tame_raw(Q4_K, ne0 * ne1 * n_expert, rng), tame_raw(Q4_K, ne0 * ne1 * n_expert, rng)
    for n_lanes, per_lane, repeats in ((1, 6, False), (3, 2, False), (7, 3, True)):
        x = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
        per_lane = min(per_lane, n_expert)  # distinct routes need that many experts
        pe, xr = routing(n_lanes, per_lane, n_expert, rng, repeats)
        for max_part in (8, 1):
            gate = T.gpu_matmul_grouped(Q4_K, raw_g, ne0, ne1, n_expert, x, pe, xr, max_part)
            up = T.gpu_matmul_grouped(Q4_K, raw_u, ne0, ne1, n_expert, x, pe, xr, max_part)
            for max_cols in (1, 2, 4, 8):
                g, u, fused = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, max_part,
                                                        max_cols)
                assert fused == served, (n_lanes, max_part, max_cols)
                assert np.array_equal(bits(g), bits(gate)) and np.array_equal(bits(u), bits(up)), \
                    (n_lanes, max_part, max_cols)
                for limit in (10.0, 0.25, 0.0):
                    s, none, fused = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr,
                                                               max_part, max_cols, limit)
                    assert none is None and fused == served
                    want = T.gpu_swiglu(gate, up, limit)
                    assert np.array_equal(bits(s), bits(want)), (n_lanes, max_part, max_cols, limit)
                    assert np.allclose(s, swiglu_ref(gate, up, limit), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", [0, 1, 2], ids=["pass5", "own", "own-fast"])
def test_grouped_pair_serves_the_default_variant_only(variant: int, restore_switches) -> None:
    """Variant 1 (the default own body) takes the pair; pass 5 and the one-fma variant decline and the
    separate launches give the same bits; fusion off declines too."""
    rng = np.random.default_rng()
    ne0, ne1, n_expert, n_lanes = 2048, 200, 4, 5
    raw_g, raw_u = tame_raw(Q4_K, ne0 * ne1 * n_expert, rng), tame_raw(Q4_K, ne0 * ne1 * n_expert, rng)
    x = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
    pe, xr = routing(n_lanes, 3, n_expert, rng, True)
    T.gpu_set_matvec_grouped(1)
    want, _, fused = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, 8, n_lanes, 10.0)
    assert fused
    T.gpu_set_matvec_grouped(variant)
    for fuse in (True, False):
        T.gpu_set_matvec_fuse(fuse)
        got, _, fused = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, 8, n_lanes, 10.0)
        assert fused == (fuse and variant == 1)
        assert np.array_equal(bits(got), bits(want)), (variant, fuse)


@pytest.mark.parametrize("ne0, ne1, n_expert", [(256, 256, 8), (2048, 203, 4), (1024, 2056, 6), (2048, 4096, 3)],
                         ids=["tiny", "ks2-partial", "ks1-tall", "down"])
def test_grouped_row_groups_keep_the_bits(ne0: int, ne1: int, n_expert: int, restore_switches) -> None:
    """The own kernel's warps streaming 2, 3, 5 or 16 row groups in one copy stream (fewer, taller
    blocks; the last block's warps fewer groups, some none), or as many as each launch chooses, its
    widest sub-part 1 or 2 (wider parts in pieces) give every output the bits of one row group a
    warp, for the single product and the gate/up pair, at every kernel width."""
    rng = np.random.default_rng()
    raw_g, raw_u = tame_raw(Q4_K, ne0 * ne1 * n_expert, rng), tame_raw(Q4_K, ne0 * ne1 * n_expert, rng)
    for n_lanes, per_lane, repeats in ((1, 3, False), (7, 3, True)):
        x = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
        pe, xr = routing(n_lanes, min(per_lane, n_expert), n_expert, rng, repeats)
        for max_cols in (1, 2, 4, 8):
            assert T.gpu_set_matvec_grouped_groups(1) == 1
            want = T.gpu_matmul_grouped(Q4_K, raw_g, ne0, ne1, n_expert, x, pe, xr, 8, max_cols)
            want_g, want_u, fused = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, 8,
                                                              max_cols)
            for groups, width in ((2, 4), (3, 4), (5, 4), (16, 4), (0, 4), (0, 1), (4, 2)):
                assert T.gpu_set_matvec_grouped_groups(groups) == groups
                T.gpu_set_matvec_grouped(1, 0, width)
                y = T.gpu_matmul_grouped(Q4_K, raw_g, ne0, ne1, n_expert, x, pe, xr, 8, max_cols)
                assert np.array_equal(bits(y), bits(want)), (n_lanes, max_cols, groups, width)
                g, u, f = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, 8, max_cols)
                assert f == fused
                assert np.array_equal(bits(g), bits(want_g)) and np.array_equal(bits(u), bits(want_u)), \
                    (n_lanes, max_cols, groups, width)
                T.gpu_set_matvec_grouped(1, 0, -1)
    with pytest.raises(ValueError, match="groups must be"):
        T.gpu_set_matvec_grouped_groups(17)
    with pytest.raises(ValueError, match="width must be"):
        T.gpu_set_matvec_grouped(1, 0, 3)


def test_grouped_pair_declines_other_types() -> None:
    rng = np.random.default_rng()
    ne0, ne1, n_expert = 512, 96, 4
    raw_g, raw_u = tame_raw(Q8_0, ne0 * ne1 * n_expert, rng), tame_raw(Q8_0, ne0 * ne1 * n_expert, rng)
    x = rng.standard_normal((2, ne0)).astype(np.float32)
    pe, xr = routing(2, 2, n_expert, rng, False)
    g, u, fused = T.gpu_matmul_grouped_pair(Q8_0, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, 8)
    assert not fused
    assert np.array_equal(bits(g), bits(T.gpu_matmul_grouped(Q8_0, raw_g, ne0, ne1, n_expert, x, pe, xr, 8)))
    assert np.array_equal(bits(u), bits(T.gpu_matmul_grouped(Q8_0, raw_u, ne0, ne1, n_expert, x, pe, xr, 8)))


# --- the engine -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model_file(tmp_path_factory):
    from ds4_app.engine.gguf_file import ModelFile
    from ds4_app.engine.presets import tiny
    from ds4_app.engine.synth import synthesize

    path = Path(tmp_path_factory.mktemp("gpu_fused")) / "tiny-5.gguf"
    synthesize(tiny(), path, seed=5)
    return ModelFile.open(path)


def gpu_engine(mf, *, max_slots: int = 6, max_rows: int = 16):
    from ds4_app.engine.memory import plan_memory

    n_pages = plan_memory(mf.config, max_slots=max_slots, max_ctx=MAX_CTX).n_pages
    return native.GpuEngine(mf.config, str(mf.path), tensor_entries(mf), max_slots=max_slots, max_ctx=MAX_CTX,
                            n_pages=n_pages, max_rows=max_rows)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_logits_are_the_same_with_fusion_on_and_off(tiny_model_file, graphs: bool, restore_switches) -> None:
    """40 decode steps at one lane, about 40 at three lanes (three slots), and a sequence fed 4 rows a
    step: the logits with fusion on (one launch for u's products, for q_lat's, for the shared expert's gate
    and up, and the routed gate/up/SwiGLU) equal those with it off, bit for bit; under graphs the
    switch captures new graphs (it is part of the graph key)."""
    assert_same_under(tiny_model_file, graphs,
                      [lambda: T.gpu_set_matvec_fuse(False), lambda: T.gpu_set_matvec_fuse(True)])


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_logits_are_the_same_with_row_groups(tiny_model_file, graphs: bool, restore_switches) -> None:
    """The same cases with the own grouped kernel's warps streaming 1, 3 or 16 row groups or as many
    as each launch chooses, with its widest sub-part 4, then 1: the logits are bit-identical; under
    graphs each setting captures its own graphs (the graph key)."""
    T.gpu_set_matvec_grouped(1, 0, 4)
    assert_same_under(tiny_model_file, graphs,
                      [lambda g=g: T.gpu_set_matvec_grouped_groups(g) for g in (1, 3, 16, 0)]
                      + [lambda: T.gpu_set_matvec_grouped(1, 0, 1)])


def assert_same_under(mf, graphs: bool, settings) -> None:
    """40 decode steps at one lane, about 40 at three lanes (three slots), and a sequence fed 4 rows a
    step, under each of `settings` (callables that set a switch) in turn: every setting's logits
    equal the first one's, bit for bit; under graphs each setting captures new graphs."""
    cases = [
        [Seq(prompt(mf, 71, 40), slot=0, pages=[0, 1])],
        [Seq(prompt(mf, 72, 44), slot=1, pages=[2, 3], rows=1),
         Seq(prompt(mf, 73, 40), slot=3, pages=[4]),
         Seq(prompt(mf, 74, 41), slot=5, pages=[6, 7], start=1)],
        [Seq(prompt(mf, 75, 44), slot=2, pages=[8], rows=4)],
    ]
    eng = gpu_engine(mf)
    eng.use_graphs = graphs
    out = []
    captured = eng.graphs_captured
    for setting in settings:
        setting()
        out.append([])
        for seqs in cases:
            out[-1].append(run_fresh(eng, seqs))
        if graphs:
            assert eng.graphs_captured > captured, "the switch must capture new graphs"
            captured = eng.graphs_captured
    for n, other in enumerate(out[1:], 1):
        for case, (first, then) in enumerate(zip(out[0], other)):
            for k, (a, b) in enumerate(zip(first, then)):
                assert np.isfinite(a).all()
                assert np.array_equal(bits(a), bits(b)), f"setting {n}, case {case}, sequence {k}"
