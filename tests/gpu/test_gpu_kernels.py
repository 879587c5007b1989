"""GPU kernels (ext/gpu) against the CPU kernels and numpy, through the binding's testing hooks.

Every test but the first is marked ``gpu``: conftest skips them unless the module was built with
``DS4_GPU=cuda|hip`` and a device is visible. Each draws fresh random inputs. The hooks take and
return numpy arrays and run synchronously (ds4::gpu::testing in ext/gpu/ds4_gpu.h):

- ``gpu_matmul(ggml_type, raw, ne0, ne1, X) -> Y[ncols, ne1]`` (as ``matmul``)
- ``gpu_matmul_grouped(ggml_type, raw, ne0, ne1, n_expert, X, pair_expert, x_row, max_part)``
- ``gpu_rms_norm(X, w, eps)``, ``gpu_embed(ggml_type, raw, ne0, ne1, tokens)``,
  ``gpu_rope_tail(X[rows, heads, head_dim], rope_dim, pos, inv_freq, inverse)``,
  ``gpu_attention_sink(q[lanes, heads, dim], kv[rows, dim] f16, key_rows, key_off, sinks)``,
  ``gpu_argmax(X[rows, n]) -> int32[rows]``

The device harness (ext/gpu/bench/harness.cu) checks the same properties at DS4 sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing

# ggml type id -> (elements per block, bytes per block)
GEOMETRY = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 12: (256, 144), 39: (32, 17)}
NAMES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 12: "Q4_K", 39: "MXFP4"}
TYPES = list(GEOMETRY)


def test_gpu_available_is_false_without_a_backend() -> None:
    assert isinstance(native.gpu_available(), bool)
    if native.gpu_backend() == "off":
        assert native.gpu_available() is False


def tame_raw(t: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n elements of type t with moderate values, as uint8."""
    be, bb = GEOMETRY[t]
    nb = n // be
    if t == 0:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if t == 1:
        return (rng.standard_normal(n) * 0.5).astype(np.float16).view(np.uint8)
    if t == 30:
        return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
    if t == 8:
        raw[:, 0:2] = rng.uniform(-0.02, 0.02, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    elif t == 12:
        dd = np.stack([rng.uniform(0.001, 0.02, nb), rng.uniform(0.0, 0.02, nb)], axis=1).astype(np.float16)
        raw[:, 0:4] = dd.view(np.uint8).reshape(nb, 4)
    else:
        raw[:, 0] = rng.integers(118, 130, nb)
    return raw.reshape(-1)


def scale_of(t: int, raw: np.ndarray, ne0: int, ne1: int, x: np.ndarray) -> np.ndarray:
    """sum_k |w_k x_k| per (column, row): the size rounding errors scale with."""
    w = T.dequantize(t, raw, ne0 * ne1).reshape(ne1, ne0).astype(np.float64)
    return np.abs(x.astype(np.float64)) @ np.abs(w).T


@pytest.mark.gpu
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_matmul_agrees_with_cpu(t: int) -> None:
    rng = np.random.default_rng()
    ne0, ne1 = 1024, 77
    raw = tame_raw(t, ne0 * ne1, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)
    gpu = T.gpu_matmul(t, raw, ne0, ne1, x)
    cpu = T.matmul(t, raw, ne0, ne1, x, 2)
    assert np.isfinite(gpu).all()
    assert (np.abs(gpu.astype(np.float64) - cpu) <= 2e-3 * scale_of(t, raw, ne0, ne1, x)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize("ne0, ne1", [(4096, 300), (16384, 24)], ids=["rows", "mhc"])
def test_matmul_columns_bit_identical_to_single_column(t: int, ne0: int, ne1: int) -> None:
    """4 k-slices, so the cross-warp tree is exercised too; the mHC projections' shape (few rows,
    long K: one row a warp, and at 1-2 columns the float types load the activations ahead)."""
    rng = np.random.default_rng()
    raw = tame_raw(t, ne0 * ne1, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)
    single = np.concatenate([T.gpu_matmul(t, raw, ne0, ne1, x[c : c + 1]) for c in range(16)])
    for width in (2, 3, 5, 8, 13, 16):
        for start in (0, 16 - width):
            y = T.gpu_matmul(t, raw, ne0, ne1, x[start : start + width])
            assert np.array_equal(y.view(np.uint32), single[start : start + width].view(np.uint32)), (NAMES[t], width)
    again = T.gpu_matmul(t, raw, ne0, ne1, x)
    assert np.array_equal(again.view(np.uint32), single.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize("ne0, ne1", [(4096, 300), (1024, 2100)], ids=["short", "staged"])
def test_wide_calls_fold_their_chunks_into_one_launch(t: int, ne0: int, ne1: int) -> None:
    """A call of 32 or more columns runs its whole 16-column chunks as the members of one launch, then
    the rest: every column bit-identical to its own 16-column chunk run alone (the direct kernel for
    few rows, the staged one from 512); the integer tensor cores off, so Q8_0 takes this path too."""
    rng = np.random.default_rng()
    raw = tame_raw(t, ne0 * ne1, rng)
    x = rng.standard_normal((53, ne0)).astype(np.float32)
    keep = T.gpu_set_matvec_imma(0)
    try:
        got = T.gpu_matmul(t, raw, ne0, ne1, x)
        for c0 in range(0, 53, 16):
            want = T.gpu_matmul(t, raw, ne0, ne1, x[c0 : c0 + 16])
            assert np.array_equal(got[c0 : c0 + 16].view(np.uint32), want.view(np.uint32)), (NAMES[t], c0)
    finally:
        T.gpu_set_matvec_imma(keep)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [8, 1, 30, 0], ids=["Q8_0", "F16", "BF16", "F32"])
def test_tall_variant_gives_the_same_bits(t: int) -> None:
    """matvec's tall variant (twice the rows per warp, from 16384 rows; Q8_0/F16/BF16 only, F32 falls
    back) changes speed, never bits: every width, a partial last block, against the normal kernel."""
    rng = np.random.default_rng()
    ne0, ne1 = 256, 16384 + 40  # KS = 1 at this height; 40 rows into a last, partial block
    raw = tame_raw(t, ne0 * ne1, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)
    for width in (1, 2, 4, 5, 8, 16):
        want = T.gpu_matmul(t, raw, ne0, ne1, x[:width])
        got = T.gpu_matmul(t, raw, ne0, ne1, x[:width], tall=True)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (NAMES[t], width)
    cpu = T.matmul(t, raw, ne0, ne1, x[:4], 2)
    assert (np.abs(got[:4].astype(np.float64) - cpu) <= 2e-3 * scale_of(t, raw, ne0, ne1, x[:4])).all()


@pytest.mark.gpu
@pytest.mark.parametrize("t", [8, 12, 39, 1, 30], ids=["Q8_0", "Q4_K", "MXFP4", "F16", "BF16"])
@pytest.mark.parametrize("ne0, ne1", [(4096, 600), (2048, 2100), (512, 9001), (0, 520)],
                         ids=["ks4", "ks2", "ks1-partial", "odd-k"])
def test_staged_kernel_gives_the_same_bits(t: int, ne0: int, ne1: int) -> None:
    """matvec's staged kernel (activations in shared memory, a persistent grid; from 512 rows)
    changes speed, never bits: every width 1..16 (16 columns of K=4096 run as two pieces), each
    k-slice count, a partial last row block, and an odd K (33 shared rows of 32 floats for Q8_0
    and MXFP4; 31.25 for F16 and BF16), against the direct kernel."""
    if ne0 == 0:
        if t == 12:
            pytest.skip("Q4_K rows are whole 256-element blocks")
        ne0 = 1000 if t in (1, 30) else 1056
    rng = np.random.default_rng()
    raw = tame_raw(t, ne0 * ne1, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)
    for width in range(1, 17):
        start = int(rng.integers(0, 17 - width))
        xs = x[start : start + width]
        want = T.gpu_matmul(t, raw, ne0, ne1, xs, staged=False)
        got = T.gpu_matmul(t, raw, ne0, ne1, xs, staged=True)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (NAMES[t], width, start)
    default = T.gpu_matmul(t, raw, ne0, ne1, x)  # the default: staged from 2 columns
    assert np.array_equal(default.view(np.uint32), T.gpu_matmul(t, raw, ne0, ne1, x, staged=False).view(np.uint32))
    cpu = T.matmul(t, raw, ne0, ne1, x[:3], 2)
    assert (np.abs(default[:3].astype(np.float64) - cpu) <= 2e-3 * scale_of(t, raw, ne0, ne1, x[:3])).all()


@pytest.mark.gpu
@pytest.mark.parametrize("max_part", [1, 8])
@pytest.mark.parametrize("t", [8, 12, 39], ids=["Q8_0", "Q4_K", "MXFP4"])
def test_grouped_pairs_equal_single_columns(t: int, max_part: int) -> None:
    rng = np.random.default_rng()
    ne0, ne1, n_expert, n_lanes = 512, 96, 8, 5
    raw = tame_raw(t, ne0 * ne1 * n_expert, rng)
    x = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
    pair_expert = np.concatenate([rng.choice(n_expert, 3, replace=False) for _ in range(n_lanes)]).astype(np.int32)
    x_row = np.repeat(np.arange(n_lanes, dtype=np.int32), 3)
    y = T.gpu_matmul_grouped(t, raw, ne0, ne1, n_expert, x, pair_expert, x_row, max_part)
    expert_bytes = ne0 // GEOMETRY[t][0] * GEOMETRY[t][1] * ne1
    for p, (e, r) in enumerate(zip(pair_expert, x_row)):
        one = T.gpu_matmul(t, raw[e * expert_bytes : (e + 1) * expert_bytes], ne0, ne1, x[r : r + 1])[0]
        assert np.array_equal(one.view(np.uint32), y[p].view(np.uint32))


@pytest.fixture
def unchunked():
    """Run a block with the Q8_0/Q4_K chunked weight loads off, turning them back on after."""

    class Off:
        def __enter__(self):
            T.gpu_set_matvec_chunked(False)

        def __exit__(self, *exc):
            T.gpu_set_matvec_chunked(True)

    yield Off()
    T.gpu_set_matvec_chunked(True)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [8, 12], ids=["Q8_0", "Q4_K"])
@pytest.mark.parametrize("ne0, ne1", [(4096, 600), (2048, 2100), (1280, 9001), (1056, 77), (256, 16424)],
                         ids=["ks4", "ks2", "ks1-partial-chunk", "no-chunks", "tall"])
def test_chunked_weight_loads_give_the_same_bits(t: int, ne0: int, ne1: int, unchunked) -> None:
    """The chunked loads (32 units' bytes copied into shared memory as 16-byte vectors, each lane
    reading its unit from there) change speed, never bits: direct, staged and tall kernels at every
    width, a last chunk of 8 units (K = 1280: 40 units a row), and a Q8_0 K that cannot take chunks
    (1056: 33 units), against the unit-by-unit loads."""
    if t == 12 and ne0 % 256:
        ne0 = 1280 if ne0 == 1056 else ne0
    rng = np.random.default_rng()
    raw = tame_raw(t, ne0 * ne1, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)
    runs = [dict(staged=False), dict(staged=True), dict(staged=False, tall=True)]
    got = {(w, i): T.gpu_matmul(t, raw, ne0, ne1, x[:w], **kw) for w in range(1, 17) for i, kw in enumerate(runs)}
    with unchunked:
        for (w, i), y in got.items():
            want = T.gpu_matmul(t, raw, ne0, ne1, x[:w], **runs[i])
            assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), (NAMES[t], w, runs[i])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [8, 12, 1], ids=["Q8_0", "Q4_K", "F16"])
