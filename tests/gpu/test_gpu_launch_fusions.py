"""Launch fusions that keep the bits (GPU pass 18): the fused router and q_heads in the attention.

The fused router (ext/gpu/ds4_gpu.h router_route): one launch computes the router's product, and
its last block to finish routes every lane and sorts the (lane, selection) pairs into the grouped
expert products' parts, the work of matvec, route and build_expert_parts. It must write their
bytes: the logits bit for bit as the matvec's, the ids and weights as the route kernel's, the parts
as a stable sort by expert, after any number of launches (each leaves its block counter zero).

q_heads in the attention (step_ops.h AttentionLaunch::q_raw): each split block applies the per-head
RMSNorm and tail RoPE to its heads of q in shared memory instead of a q_heads launch before it.

In the engine (``use_route_fused``, ``use_attn_q_fused``) each switch on must give the logits of
both off, eager and under graphs, on steps the fusions take (the engine runs the fused router up to
4 lanes and q_heads in the attention up to 2) and steps they do not, over tiny's hash-routed layer,
its top-k layers and its CSA layer past the indexer's top-k.

Marked ``gpu``. Hook (``_testing``): ``gpu_router_route(w_type, w_raw, X, bias, k, tokens,
tid2eid=None, norm=True, scale=1.0, max_part=8, repeat=1) -> (logits, ids, weights, sorted, parts)``
or None where the fused router does not take the shape; ``gpu_expert_parts(pair_expert, n_expert,
max_part=8) -> (sorted, parts)``, build_expert_parts alone.
"""

from __future__ import annotations

import numpy as np
import pytest

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing
pytestmark = pytest.mark.gpu

F32, F16, BF16 = 0, 1, 30


def router_of(rng, d: int, e: int, ggml_type: int):
    """A [d, e] router in ggml_type: its raw bytes."""
    w = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    if ggml_type == F16:
        return w.astype(np.float16).view(np.uint8).ravel()
    if ggml_type == BF16:
        return ((w.view(np.uint32) + 0x8000) >> 16).astype(np.uint16).view(np.uint8).ravel()
    return w.view(np.uint8).ravel()


def parts_of(ids: np.ndarray, n_expert: int, max_part: int):
    """(sorted pairs, parts [expert, first, count]) by a stable sort of the pairs by expert."""
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable").astype(np.int32)
    parts = []
    first = 0
    for e in range(n_expert):
        count = int(np.sum(flat == e))
        for c0 in range(0, count, max_part):
            parts.append((e, first + c0, min(max_part, count - c0)))
        first += count
    return order, np.array(parts, dtype=np.int32).reshape(-1, 3)


# (pairs, experts, max_part): one chunk of build_parts_kernel's 256 threads; the chunk edges; a
# 2048-row prompt step of flash-l4 (12,288 pairs over 256 experts); three experts, long runs (these
# with the warps' count table); then experts too many for the table (the walk of the chunk), up to
# 4096 (51 KB of shared memory, past the 48 KB a launch gets without asking).
PARTS = [(40, 256, 8), (255, 16, 8), (256, 16, 3), (257, 16, 8), (12288, 256, 8), (5000, 3, 8), (3000, 1500, 8),
         (700, 4096, 4)]


@pytest.mark.parametrize("n_pairs, n_expert, max_part", PARTS, ids=[f"{p}p-{e}e-{m}" for p, e, m in PARTS])
def test_build_parts_is_a_stable_sort_by_expert(n_pairs: int, n_expert: int, max_part: int) -> None:
    """build_expert_parts (routing.cuh build_parts_block, which ranks the pairs a chunk of its
    threads at a time since pass 21) writes a stable sort by expert: the sorted pairs and the parts
    of parts_of, over skewed counts, with invalid experts (-1, n_expert) left out of every part and
    the sorted list's tail untouched."""
    rng = np.random.default_rng(n_pairs)
    pe = (rng.zipf(1.3, n_pairs) % n_expert).astype(np.int32)
    pe[::97] = -1
    pe[5::101] = n_expert
    order, parts = T.gpu_expert_parts(pe, n_expert, max_part)
    valid = (pe >= 0) & (pe < n_expert)
    want_order, want_parts = parts_of(np.where(valid, pe, n_expert), n_expert, max_part)
    n_valid = int(valid.sum())
    assert np.array_equal(order[:n_valid], want_order[:n_valid])
    assert np.all(order[n_valid:] == -1)
    assert np.array_equal(parts, want_parts)


