"""The integer tensor-core kernels (ext/gpu/imma_q8.cu: dense Q8_0; imma_q4k.cu: grouped Q4_K)
against the SIMT integer kernels, bit for bit.

Marked ``gpu``. Hooks (``_testing``): ``gpu_set_matvec_imma(min_cols) -> int`` (the fewest columns a
Q8_0 product takes the tensor cores from, 0 never), ``gpu_set_matvec_imma_grouped(min_pairs) -> int``
(the fewest pairs per expert a grouped Q4_K product takes them from), both process-wide, and
``gpu_imma_launches(path="all")`` (the kernels' launches so far, all or on one path, so every test
here proves they ran, and on which path). The kernels compute the integer sums of each unit (a
sub-block for Q4_K) with mma.sync and then the SIMT lanes' float operations in their order (virtual
lanes, the butterfly, the k-slice tree), so a
product must be bit-identical on either kernel, at every width, for every k-slice count and
partial chunk, for batched members, for the products of matvec_multi, for every pair of a grouped
product, and in the engine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.gpu.test_gpu_kernels import tame_raw

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing
pytestmark = pytest.mark.gpu

Q8_0, Q4_K = 8, 12


@pytest.fixture
def imma():
    """Set the thresholds inside a test; back to the defaults (-1) after it."""
    yield T.gpu_set_matvec_imma
    T.gpu_set_matvec_imma(-1)
    T.gpu_set_matvec_imma_grouped(-1)
    T.gpu_set_matvec_imma_narrow(-1, -1, -1)
    T.gpu_set_matvec_imma_indep(-1)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, NaNs equal wherever both are NaN (their payload is not part of the contract)."""
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb) and np.array_equal(a[~na].view(np.uint32), b[~nb].view(np.uint32)))


def on_tensor_cores(fn):
    """fn() run with the tensor cores taking every Q8_0 call, and the launches it made."""
    T.gpu_set_matvec_imma(1)
    before = T.gpu_imma_launches()
    out = fn()
    return out, T.gpu_imma_launches() - before


def test_imma_switches_read_back(imma) -> None:
    default, default_grouped = imma(-1), T.gpu_set_matvec_imma_grouped(-1)
    assert default >= 0 and default_grouped >= 0
    assert T.gpu_set_matvec_imma_indep(-1) == 2 and T.gpu_set_matvec_imma_indep(0) == 0  # default: the grouped kernel
    with pytest.raises(ValueError, match="mask"):
        T.gpu_set_matvec_imma_indep(8)
    assert imma(0) == 0
    assert imma(48) == 48
    assert T.gpu_set_matvec_imma_grouped(0) == 0
    assert T.gpu_set_matvec_imma_grouped(3) == 3
    assert imma(-1) == default and T.gpu_set_matvec_imma_grouped(-1) == default_grouped
    for setter in (imma, T.gpu_set_matvec_imma_grouped):
        with pytest.raises(ValueError):
            setter(-2)
    default_narrow = T.gpu_set_matvec_imma_narrow(-1, -1, -1)
    assert default_narrow[0] >= 0 and default_narrow[1] and default_narrow[2]
    assert T.gpu_set_matvec_imma_narrow(16384, 0, 0) == (16384, False, False)
    assert T.gpu_set_matvec_imma_narrow(-1, -1, -1) == default_narrow
    for bad in ((0, 2, 1), (0, 1, 2), (-2, 1, 1)):
        with pytest.raises(ValueError):
            T.gpu_set_matvec_imma_narrow(*bad)


# (K, rows): k-slices 1 (one chunk; a partial chunk of 16 units; 8 units; tall; taller than 132 SMs'
# narrow row blocks: the persistent grid, some blocks walking two), 2 and 4 (4 chunks; 5 chunks, the
# last 8 units: slice 0 takes two). Rows not multiples of the 32-row tile.
SHAPES = [(1024, 700), (1536, 300), (256, 100), (2048, 8200), (1024, 9000), (2048, 3000), (4096, 1000),
          (4352, 500)]