def test_batched_products_equal_their_own_launches(t: int) -> None:
    """matvec_batched (the grouped output projection's 8 groups in one launch) gives each member the
    bits of its own launch: widths 1, 3, 8 and 16, direct and staged."""
    rng = np.random.default_rng()
    ne0, rows, n_batch = 1024, 512, 8
    raw = tame_raw(t, ne0 * rows * n_batch, rng)
    x = rng.standard_normal((16, n_batch * ne0)).astype(np.float32)
    member_bytes = ne0 // GEOMETRY[t][0] * GEOMETRY[t][1] * rows
    for width in (1, 3, 8, 16):
        for staged in (False, True):
            got = T.gpu_matmul_batched(t, raw, ne0, rows * n_batch, n_batch, x[:width], staged=staged)
            for i in range(n_batch):
                own = T.gpu_matmul(t, raw[i * member_bytes : (i + 1) * member_bytes], ne0, rows,
                                   x[:width, i * ne0 : (i + 1) * ne0], staged=staged)
                assert np.array_equal(got[:, i * rows : (i + 1) * rows].view(np.uint32), own.view(np.uint32)), \
                    (NAMES[t], width, staged, i)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [8, 12], ids=["Q8_0", "Q4_K"])
def test_grouped_widths_and_chunks_give_the_same_bits(t: int, unchunked) -> None:
    """The grouped kernel sized for 1, 2, 4 or 8 columns (parts wider than that run in pieces), with
    and without chunked loads, gives every pair the bits of its own single-column product, also when
    a lane routes twice to one expert (a part two pairs wide at one lane)."""
    rng = np.random.default_rng()
    ne0, ne1, n_expert, n_lanes = 2048, 200, 4, 7
    raw = tame_raw(t, ne0 * ne1 * n_expert, rng)
    x = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
    pair_expert = rng.integers(0, n_expert, n_lanes * 3).astype(np.int32)  # repeats within a lane too
    x_row = np.repeat(np.arange(n_lanes, dtype=np.int32), 3)
    expert_bytes = ne0 // GEOMETRY[t][0] * GEOMETRY[t][1] * ne1
    single = np.stack([T.gpu_matmul(t, raw[e * expert_bytes : (e + 1) * expert_bytes], ne0, ne1, x[r : r + 1])[0]
                       for e, r in zip(pair_expert, x_row)])
    for chunked in (True, False):
        T.gpu_set_matvec_chunked(chunked)
        for max_cols in (1, 2, 4, 8):
            y = T.gpu_matmul_grouped(t, raw, ne0, ne1, n_expert, x, pair_expert, x_row, 8, max_cols)
            assert np.array_equal(y.view(np.uint32), single.view(np.uint32)), (NAMES[t], chunked, max_cols)
    T.gpu_set_matvec_chunked(True)


