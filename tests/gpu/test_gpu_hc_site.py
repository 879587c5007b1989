"""The fused mHC site (ext/gpu/step_ops.h hc_site, then hc_comb; GPU pass 17).

Two kernels run the post of the sublayer that ends at a site (X[k] = post_k y + sum_j comb[j][k]
X[j]), the site's projection mix = fn . x̂ with rho, and the site's mHC pre with its RMSNorm, and a
third the Sinkhorn, instead of hc_post, the projection's matvec and hc_mix. The projection and rho
add in an order of their own, so the bits differ from the three launches' (the engine's
``use_hc_fused`` switch); each setting must be exact against the numpy reference within fp32
rounding, and batch invariant on its own (decode rows and prompt rows take different block shapes
with the same arithmetic a row).

The sums kernel takes one or two streams a thread (``gpu_set_hc_site_streams``, a process-wide
measurement setting; GPU pass 39): two add each thread's pair of products and squares before the warp
sums, so the bits differ from one's, and each setting must hold every contract above on its own.

Marked ``gpu``. Hooks (``_testing``): ``gpu_hc_site(X, Y, post, comb, fn_type, fn_raw, scale, base,
iters, hc_eps, norm_eps, norm_w) -> (X, U, post, comb)``; ``gpu_set_hc_site_streams(n) -> n`` (1 or 2,
-1 the default, 2).
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4_app.engine.reference.mhc import hc_post, hc_pre

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing
pytestmark = pytest.mark.gpu

F32, F16, BF16 = 0, 1, 30
HC, MIX, ITERS, HC_EPS, NORM_EPS = 4, 24, 20, 1e-6, 1e-6


def fn_of(rng, d: int, ggml_type: int):
    """A [24, 4 d] projection in ggml_type: (its raw bytes, its float32 values)."""
    w = (rng.standard_normal((MIX, HC * d)) / np.sqrt(HC * d)).astype(np.float32)
    if ggml_type == F16:
        h = w.astype(np.float16)
        return h.view(np.uint8).ravel(), h.astype(np.float32)
    if ggml_type == BF16:
        bits = ((w.view(np.uint32) + 0x8000) >> 16).astype(np.uint16)
        return bits.view(np.uint8).ravel(), (bits.astype(np.uint32) << 16).view(np.float32)
    return w.view(np.uint8).ravel(), w


def site_inputs(rng, n: int, d: int):
    x = rng.standard_normal((n, HC, d)).astype(np.float32)
    y = rng.standard_normal((n, d)).astype(np.float32)
    post = (2.0 / (1.0 + np.exp(-rng.standard_normal((n, HC))))).astype(np.float32)
    comb = rng.random((n, HC, HC)).astype(np.float32) + 0.1
    comb /= comb.sum(axis=1, keepdims=True)
    scale = np.array([0.5, 0.7, 1.3], dtype=np.float32)
    base = (0.1 * rng.standard_normal(MIX)).astype(np.float32)
    norm_w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    return x, y, post, comb, scale, base, norm_w


def reference(x, y, post, comb, fn, scale, base, norm_w):
    """hc_post (when y is given), then hc_pre and the site's RMSNorm, by the numpy reference."""
    if y is not None:
        x = hc_post(y, x, post, comb).astype(np.float32)
    u, p, c = hc_pre(x, fn, scale, base, norm_eps=NORM_EPS, hc_eps=HC_EPS, sinkhorn_iters=ITERS)
    u64 = u.astype(np.float64)
    r = 1.0 / np.sqrt(np.mean(u64 * u64, axis=-1, keepdims=True) + NORM_EPS)
    return x, (u64 * r * norm_w), p, c


@pytest.fixture(params=[1, 2], ids=["1stream", "2streams"])
def streams(request):
    """Each test under one and two streams a sums thread; the default again after it."""
    assert T.gpu_set_hc_site_streams(request.param) == request.param
    yield request.param
    assert T.gpu_set_hc_site_streams(-1) == 2


def rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("d,ggml_type", [(256, F16), (4096, F16), (512, BF16), (1024, F32)])
@pytest.mark.parametrize("with_post", [True, False])
def test_site_matches_the_reference(d, ggml_type, with_post, streams) -> None:
    rng = np.random.default_rng(d + ggml_type + with_post)
    x, y, post, comb, scale, base, norm_w = site_inputs(rng, 3, d)
    raw, fn = fn_of(rng, d, ggml_type)
    got_x, got_u, got_post, got_comb = T.gpu_hc_site(x, y if with_post else None, post, comb, ggml_type, raw, scale,
                                                     base, ITERS, HC_EPS, NORM_EPS, norm_w)
    want_x, want_u, want_post, want_comb = reference(x, y if with_post else None, post, comb, fn, scale, base, norm_w)
    if with_post:
        assert rel(got_x, want_x) < 1e-6
    else:
        assert np.array_equal(got_x, x)  # no post: the streams stay as they were
    assert rel(got_u, want_u) < 2e-5
    assert rel(got_post, want_post) < 2e-5
    assert rel(got_comb, want_comb) < 2e-5


@pytest.mark.parametrize("n,d", [(5, 4096), (70, 256)])
def test_site_is_batch_invariant(n, d, streams) -> None:
    """Each row of an n-row call has the bits of that row run alone (from 64 rows the sums kernel
    takes 8 rows a block)."""
    rng = np.random.default_rng(7)
    x, y, post, comb, scale, base, norm_w = site_inputs(rng, n, d)
    raw, _ = fn_of(rng, d, F16)
    together = T.gpu_hc_site(x, y, post, comb, F16, raw, scale, base, ITERS, HC_EPS, NORM_EPS, norm_w)
    for i in (0, 3, n - 1):
        alone = T.gpu_hc_site(x[i:i + 1], y[i:i + 1], post[i:i + 1], comb[i:i + 1], F16, raw, scale, base, ITERS,
                              HC_EPS, NORM_EPS, norm_w)
        for a, b in zip(together, alone):
            assert np.array_equal(a[i:i + 1].view(np.uint32), b.view(np.uint32))
    again = T.gpu_hc_site(x, y, post, comb, F16, raw, scale, base, ITERS, HC_EPS, NORM_EPS, norm_w)
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(together, again))