@pytest.mark.parametrize("ne0, ne1", SHAPES, ids=[f"{k}x{r}" for k, r in SHAPES])
def test_tensor_cores_equal_simt_at_every_width(imma, ne0: int, ne1: int) -> None:
    rng = np.random.default_rng()
    raw = tame_raw(Q8_0, ne0 * ne1, rng)
    x = rng.standard_normal((77, ne0)).astype(np.float32)
    x[3] *= 1e-30
    x[4] *= 1e25
    x[5, : ne0 // 3] = 0.0
    imma(0)
    want = T.gpu_matmul(Q8_0, raw, ne0, ne1, x)
    for width in (77, 32, 33, 13, 8, 5, 1):  # from 9 columns 32 x 32 tiles, up to 8 64 x 8
        # The narrow tile with its planes loaded a chunk ahead and in place, on a persistent grid or not;
        # either tile with a unit's MMAs chained and independent.
        narrow = ((1, 1, 0), (0, 1, 0), (1, 0, 0), (1, 1, 4), (0, 1, 4))
        for ahead, persist, indep in narrow if width <= 8 else ((1, 1, 0), (1, 1, 1)):
            T.gpu_set_matvec_imma_narrow(0, ahead, persist)
            assert T.gpu_set_matvec_imma_indep(indep) == indep
            got, launches = on_tensor_cores(lambda: T.gpu_matmul(Q8_0, raw, ne0, ne1, x[:width]))
            assert launches == 1, width
            assert np.array_equal(got.view(np.uint32), want[:width].view(np.uint32)), (width, ahead, persist, indep)
        T.gpu_set_matvec_imma_indep(-1)
    # A narrow call lower than the narrow tile's row threshold stays on the SIMT kernels.
    T.gpu_set_matvec_imma_narrow(ne1 + 1, 1, 1)
    got, launches = on_tensor_cores(lambda: T.gpu_matmul(Q8_0, raw, ne0, ne1, x[:8]))
    assert launches == 0 and np.array_equal(got.view(np.uint32), want[:8].view(np.uint32))
    T.gpu_set_matvec_imma_narrow(-1, -1, -1)
    # A column sits in another tile and n-slot of a wider call: the same bits.
    perm = rng.permutation(77)
    got, _ = on_tensor_cores(lambda: T.gpu_matmul(Q8_0, raw, ne0, ne1, x[perm]))
    assert np.array_equal(got.view(np.uint32), want[perm].view(np.uint32))


CHILD = """
import sys
import numpy as np
from ds4_app.engine import _native
T = _native._testing
data = np.load(sys.argv[1])
T.gpu_set_matvec_imma(1)
T.gpu_set_matvec_imma_grouped(1)
before = {p: T.gpu_imma_launches(p) for p in ("q8_cp_async", "q8_bulk", "q4k_cp_async", "q4k_bulk")}
out = {}
for name in ("wide", "narrow"):
    ne0, ne1 = (int(v) for v in data[name + "_shape"])
    out[name] = T.gpu_matmul(8, data[name + "_raw"], ne0, ne1, data[name + "_x"])
ne0, ne1, n_expert = (int(v) for v in data["grouped_shape"])
out["grouped"] = T.gpu_matmul_grouped(12, data["grouped_raw"], ne0, ne1, n_expert, data["grouped_x"],
                                      data["grouped_pe"], data["grouped_xr"], 8)
np.savez(sys.argv[2], **{p: T.gpu_imma_launches(p) - n for p, n in before.items()}, **out)
"""


def test_weights_by_cp_async_equal_the_bulk_copies(imma, tmp_path) -> None:
    """The Q8_0 tiles take their weights, and the grouped Q4_K kernel its weights and planes, by the bulk
    copy engine (sm_90) unless DS4_GPU_MV_IMMA_BULK=0 (read once a process): a child process with the
    switch off takes cp.async and gives the same bits for a wide call and a narrow one with partial
    chunks (K = 4352: 136 units, the last chunk 8) and a persistent grid, and for a grouped Q4_K
    product with a partial last chunk (K = 2304) and a row tail (200 rows)."""
    rng = np.random.default_rng()
    data = {}
    for name, (ne0, ne1, width) in {"wide": (4352, 500, 40), "narrow": (1536, 9000, 7)}.items():
        data[name + "_shape"] = np.array([ne0, ne1])
        data[name + "_raw"] = tame_raw(Q8_0, ne0 * ne1, rng)
        data[name + "_x"] = rng.standard_normal((width, ne0)).astype(np.float32)
    ne0, ne1, n_expert, n_lanes = 2304, 200, 4, 48
    data["grouped_shape"] = np.array([ne0, ne1, n_expert])
    data["grouped_raw"] = tame_raw(Q4_K, ne0 * ne1 * n_expert, rng)
    data["grouped_x"] = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
    data["grouped_pe"] = rng.integers(0, n_expert, n_lanes * 3).astype(np.int32)
    data["grouped_xr"] = np.repeat(np.arange(n_lanes, dtype=np.int32), 3)
    np.savez(tmp_path / "in.npz", **data)
    env = dict(os.environ, DS4_GPU_MV_IMMA_BULK="0")
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], env=env,
                   check=True, timeout=300)
    child = np.load(tmp_path / "out.npz")
    assert int(child["q8_cp_async"]) == 2 and int(child["q8_bulk"]) == 0
    assert int(child["q4k_cp_async"]) == 1 and int(child["q4k_bulk"]) == 0
    imma(1)
    for name in ("wide", "narrow"):
        ne0, ne1 = (int(v) for v in data[name + "_shape"])
        before = T.gpu_imma_launches("q8_bulk")
        got = T.gpu_matmul(Q8_0, data[name + "_raw"], ne0, ne1, data[name + "_x"])
        assert T.gpu_imma_launches("q8_bulk") - before == 1
        assert same_bits(got, child[name]), name
    T.gpu_set_matvec_imma_grouped(1)
    ne0, ne1, n_expert = (int(v) for v in data["grouped_shape"])
    before = T.gpu_imma_launches("q4k_bulk")
    got = T.gpu_matmul_grouped(Q4_K, data["grouped_raw"], ne0, ne1, n_expert, data["grouped_x"], data["grouped_pe"],
                               data["grouped_xr"], 8)
    assert T.gpu_imma_launches("q4k_bulk") - before == 1
    assert same_bits(got, child["grouped"])