@pytest.mark.gpu
def test_rms_norm_matches_the_cpu_formula() -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 4096)).astype(np.float32)
    w = rng.standard_normal(4096).astype(np.float32)
    r = (1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1) + np.float64(np.float32(1e-6)))).astype(np.float32)
    ref = (x * r[:, None]) * w
    got = T.gpu_rms_norm(x, w, 1e-6)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_embed_rows_equal_the_cpu_dequantizer(t: int) -> None:
    rng = np.random.default_rng()
    ne0, ne1 = 512, 40
    raw = tame_raw(t, ne0 * ne1, rng)
    tokens = np.array([0, 39, 7, 7], dtype=np.int32)
    table = T.dequantize(t, raw, ne0 * ne1).reshape(ne1, ne0)
    got = T.gpu_embed(t, raw, ne0, ne1, tokens)
    assert np.array_equal(got, table[tokens])  # == : the zero sign may differ (ext/gpu/matvec.cuh)


@pytest.mark.gpu
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_matches_the_cpu_formula(inverse: bool) -> None:
    rng = np.random.default_rng()
    rows, heads, head_dim, rope_dim = 3, 4, 128, 64
    inv_freq = 10000.0 ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    pos = np.array([0, 5, 100003], dtype=np.int32)
    x = rng.standard_normal((rows, heads, head_dim)).astype(np.float32)
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]
    c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    s = -s if inverse else s
    ref = x.copy()
    x0, x1 = x[..., head_dim - rope_dim :: 2], x[..., head_dim - rope_dim + 1 :: 2]
    ref[..., head_dim - rope_dim :: 2] = x0 * c[:, None, :] - x1 * s[:, None, :]
    ref[..., head_dim - rope_dim + 1 :: 2] = x0 * s[:, None, :] + x1 * c[:, None, :]
    got = T.gpu_rope_tail(x, rope_dim, pos, inv_freq, inverse)
    assert np.abs(got - ref).max() <= 1e-5