def test_site_streams_a_thread_change_the_sums_only() -> None:
    """Two streams a thread against one: the streams after the post are the same bits (hc_post_one
    either way); U, post and comb's logits differ in their last bits (the sums' order) and stay within
    fp32 rounding of each other. A count other than 1, 2 or -1 is refused and leaves the setting."""
    rng = np.random.default_rng(5)
    x, y, post, comb, scale, base, norm_w = site_inputs(rng, 70, 4096)
    raw, _ = fn_of(rng, 4096, F16)
    out = {}
    try:
        for sp in (1, 2):
            assert T.gpu_set_hc_site_streams(sp) == sp
            out[sp] = T.gpu_hc_site(x, y, post, comb, F16, raw, scale, base, ITERS, HC_EPS, NORM_EPS, norm_w)
        with pytest.raises(ValueError):
            T.gpu_set_hc_site_streams(4)
        # still two streams a thread: the same bits as the two-stream call before the refusal
        again = T.gpu_hc_site(x, y, post, comb, F16, raw, scale, base, ITERS, HC_EPS, NORM_EPS, norm_w)
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(again, out[2]))
    finally:
        assert T.gpu_set_hc_site_streams(-1) == 2
    (x1, u1, p1, c1), (x2, u2, p2, c2) = out[1], out[2]
    assert np.array_equal(x1.view(np.uint32), x2.view(np.uint32))
    assert not np.array_equal(u1.view(np.uint32), u2.view(np.uint32))
    for a, b in ((u1, u2), (p1, p2), (c1, c2)):
        assert rel(a, b.astype(np.float64)) < 2e-5


def test_site_rejects_what_it_cannot_take() -> None:
    rng = np.random.default_rng(1)
    x, y, post, comb, scale, base, norm_w = site_inputs(rng, 1, 48)  # 48 % 32 != 0
    raw, _ = fn_of(rng, 48, F16)
    with pytest.raises(ValueError):
        T.gpu_hc_site(x, y, post, comb, F16, raw, scale, base, ITERS, HC_EPS, NORM_EPS, norm_w)


@pytest.fixture(scope="module")
def tiny_gpu(tmp_path_factory):
    from tests.gpu.test_gpu_engine import synth_tiny_gpu

    return synth_tiny_gpu(tmp_path_factory, 11, max_slots=2, max_rows=40)


def test_engine_fused_sites_against_the_three_launches(tiny_gpu) -> None:
    """The engine's logits with the one-launch sites: within fp32 rounding of the three launches',
    the same bits eager and under graphs (the switch is part of the graph key), packed and decode."""
    from tests.engine_cases import Seq, prompt, run

    mf, gpu = tiny_gpu
    seqs = [Seq(prompt(mf, 3, 30), slot=0, pages=[1, 2], rows=7), Seq(prompt(mf, 4, 9), slot=1, pages=[3, 5], rows=1)]

    def under(fused: bool, graphs: bool):
        gpu.use_hc_fused = fused
        gpu.use_graphs = graphs
        gpu.reset_slot(0)
        gpu.reset_slot(1)
        return run(gpu, seqs)

    graphs_before = gpu.use_graphs
    try:
        assert gpu.use_hc_fused is True  # the default
        three = under(False, False)
        fused = under(True, False)
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(fused, under(True, True)))
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(three, under(False, True)))
        for a, b in zip(fused, three):
            assert rel(a, b.astype(np.float64)) < 1e-3
        assert not all(np.array_equal(a, b) for a, b in zip(fused, three))  # the switch does change the launches
    finally:
        gpu.use_hc_fused = True
        gpu.use_graphs = graphs_before


def test_engine_head_site_for_some_logit_lanes(tiny_gpu) -> None:
    """Prompt chunks where only each chunk's last row asks for logits (the head's site runs those
    lanes only): their logits are the bits of the same rows when every row asks, eager and under
    graphs, and within fp32 rounding of the three-launch sites."""
    from ds4_app.engine.plan import StepPlan
    from tests.engine_cases import PAGES_PER_SEQ, prompt

    mf, gpu = tiny_gpu
    tokens = prompt(mf, 12, 28)

    def chunks(last_only: bool, fused: bool, graphs: bool):
        gpu.use_hc_fused = fused
        gpu.use_graphs = graphs
        gpu.reset_slot(0)
        out = []
        for start in range(0, len(tokens), 7):
            rows = range(start, min(len(tokens), start + 7))
            lanes = [(0, int(tokens[k]), k, (not last_only) or k == rows[-1]) for k in rows]
            logits = gpu.step(StepPlan.build(lanes, {0: [1, 2]}, PAGES_PER_SEQ))
            out.append(logits[-1].copy())
        return out

    graphs_before = gpu.use_graphs
    try:
        every = chunks(False, True, False)
        for graphs in (False, True):
            some = chunks(True, True, graphs)
            assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(some, every)), graphs
        three = chunks(True, False, False)
        for a, b in zip(every, three):
            assert rel(a, b.astype(np.float64)) < 1e-3
    finally:
        gpu.use_hc_fused = True
        gpu.use_graphs = graphs_before