def test_nonfinite_and_zero_units_match(imma) -> None:
    """A unit holding an inf or a NaN makes its column's rows NaN on both kernels, nothing else;
    zero and subnormal columns give the SIMT bits."""
    rng = np.random.default_rng()
    ne0, ne1 = 1024, 96
    raw = tame_raw(Q8_0, ne0 * ne1, rng)
    x = rng.standard_normal((40, ne0)).astype(np.float32)
    x[0] = 0.0
    x[1] = np.float32(1e-40)
    x[2, 70] = np.inf
    x[3, 5] = np.nan
    x[4, 1000] = -np.inf
    imma(0)
    want = T.gpu_matmul(Q8_0, raw, ne0, ne1, x)
    got, launches = on_tensor_cores(lambda: T.gpu_matmul(Q8_0, raw, ne0, ne1, x))
    assert launches == 1
    assert same_bits(got, want)
    assert np.isnan(got[2:5]).all() and not np.isnan(got[5:]).any()


def test_batched_members_and_multi_products_match(imma) -> None:
    rng = np.random.default_rng()
    ne0, rows, n_batch = 1024, 256, 4
    raw = tame_raw(Q8_0, ne0 * rows * n_batch, rng)
    xb = rng.standard_normal((40, n_batch * ne0)).astype(np.float32)
    imma(0)
    want = T.gpu_matmul_batched(Q8_0, raw, ne0, rows * n_batch, n_batch, xb)
    got, launches = on_tensor_cores(lambda: T.gpu_matmul_batched(Q8_0, raw, ne0, rows * n_batch, n_batch, xb))
    assert launches == 1  # one launch, the members on the grid's z
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))

    shapes = [(Q8_0, 640), (1, 256), (Q8_0, 96)]
    raws = [tame_raw(t, ne0 * r, rng) for t, r in shapes]
    x = rng.standard_normal((48, ne0)).astype(np.float32)
    products = [(t, raw, r) for (t, r), raw in zip(shapes, raws)]
    imma(0)
    want, _ = T.gpu_matmul_multi(products, ne0, x)
    (got, _), launches = on_tensor_cores(lambda: T.gpu_matmul_multi(products, ne0, x))
    assert launches == 2  # the two Q8_0 products
    for g, w in zip(got, want):
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32))