def attention_reference(q: np.ndarray, kv: np.ndarray, rows: np.ndarray, sinks: np.ndarray) -> tuple:
    """float64 sink attention of one lane q [heads, dim] over kv[rows]: (out, the size sum p |k|)."""
    k = kv[rows].astype(np.float64)
    logits = q.astype(np.float64) @ k.T / np.sqrt(q.shape[1])
    mx = np.maximum(sinks[:, None].astype(np.float64), logits).max(axis=1, initial=-np.inf, keepdims=True)
    e = np.exp(logits - mx)
    p = e / (np.exp(sinks[:, None] - mx) + e.sum(axis=1, keepdims=True))
    return p @ k, max(1.0, np.abs(p @ np.abs(k)).max())


def attention_case(counts: list[int], n_head: int = 8, head_dim: int = 512, rows: int = 3000) -> tuple:
    """Random lanes for the split attention, DS4's head shape by default: q [lanes, heads, dim], f16 key
    rows kv, each lane's gathered rows (key_rows, key_off) and the sinks."""
    rng = np.random.default_rng()
    kv = (rng.standard_normal((rows, head_dim)) * 0.5).astype(np.float16)
    key_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    key_rows = rng.integers(0, rows, key_off[-1]).astype(np.int32)
    q = rng.standard_normal((len(counts), n_head, head_dim)).astype(np.float32)
    sinks = rng.standard_normal(n_head).astype(np.float32)
    return q, kv, key_rows, key_off, sinks