@pytest.mark.parametrize("ggml_type", [F16, BF16, F32])
@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_fused_router_writes_the_three_launches_bytes(ggml_type: int, n: int) -> None:
    """Logits bit for bit as the matvec's, ids and weights as the route kernel's, parts as a stable
    sort; the same after three launches in a row (the counter each leaves zero); with several lanes
    choosing one expert, so that parts hold more than one pair and some are split at max_part."""
    rng = np.random.default_rng(100 * n + ggml_type)
    d, e, k = 512, 256, 6
    raw = router_of(rng, d, e, ggml_type)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[1:] += 3.0 * x[0]  # lanes alike: shared experts
    bias = (0.1 * rng.standard_normal(e)).astype(np.float32)
    tokens = rng.integers(0, 100, n)
    logits, ids, w, order, parts = T.gpu_router_route(ggml_type, raw, x, bias, k, tokens, scale=1.5, max_part=2,
                                                       repeat=3)
    assert np.array_equal(logits.view(np.uint32), T.gpu_matmul(ggml_type, raw, d, e, x).view(np.uint32))
    want_ids, want_w = T.gpu_route(logits, bias, k, True, 1.5)
    assert np.array_equal(ids, want_ids)
    assert np.array_equal(w.view(np.uint32), want_w.view(np.uint32))
    want_order, want_parts = parts_of(ids, e, 2)
    assert np.array_equal(order, want_order)
    assert np.array_equal(parts, want_parts)
    if n > 2:
        assert parts[:, 2].max() == 2 and len(parts) < n * k  # shared and split parts were exercised


def test_fused_router_hash_layer() -> None:
    """A hash-routed layer: the ids are tid2eid's row of each token, the weights the renormalized
    sqrt(softplus) of those experts' logits (numpy, float64), the parts a stable sort."""
    rng = np.random.default_rng(7)
    d, e, k, n, vocab = 256, 8, 2, 6, 50
    raw = router_of(rng, d, e, F32)
    x = rng.standard_normal((n, d)).astype(np.float32)
    tid2eid = np.stack([rng.choice(e, k, replace=False) for _ in range(vocab)]).astype(np.int32)
    tokens = np.array([3, 3, 17, 0, 49, 3], dtype=np.int32)
    bias = np.zeros(e, dtype=np.float32)
    logits, ids, w, order, parts = T.gpu_router_route(F32, raw, x, bias, k, tokens, tid2eid=tid2eid, scale=1.5,
                                                       repeat=2)
    assert np.array_equal(ids, tid2eid[tokens])
    lg = logits.astype(np.float64)[np.arange(n)[:, None], ids]
    s = np.sqrt(np.log1p(np.exp(lg)))
    assert np.allclose(w, s / np.maximum(s.sum(axis=1, keepdims=True), 6.103515625e-5) * 1.5, rtol=3e-6, atol=0)
    want_order, want_parts = parts_of(ids, e, 8)
    assert np.array_equal(order, want_order)
    assert np.array_equal(parts, want_parts)


def test_fused_router_declines_what_it_does_not_take() -> None:
    """More than 8 lanes or 256 experts: None (the engine then runs the three launches)."""
    rng = np.random.default_rng(3)
    raw = router_of(rng, 256, 8, F32)
    assert T.gpu_router_route(F32, raw, np.ones((9, 256), np.float32), np.zeros(8, np.float32), 2, np.zeros(9)) is None
    raw = router_of(rng, 256, 260, F32)
    assert T.gpu_router_route(F32, raw, np.ones((1, 256), np.float32), np.zeros(260, np.float32), 2, [0]) is None


@pytest.fixture(scope="module")
def tiny_gpu(tmp_path_factory):
    from tests.gpu.test_gpu_engine import synth_tiny_gpu

    return synth_tiny_gpu(tmp_path_factory, 12, max_slots=4, max_rows=40)


@pytest.mark.parametrize("switch", ["use_route_fused", "use_attn_q_fused"])
def test_engine_fusion_changes_no_bit(tiny_gpu, switch: str) -> None:
    """The engine's logits with one fusion on and both off: the same bits, eager and under graphs
    (each switch is part of the graph key): steps of one and two decode lanes (both fusions run),
    prompts packed beside decode lanes and 12-row prompt chunks (neither runs)."""
    from tests.engine_cases import Seq, prompt, run

    mf, gpu = tiny_gpu
    seqs = [
        Seq(prompt(mf, 5, 60), slot=0, pages=[1, 2], rows=12),
        Seq(prompt(mf, 6, 9), slot=1, pages=[3, 5], rows=1),
        Seq(prompt(mf, 7, 14), slot=2, pages=[6, 7], rows=5, start=2),
        Seq(prompt(mf, 8, 6), slot=3, pages=[8, 9], rows=1, start=1),
    ]
    switches = ("use_route_fused", "use_attn_q_fused")

    def under(on: bool, graphs: bool):
        for name in switches:
            setattr(gpu, name, on and name == switch)
        gpu.use_graphs = graphs
        for s in range(4):
            gpu.reset_slot(s)
        return run(gpu, seqs)

    graphs_before = gpu.use_graphs
    try:
        assert all(getattr(gpu, name) is True for name in switches)  # the defaults
        off = under(False, False)
        for on, graphs in ((True, False), (True, True), (False, True)):
            got = under(on, graphs)
            assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(got, off)), (on, graphs)
    finally:
        for name in switches:
            setattr(gpu, name, True)
        gpu.use_graphs = graphs_before