# (K, rows, experts): one k-slice (32 units); two k-slices, rows not a multiple of 32; two k-slices
# with a partial last chunk (72 units: 2 chunks and 8 units); flash-l4's down shape (2048 -> 4096);
# four k-slices (136 units: 4 chunks and 8 units, so slice 0 takes two).
GROUPED = [(1024, 300, 6), (2048, 1000, 5), (2304, 200, 4), (2048, 4096, 3), (4352, 300, 3)]


@pytest.mark.parametrize("ne0, ne1, n_expert", GROUPED, ids=[f"{k}x{r}x{e}" for k, r, e in GROUPED])
def test_grouped_q4k_on_tensor_cores_equals_simt(imma, ne0: int, ne1: int, n_expert: int) -> None:
    """Every pair of a grouped Q4_K product bit-identical on either kernel: parts of 8 and of 3 pairs,
    lanes routing twice to one expert, nonfinite and tiny activation rows; and a pair equal to its
    expert's dense product on its column alone."""
    rng = np.random.default_rng()
    raw = tame_raw(Q4_K, ne0 * ne1 * n_expert, rng)
    n_lanes = 48  # 144 pairs: one a expert counts at least 128 experts
    x = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
    x[1] *= 1e-30
    x[2, 100] = np.inf
    pe = rng.integers(0, n_expert, n_lanes * 3).astype(np.int32)
    xr = np.repeat(np.arange(n_lanes, dtype=np.int32), 3)
    for max_part, indep in ((8, 0), (3, 0), (8, 2), (3, 2)):  # a sub-block's MMAs chained, then independent
        T.gpu_set_matvec_imma_grouped(0)
        want = T.gpu_matmul_grouped(Q4_K, raw, ne0, ne1, n_expert, x, pe, xr, max_part)
        T.gpu_set_matvec_imma_grouped(1)
        T.gpu_set_matvec_imma_indep(indep)
        before = T.gpu_imma_launches("q4k_bulk")
        got = T.gpu_matmul_grouped(Q4_K, raw, ne0, ne1, n_expert, x, pe, xr, max_part)
        T.gpu_set_matvec_imma_indep(-1)
        assert T.gpu_imma_launches("q4k_bulk") - before == 1
        assert same_bits(got, want), (max_part, indep)
    expert_bytes = ne0 // 256 * 144 * ne1
    imma(0)
    for p in (0, 5, 7, len(pe) - 1):
        one = T.gpu_matmul(Q4_K, raw[pe[p] * expert_bytes : (pe[p] + 1) * expert_bytes], ne0, ne1, x[xr[p] : xr[p] + 1])
        assert same_bits(one[0], got[p]), p


def test_gate_up_pair_declines_to_the_tensor_cores(imma) -> None:
    """Where the grouped tensor-core kernel takes the stack, matvec_grouped_pair declines (the engine
    then runs gate and up here and the SwiGLU kernel), and the products keep their bits."""
    rng = np.random.default_rng()
    ne0, ne1, n_expert, n_lanes = 2048, 256, 4, 64
    raw_g, raw_u = tame_raw(Q4_K, ne0 * ne1 * n_expert, rng), tame_raw(Q4_K, ne0 * ne1 * n_expert, rng)
    x = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
    pe = rng.integers(0, n_expert, n_lanes * 2).astype(np.int32)
    xr = np.repeat(np.arange(n_lanes, dtype=np.int32), 2)
    T.gpu_set_matvec_imma_grouped(0)
    g0, u0, fused = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, 8, 4)
    assert fused
    T.gpu_set_matvec_imma_grouped(1)  # 128 pairs >= 1 x 128 (4 experts count as 128)
    g1, u1, fused = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, 8, 4)
    assert not fused
    before = T.gpu_imma_launches()
    g2 = T.gpu_matmul_grouped(Q4_K, raw_g, ne0, ne1, n_expert, x, pe, xr, 8)
    assert T.gpu_imma_launches() - before == 1
    assert same_bits(g2, g0) and same_bits(g1, g0) and same_bits(u1, u0)