@pytest.mark.gpu
@pytest.mark.parametrize("n_head, head_dim, counts", [
    (4, 128, [0, 1, 130, 300]),
    # one split (<= 64 keys), several of 64 (65, 128, 512), then at most 8 longer ones (513, 640, 4000)
    (8, 512, [1, 64, 65, 128, 512, 513, 640, 4000]),
    (6, 64, [63, 200, 1000]),  # head groups of 4 and 2 in one launch
], ids=["small", "ds4-dim", "odd-heads"])
def test_attention_sink_matches_float64(n_head: int, head_dim: int, counts: list[int]) -> None:
    """The split attention (each lane's keys over up to 8 blocks, merged with the sink by a second
    kernel; the engine's paged attention runs the same block code) within 2e-3 of float64."""
    rng = np.random.default_rng()
    rows = 5000
    kv = (rng.standard_normal((rows, head_dim)) * 0.5).astype(np.float16)
    key_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    key_rows = rng.integers(0, rows, key_off[-1]).astype(np.int32)
    q = rng.standard_normal((len(counts), n_head, head_dim)).astype(np.float32)
    sinks = rng.standard_normal(n_head).astype(np.float32)
    got = T.gpu_attention_sink(q, kv, key_rows, key_off, sinks)
    for i in range(len(counts)):
        ref, size = attention_reference(q[i], kv, key_rows[key_off[i] : key_off[i + 1]], sinks)
        assert np.abs(got[i] - ref).max() <= 2e-3 * size, (counts[i], np.abs(got[i] - ref).max() / size)


@pytest.mark.gpu
def test_attention_lane_bits_do_not_depend_on_its_neighbours() -> None:
    """Batch invariance of the split attention: a lane's output is the same bits computed alone (two
    heads a block, splits sized by its own keys) and beside lanes of other lengths (four heads a
    block, a larger grid and shared-memory bound), and the same call twice gives the same bits."""
    counts = [700, 3, 130, 64, 2500]
    q, kv, key_rows, key_off, sinks = attention_case(counts)
    together = T.gpu_attention_sink(q, kv, key_rows, key_off, sinks)
    again = T.gpu_attention_sink(q, kv, key_rows, key_off, sinks)
    assert np.array_equal(together.view(np.uint32), again.view(np.uint32))
    for i, c in enumerate(counts):
        own = key_rows[key_off[i] : key_off[i + 1]]
        alone = T.gpu_attention_sink(q[i : i + 1], kv, own, np.array([0, c], np.int32), sinks)
        assert np.array_equal(alone[0].view(np.uint32), together[i].view(np.uint32)), c
    pair = T.gpu_attention_sink(q[[4, 1]], kv, np.concatenate([key_rows[key_off[4] :], key_rows[key_off[1] : key_off[2]]]),
                                np.array([0, counts[4], counts[4] + counts[1]], np.int32), sinks)
    assert np.array_equal(pair[0].view(np.uint32), together[4].view(np.uint32))


@pytest.mark.gpu
def test_attention_split_min_keeps_the_contracts() -> None:
    """The fewest keys a split, a measurement setting (8..256 in steps of 8): at 8, 16, 32 and 128 each
    lane stays within 2e-3 of float64 and the same bits alone as beside others. 16 keys a split changes
    the bits of lanes the default splits otherwise, -1 gives the default's back, and a count that is not
    a multiple of 8 in range is refused."""
    counts = [1, 9, 40, 130, 300, 700, 2500]
    q, kv, key_rows, key_off, sinks = attention_case(counts)
    got = {}
    try:
        for keys in (-1, 8, 16, 32, 128, -1):
            assert T.gpu_set_attn_split_min(keys) == (64 if keys < 0 else keys)
            together = T.gpu_attention_sink(q, kv, key_rows, key_off, sinks)
            for i, c in enumerate(counts):
                own = key_rows[key_off[i] : key_off[i + 1]]
                ref, size = attention_reference(q[i], kv, own, sinks)
                assert np.abs(together[i] - ref).max() <= 2e-3 * size, (keys, c)
                alone = T.gpu_attention_sink(q[i : i + 1], kv, own, np.array([0, c], np.int32), sinks)
                assert np.array_equal(alone[0].view(np.uint32), together[i].view(np.uint32)), (keys, c)
            if keys in got:
                assert np.array_equal(got[keys].view(np.uint32), together.view(np.uint32)), "-1 is the default"
            got[keys] = together
        # 40 and 130 keys: one and three splits of 64 against three and eight of 16 and 17
        for i in (2, 3):
            assert not np.array_equal(got[-1][i].view(np.uint32), got[16][i].view(np.uint32)), counts[i]
        for bad in (0, 4, 12, 264):
            with pytest.raises(ValueError, match="keys a split"):
                T.gpu_set_attn_split_min(bad)
    finally:
        T.gpu_set_attn_split_min(-1)


@pytest.mark.gpu
def test_attention_heads_a_block_change_no_bits() -> None:
    """One, two and four heads a split block and the rule, at one lane and at three: the same bits."""
    counts = [700, 3, 130]
    q, kv, key_rows, key_off, sinks = attention_case(counts)
    out = {}
    try:
        for heads in (-1, 1, 2, 4):
            assert T.gpu_set_attn_heads(heads) == max(heads, 0)
            one = T.gpu_attention_sink(q[:1], kv, key_rows[: counts[0]], key_off[:2], sinks)
            out[heads] = (one, T.gpu_attention_sink(q, kv, key_rows, key_off, sinks))
        for heads in (1, 2, 4):
            for a, b in zip(out[-1], out[heads]):
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), heads
        with pytest.raises(ValueError, match="heads a block"):
            T.gpu_set_attn_heads(3)
    finally:
        T.gpu_set_attn_heads(-1)