def engine_runs(tmp_path, seed: int, max_rows: int, feeds, settings: dict) -> dict:
    """The tiny preset (synthesized with seed) fed feeds(mf)'s two sequences under each setting
    (name -> a function that sets the switches), eager and under graphs: {(graphs, name): (logits,
    the tensor-core launches the run made)}."""
    from ds4_app.engine.presets import tiny
    from ds4_app.engine.synth import synthesize
    from ds4_app.engine.gguf_file import ModelFile
    from tests.engine_cases import run
    from tests.gpu.test_gpu_engine import gpu_engine

    path = tmp_path / "tiny.gguf"
    synthesize(tiny(), path, seed=seed)
    mf = ModelFile.open(path)
    gpu = gpu_engine(mf, max_slots=2, max_rows=max_rows)
    out = {}
    for graphs in (False, True):
        gpu.use_graphs = graphs
        for name, setting in settings.items():
            setting()
            before = T.gpu_imma_launches()
            gpu.reset_slot(0)
            gpu.reset_slot(1)
            logits = run(gpu, feeds(mf))
            out[graphs, name] = logits, T.gpu_imma_launches() - before
    return out


def assert_same_logits(out: dict) -> None:
    first = next(iter(out.values()))[0]
    for key, (logits, _) in out.items():
        for a, b in zip(logits, first):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), key


def test_engine_prefill_on_tensor_cores_equals_simt(imma, tmp_path) -> None:
    """The tiny preset's prompts packed 40 and 30 rows a step: the same logits with the tensor cores
    taking every Q8_0 product of 4 or more columns and every grouped Q4_K product of one pair per
    expert or more (a unit's MMAs chained, and independent), and with them off, eager and under graphs
    (the thresholds and the MMAs' form are part of the graph key)."""
    from tests.engine_cases import Seq, prompt

    def setting(threshold: int, indep: int = 0):
        return lambda: (imma(threshold), T.gpu_set_matvec_imma_grouped(1 if threshold else 0),
                        T.gpu_set_matvec_imma_indep(indep))

    out = engine_runs(tmp_path, 11, 80,
                      lambda mf: [Seq(prompt(mf, 5, 90), slot=0, pages=[1, 3], rows=40),
                                  Seq(prompt(mf, 6, 70), slot=1, pages=[4, 6], rows=30)],
                      {0: setting(0), 4: setting(4), "indep": setting(4, 3)})
    assert out[False, 4][1] > 0 and out[False, 0][1] == 0 and out[True, 0][1] == 0
    assert out[False, "indep"][1] > 0 and out[True, "indep"][1] > 0
    assert_same_logits(out)


def test_engine_decode_widths_on_the_narrow_tile_equal_simt(imma, tmp_path) -> None:
    """Two sequences fed 3 and 2 rows a step (calls of 5 columns, then 3 and 2: the narrow 64 x 8
    tile) give the SIMT kernels' logits with every Q8_0 product on the tensor cores, the planes
    loaded a chunk ahead and in place, eager and under graphs."""
    from tests.engine_cases import Seq, prompt

    def setting(threshold: int, ahead: int):
        return lambda: (imma(threshold), T.gpu_set_matvec_imma_narrow(0, ahead, 1))

    out = engine_runs(tmp_path, 12, 8,
                      lambda mf: [Seq(prompt(mf, 7, 12), slot=0, pages=[1, 3], rows=3),
                                  Seq(prompt(mf, 8, 9), slot=1, pages=[4, 6], rows=2)],
                      {"simt": setting(0, 1), "ahead": setting(1, 1), "in place": setting(1, 0)})
    # (under graphs only a capture launches)
    assert out[False, "simt"][1] == 0 and out[False, "ahead"][1] > 0 and out[False, "in place"][1] > 0
    assert_same_logits(out)