@pytest.mark.gpu
def test_argmax_takes_the_first_maximum() -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 129280)).astype(np.float32)
    x[0, [17, 90000]] = 9.0
    x[1, 5] = np.nan
    x[2, :] = -1.0
    assert np.array_equal(T.gpu_argmax(x), np.argmax(x, axis=1).astype(np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("n_expert, k", [(8, 2), (256, 6), (300, 8), (1500, 6)], ids=["tiny", "ds4", "r32", "r128"])
def test_router_picks_the_reference_experts(n_expert: int, k: int) -> None:
    """The biased top-k router against the numpy reference (reference/moe.py route: the top k of
    sqrt(softplus(l)) + bias, ties to the lower id, in descending order; weights from the unbiased
    scores, renormalized, scaled): random logits and bias, lanes with exact ties (equal logits and bias
    in several experts, some of them across the lanes' registers), and lanes whose scores are all
    equal."""
    from ds4_app.engine.reference.moe import route

    rng = np.random.default_rng(n_expert)
    n = 8
    logits = rng.standard_normal((n, n_expert)).astype(np.float32)
    bias = (rng.standard_normal(n_expert) * 0.1).astype(np.float32)
    bias[: n_expert // 2] = bias[0]  # many equal biases, so equal logits tie exactly
    logits[1, [0, 3, n_expert // 2 - 1]] = 5.0
    logits[2, :] = 1.0
    logits[3, : n_expert // 2] = logits[3, 0]
    ids, w = T.gpu_route(logits, bias, k, True, 1.5)
    for i in range(n):
        want_ids, want_w = route(logits[i], np.eye(n_expert, dtype=np.float32), n_used=k, bias=bias, scale=1.5)
        assert np.array_equal(ids[i], want_ids.astype(np.int32)), i
        assert np.allclose(w[i], want_w, rtol=2e-6, atol=0), i


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 5, 2047, 2048, 2049, 4097, 65536, 129280])
def test_argmax_across_its_splits(n: int) -> None:
    """Rows cut into several splits (at least 2048 elements each, at most 64): the maximum in any split,
    equal maxima in two splits (the first wins), a NaN after a larger value and a NaN before another
    NaN (the first NaN wins), a row of -inf and one of -0.0 / +0.0 ties, against numpy's argmax."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((8, n)).astype(np.float32)
    last = n - 1
    x[0, last] = 50.0
    x[1, [last // 3, last]] = 40.0
    x[2, 0] = 60.0
    x[2, last] = np.nan
    x[3, [last // 2, last]] = np.nan
    x[4, :] = -np.inf
    x[5, :] = -0.0
    x[5, last] = 0.0
    x[6, rng.integers(0, n, 3)] = 7.0
    assert np.array_equal(T.gpu_argmax(x), np.argmax(x, axis=1).astype(np.int32))


# --- the per-lane step kernels at DS4's shapes, inside the engine -------------------------------------

LONG_CTX = 4096
LONG_PROMPT = 2560  # CSA: 640 visible entries > top-k 600, so 728 keys (splits of 91); HCA 148 keys


def long_context_config():
    """tiny() with DS4's attention and indexer shapes: 8 heads of 512 (64-element RoPE tail), an
    indexer of 64 heads of 128 (the kernel's heads-over-lanes path with two heads a lane), top-k 600,
    one CSA and one HCA layer."""
    import dataclasses

    from ds4_app.engine.presets import tiny

    return dataclasses.replace(tiny(), n_layer=2, n_head=8, head_dim=512, compress_ratios=(4, 128),
                               index_n_heads=64, index_head_dim=128, index_topk=600,
                               swiglu_clamp_exp=(10.0,) * 2, swiglu_clamp_shexp=(10.0,) * 2)


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """The CPU engine fed LONG_PROMPT tokens in slot 0 (16 rows a step), a GPU engine beside it."""
    from ds4_app.engine.gguf_file import ModelFile
    from ds4_app.engine.memory import plan_memory
    from ds4_app.engine.plan import StepPlan
    from ds4_app.engine.synth import synthesize
    from tests.engine_cases import tensor_entries

    path = tmp_path_factory.mktemp("gpu_kernels") / "long.gguf"
    synthesize(long_context_config(), path, seed=21)
    mf = ModelFile.open(path)
    n_pages = plan_memory(mf.config, max_slots=4, max_ctx=LONG_CTX).n_pages
    kw = dict(max_slots=4, max_ctx=LONG_CTX, n_pages=n_pages, max_rows=16)
    cpu = native.Engine(mf.config, str(mf.path), tensor_entries(mf), n_threads=4, **kw)
    gpu = native.GpuEngine(mf.config, str(mf.path), tensor_entries(mf), **kw)
    blocks = LONG_CTX // 128
    table = list(range(blocks))  # slot 0: pages 0..31
    tokens = np.random.default_rng(3).integers(0, mf.config.n_vocab, LONG_PROMPT + 8)
    for t0 in range(0, LONG_PROMPT, 16):
        lanes = [(0, int(tokens[t]), t, t == LONG_PROMPT - 1) for t in range(t0, min(t0 + 16, LONG_PROMPT))]
        cpu.step(StepPlan.build(lanes, {0: table}, blocks))
    return dict(cpu=cpu, gpu=gpu, table=table, tokens=tokens, blocks=blocks, fed=LONG_PROMPT)


@pytest.mark.gpu
def test_long_context_steps_match_the_cpu_engine(long_context) -> None:
    """Decode steps at context 2560 from the CPU's state: the split attention with its longest splits
    (728 keys), the indexer's heads-over-lanes kernel at 64 x 128 with a real top-k, and the fused
    mHC pre + RMSNorm, within 2e-3 of the CPU engine's logits."""
    from ds4_app.engine.plan import StepPlan

    c = long_context
    cpu, gpu, table, tokens, blocks = c["cpu"], c["gpu"], c["table"], c["tokens"], c["blocks"]
    gpu.use_graphs = False
    for _ in range(6):
        t = c["fed"]
        native._testing.gpu_sync_slot(cpu, gpu, 0, np.asarray(table, np.int32), t)
        plan = StepPlan.build([(0, int(tokens[t]), t, True)], {0: table}, blocks)
        want, got = cpu.step(plan)[0].astype(np.float64), gpu.step(plan)[0].astype(np.float64)
        c["fed"] = t + 1  # the CPU engine's slot 0 has taken token t
        assert np.isfinite(got).all()
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= 2e-3, (t, err)


@pytest.mark.gpu
def test_long_context_lane_is_batch_invariant(long_context) -> None:
    """A long lane's logits are the same bits alone (two heads an attention block) and beside short
    lanes of other slots (four heads a block, other split grids and indexer grids), eager and from a
    CUDA graph."""
    from ds4_app.engine.plan import StepPlan

    c = long_context
    cpu, gpu, table, tokens, blocks = c["cpu"], c["gpu"], c["table"], c["tokens"], c["blocks"]
    t = c["fed"]  # the GPU slot takes the CPU's state after t tokens before each step
    native._testing.gpu_sync_slot(cpu, gpu, 0, np.asarray(table, np.int32), t)
    long_lane = (0, int(tokens[t]), t, True)
    tables = {0: table, 1: [40], 2: [41, 42]}
    results = []
    for graphs in (False, True):
        gpu.use_graphs = graphs
        for lanes in ([long_lane], [(1, 5, 0, True), long_lane, (2, 9, 0, True)]):
            for s in (1, 2):
                gpu.reset_slot(s)
            used = {s: tables[s] for s in {lane[0] for lane in lanes}}
            lg = gpu.step(StepPlan.build(lanes, used, blocks))
            results.append(lg[[lane[0] for lane in lanes].index(0)])
            # the step wrote ring rows and compressor state of slot 0 at position t: put the CPU's back
            native._testing.gpu_sync_slot(cpu, gpu, 0, np.asarray(table, np.int32), t)
    for r in results[1:]:
        assert np.array_equal(r.view(np.uint32), results[0].view(np.uint32))
