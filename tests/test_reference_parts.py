"""Unit tests of the numpy reference's parts against hand cases and independent formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ds4_app.engine import presets
from ds4_app.engine.reference import (
    attend_with_sink, compress_block, compressor_update, expert_ffn, fp4_roundtrip,
    fp8_e4m3_roundtrip, hadamard, hc_head, hc_post, hc_pre, indexer_scores, indexer_select,
    linear, new_compressor_state, pool_block, prompt_blocks, rms_norm, rope_rotate, round_e2m1,
    round_e4m3, round_f16, route, sinkhorn,
)

RNG = np.random.default_rng(1234)


def f32(a):
    return np.asarray(a, dtype=np.float32)


def sig(z):
    return 1.0 / (1.0 + np.exp(-z))


# --- numerics ---------------------------------------------------------------------------------

def test_linear_is_row_invariant():
    # the property that lets step and forward_prompt agree bit for bit
    w = f32(RNG.standard_normal((96, 200)))
    x = f32(RNG.standard_normal((37, 200)))
    y = linear(w, x)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)
    for r in range(37):
        assert np.array_equal(linear(w, x[r].copy()), y[r])


def test_rms_norm_weighted_and_unweighted():
    x = f32(RNG.standard_normal((3, 10)))
    w = f32(RNG.standard_normal(10))
    ref = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm(x, None, 1e-6), ref, rtol=1e-6)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), ref * w, rtol=1e-6)


def test_round_f16():
    x = f32([1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 65504.0, 1e-8])
    assert list(round_f16(x)) == [1.0, 1.0 + 2 ** -9, 65504.0, np.float32(np.float16(1e-8))]


def _e4m3_grid():
    vals, codes = [], []
    for e in range(16):
        for mnt in range(8):
            if e == 15 and mnt == 7:
                continue  # NaN in e4m3fn
            vals.append(mnt / 8 * 2.0 ** -6 if e == 0 else (1 + mnt / 8) * 2.0 ** (e - 7))
            codes.append(e * 8 + mnt)
    return np.array(vals), np.array(codes)


def _nearest_even(y, vals, codes):
    out = []
    for v in np.abs(y.astype(np.float64)):
        dist = np.abs(vals - v)
        best = np.nonzero(dist == dist.min())[0]
        pick = best[0] if len(best) == 1 else [b for b in best if codes[b] % 2 == 0][0]
        out.append(vals[pick])
    return np.sign(y) * np.array(out)


def test_e4m3_hand_cases():
    y = f32([448, 1.0625, 1.1875, 0.001, 2 ** -10, 3 * 2 ** -10, 300, -1.0625, 17, 0])
    want = [448, 1.0, 1.25, 2 ** -9, 0, 2 ** -8, 288, -1.0, 16, 0]
    assert round_e4m3(y).tolist() == want


def test_e4m3_matches_enumerated_grid():
    vals, codes = _e4m3_grid()
    mids = (vals[1:] + vals[:-1]) / 2  # exact ties
    y = f32(np.concatenate([RNG.uniform(-448, 448, 300), RNG.uniform(-2, 2, 300),
                            RNG.uniform(-0.02, 0.02, 200), mids, -mids]))
    np.testing.assert_array_equal(round_e4m3(y), _nearest_even(y, vals, codes))


def test_fp8_block_scale_and_blocks():
    # amax 448 -> scale 1; amax 1000 -> scale 4; each block of 64 has its own scale
    a = np.zeros(128, np.float32)
    a[0], a[1] = 448, 1.0625
    a[64], a[65], a[66] = 1000, 1.0625 * 4, 300 * 4
    out = fp8_e4m3_roundtrip(a, 64)
    assert out[0] == 448 and out[1] == 1.0
    assert out[64] == 1024 and out[65] == 4.0 and out[66] == 1152
    # all-zero block: amax floor 1e-4, values stay 0
    assert not fp8_e4m3_roundtrip(np.zeros(64, np.float32)).any()
    # a power-of-two amax/448 gives exactly that scale (ceil of an exact log2)
    b = np.zeros(64, np.float32)
    b[0], b[1] = 896, 2 * 1.1875
    assert fp8_e4m3_roundtrip(b).tolist()[:2] == [896, 2.5]


def test_fp4_hand_cases():
    y = f32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 5.5, -0.25, -2.5, 7, 0.2])
    assert round_e2m1(y).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 0, -2, 6, 0]
    blk = np.zeros(32, np.float32)
    blk[:8] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]
    assert fp4_roundtrip(blk).tolist()[:8] == [6, 0, 1, 1, 2, 2, 4, 4]
    blk[0] = 12  # amax/6 = 2 exactly -> scale 2
    assert fp4_roundtrip(blk)[[0, 7]].tolist() == [12, 4]
    blk[0] = 12.5  # amax/6 > 2 -> scale 4: 12.5/4 = 3.125 -> 3
    assert fp4_roundtrip(blk)[[0, 6, 7]].tolist() == [12, 4, 4]


def test_e2m1_matches_enumerated_grid():
    vals = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6.0])
    codes = np.arange(8)
    mids = (vals[1:] + vals[:-1]) / 2
    y = f32(np.concatenate([RNG.uniform(-6, 6, 500), mids, -mids]))
    np.testing.assert_array_equal(round_e2m1(y), _nearest_even(y, vals, codes))


def test_hadamard_is_natural_order_sylvester():
    n = 64
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)]) / math.sqrt(n)
    x = f32(RNG.standard_normal((5, n)))
    np.testing.assert_allclose(hadamard(x), x @ h.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hadamard(hadamard(x)), x, rtol=1e-5, atol=1e-6)


# --- mHC --------------------------------------------------------------------------------------

@pytest.mark.parametrize("spread,iters", [(0.5, 20), (2.0, 400)])
def test_sinkhorn_doubly_stochastic(spread, iters):
    # 20 passes (the model's count) converge for moderate logits; peaked ones need more passes
    c = sinkhorn(f32(spread * RNG.standard_normal((50, 4, 4))), iters, 1e-6)
    assert (c > 0).all()
    np.testing.assert_allclose(c.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(c.sum(-2), 1.0, atol=1e-5)


def test_sinkhorn_exact_sequence():
    c0 = 2.0 * RNG.standard_normal((4, 4))
    eps = 1e-3  # large, so a misplaced eps shows

    def manual(iters):
        c = np.exp(c0 - c0.max(1, keepdims=True))
        c = c / c.sum(1, keepdims=True) + eps
        c = c / (c.sum(0, keepdims=True) + eps)
        for _ in range(iters - 1):
            c = c / (c.sum(1, keepdims=True) + eps)
            c = c / (c.sum(0, keepdims=True) + eps)
        return c

    for iters in (1, 2, 5):
        np.testing.assert_allclose(sinkhorn(f32(c0), iters, eps), manual(iters), rtol=1e-5)
    assert not np.allclose(sinkhorn(f32(c0), 2, eps), manual(3), rtol=1e-5)


def test_hc_post_new_stream_k_uses_column_k():
    d = 6
    x = f32(RNG.standard_normal((4, d)))
    y = f32(RNG.standard_normal(d))
    post = f32([0.5, 1.0, 1.5, 0.25])
    perm = np.zeros((4, 4), np.float32)
    for j in range(4):
        perm[j, (j + 1) % 4] = 1.0  # C[j, k] = 1 for k = j + 1
    out = hc_post(y, x, post, perm)
    for k in range(4):
        np.testing.assert_allclose(out[k], post[k] * y + x[(k - 1) % 4], rtol=1e-6)
    transposed = post[:, None] * y + perm @ x
    assert not np.allclose(out, transposed)


def _hc_inputs(n=4, d=8, lead=(3,)):
    x = RNG.standard_normal(lead + (n, d))
    fn = RNG.standard_normal(((2 + n) * n, n * d)) / math.sqrt(n * d)
    scale = 1 + 0.2 * RNG.standard_normal(3)
    base = 0.5 * RNG.standard_normal((2 + n) * n)
    return x, fn, scale, base


def test_hc_pre_matches_formula():
    x, fn, scale, base = _hc_inputs()
    u, post, comb = hc_pre(f32(x), f32(fn), f32(scale), f32(base), norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    for b in range(x.shape[0]):
        flat = x[b].reshape(-1)
        mix = (fn @ flat) / math.sqrt(np.mean(flat ** 2) + 1e-6)
        pre = sig(scale[0] * mix[:4] + base[:4]) + 1e-6
        np.testing.assert_allclose(post[b], 2 * sig(scale[1] * mix[4:8] + base[4:8]), rtol=1e-5)
        np.testing.assert_allclose(u[b], pre @ x[b], rtol=1e-5, atol=1e-6)
        c0 = (scale[2] * mix[8:] + base[8:]).reshape(4, 4)
        np.testing.assert_allclose(comb[b], sinkhorn(f32(c0), 20, 1e-6), rtol=1e-5, atol=1e-7)


def test_hc_head_matches_formula():
    x, fn, scale, base = _hc_inputs()
    fn, scale, base = fn[:4], scale[:1], base[:4]
    h = hc_head(f32(x), f32(fn), f32(scale), f32(base))
    for b in range(x.shape[0]):
        flat = x[b].reshape(-1)
        w = sig(scale[0] * (fn @ flat) / math.sqrt(np.mean(flat ** 2) + 1e-6) + base) + 1e-6
        np.testing.assert_allclose(h[b], w @ x[b], rtol=1e-5, atol=1e-6)


# --- RoPE -------------------------------------------------------------------------------------

def test_rope_interleaved_pairs_hand_checked():
    x = f32([9, 9, 9, 9, 1, 2, 3, 4])
    inv = [0.5, 0.25]
    out = rope_rotate(x, 3, inv)
    a0, a1 = 1.5, 0.75
    want = [9, 9, 9, 9, 1 * math.cos(a0) - 2 * math.sin(a0), 1 * math.sin(a0) + 2 * math.cos(a0),
            3 * math.cos(a1) - 4 * math.sin(a1), 3 * math.sin(a1) + 4 * math.cos(a1)]
    np.testing.assert_allclose(out, want, rtol=1e-6)
    # rotate-half (NeoX) pairing (4,6), (5,7) gives something else
    neox = [9, 9, 9, 9, 1 * math.cos(a0) - 3 * math.sin(a0), 2 * math.cos(a1) - 4 * math.sin(a1),
            1 * math.sin(a0) + 3 * math.cos(a0), 2 * math.sin(a1) + 4 * math.cos(a1)]
    assert not np.allclose(out, neox)


def test_rope_inverse_undoes_rotation_and_broadcasts_positions():
    inv = presets.tiny().rope(1).inv_freqs(64)
    x = f32(RNG.standard_normal((5, 3, 128)))
    pos = np.array([0, 1, 127, 4096, 1000000])[:, None]
    y = rope_rotate(x, pos, inv)
    np.testing.assert_array_equal(y[..., :64], x[..., :64])
    np.testing.assert_allclose(rope_rotate(y, pos, inv, inverse=True), x, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[0], x[0])  # position 0 is the identity
    np.testing.assert_array_equal(y[3, 1], rope_rotate(x[3, 1], 4096, inv))


def test_yarn_frequencies():
    cfg = presets.tiny()
    plain = np.array(cfg.rope(0).inv_freqs(64))  # ratio 0: base 10000, no YaRN
    theta = 10000.0 ** (-2.0 * np.arange(32) / 64)
    np.testing.assert_allclose(plain, theta, rtol=1e-12)
    yarn = np.array(cfg.rope(1).inv_freqs(64))  # ratio 4: base 160000 + YaRN, ramp 15..25
    theta = 160000.0 ** (-2.0 * np.arange(32) / 64)
    np.testing.assert_allclose(yarn[:16], theta[:16], rtol=1e-12)
    np.testing.assert_allclose(yarn[25:], theta[25:] / 16, rtol=1e-12)
    np.testing.assert_allclose(yarn[20], 0.5 * theta[20] + 0.5 * theta[20] / 16, rtol=1e-12)
    np.testing.assert_allclose(yarn[17], 0.8 * theta[17] + 0.2 * theta[17] / 16, rtol=1e-12)
    assert np.array_equal(np.array(cfg.rope(2).inv_freqs(64)), yarn)  # HCA uses the same table


# --- compressor -------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [4, 128])
def test_compressor_emits_exactly_at_block_end(m):
    c = 8
    kv_s, sc_s = new_compressor_state(m, c)
    coff = 2 if m == 4 else 1
    emitted = []
    for t in range(3 * m + 3):
        out = compressor_update(kv_s, sc_s, f32(RNG.standard_normal(coff * c)),
                                f32(RNG.standard_normal(coff * c)), t, m)
        if out is not None:
            emitted.append(t)
            assert out[0].shape == ((2 * m if m == 4 else m), c)
    assert emitted == [t for t in range(3 * m + 3) if (t + 1) % m == 0]


def test_csa_overlap_halves_and_block0():
    m, c = 4, 3
    kv_s, sc_s = new_compressor_state(m, c)
    kv_s[:] = 7.0  # garbage in the "previous" slots must not matter for block 0
    sc_s[:] = 5.0
    k = np.array([[100 * t + ch for ch in range(2 * c)] for t in range(12)], np.float32)
    z = -k / 1000
    cands = {}
    for t in range(12):
        out = compressor_update(kv_s, sc_s, k[t], z[t], t, m)
        if out is not None:
            cands[t // m] = out
    kv0, sc0 = cands[0]
    assert not kv0[:m].any() and np.isneginf(sc0[:m]).all()
    np.testing.assert_array_equal(kv0[m:], k[0:4, c:])
    for j in (1, 2):
        kvj, scj = cands[j]
        np.testing.assert_array_equal(kvj[:m], k[(j - 1) * m:j * m, :c])  # previous block, channels [0:c]
        np.testing.assert_array_equal(kvj[m:], k[j * m:(j + 1) * m, c:])  # current block, channels [c:2c]
        np.testing.assert_array_equal(scj[:m], z[(j - 1) * m:j * m, :c])
    # block 0's previous half has weight 0 in the pooling
    p = pool_block(kv0, sc0)
    zc = z[0:4, c:].astype(np.float64)
    wts = np.exp(zc - zc.max(0)) / np.exp(zc - zc.max(0)).sum(0)
    np.testing.assert_allclose(p, (wts * k[0:4, c:]).sum(0), rtol=1e-6)


@pytest.mark.parametrize("m", [4, 128])
def test_prompt_blocks_equal_incremental_candidates(m):
    c = 5
    coff = 2 if m == 4 else 1
    n = 2 * m + 3
    k = f32(RNG.standard_normal((n, coff * c)))
    z = f32(RNG.standard_normal((n, coff * c)))
    ck, cz = prompt_blocks(k, z, m)
    assert ck.shape[0] == n // m
    kv_s, sc_s = new_compressor_state(m, c)
    j = 0
    for t in range(n):
        out = compressor_update(kv_s, sc_s, k[t], z[t], t, m)
        if out is not None:
            np.testing.assert_array_equal(out[0], ck[j])
            np.testing.assert_array_equal(out[1], cz[j])
            j += 1
    assert j == n // m


def test_compress_block_pools_per_channel_then_norms_then_ropes_at_block_start():
    m, c = 4, 8
    inv = [0.3, 0.1]
    kv = RNG.standard_normal((2 * m, c))
    sc = RNG.standard_normal((2 * m, c))
    w = 1 + 0.1 * RNG.standard_normal(c)
    p = np.exp(sc - sc.max(0)) / np.exp(sc - sc.max(0)).sum(0)  # softmax over candidates, per channel
    pooled = (p * kv).sum(0)
    normed = pooled / np.sqrt(np.mean(pooled ** 2) + 1e-6) * w
    j = 5
    got = compress_block(f32(kv), f32(sc), f32(w), j * m, inv)
    np.testing.assert_allclose(got, rope_rotate(f32(normed), j * m, inv), rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, rope_rotate(f32(normed), j * m + m - 1, inv), atol=1e-3)


# --- indexer ----------------------------------------------------------------------------------

def test_indexer_scores_formula():
    hi, di, s = 3, 16, 7
    q = RNG.standard_normal((hi, di))
    w = RNG.standard_normal(hi)
    keys = RNG.standard_normal((s, di))
    got = indexer_scores(f32(q), f32(w), f32(keys))
    want = [sum(w[h] * max(0.0, q[h] @ keys[j]) for h in range(hi)) for j in range(s)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_indexer_is_causal_and_picks_highest():
    scores = f32(np.arange(20))  # the highest scores sit on the newest rows
    for t in range(80):
        n_vis = (t + 1) // 4
        sel = indexer_select(scores, n_vis, 3)
        assert all(s < n_vis for s in sel)
        assert list(sel) == list(range(max(0, n_vis - 3), n_vis))
    rnd = f32(RNG.standard_normal(30))
    sel = indexer_select(rnd, 25, 6)
    assert set(sel) == set(np.argsort(-rnd[:25])[:6]) and list(sel) == sorted(sel)
    assert list(indexer_select(rnd, 5, 8)) == [0, 1, 2, 3, 4]  # all fit: all used


def test_indexer_ties_go_to_lower_index():
    scores = f32([0, 1, 0, 1, 0, 1, 0])
    assert list(indexer_select(scores, 7, 2)) == [1, 3]
    assert list(indexer_select(f32(np.zeros(10)), 10, 3)) == [0, 1, 2]


# --- attention --------------------------------------------------------------------------------

def test_sink_only_enlarges_the_denominator():
    h, d, s = 3, 8, 6
    q = RNG.standard_normal((h, d))
    keys = RNG.standard_normal((s, d))
    sink = np.array([0.5, -1.0, 3.0])
    scale = 1 / math.sqrt(d)
    got = attend_with_sink(f32(q), f32(keys), f32(sink), scale=scale)
    for i in range(h):
        logits = np.append(keys @ q[i] * scale, sink[i])
        p = np.exp(logits - logits.max())
        p /= p.sum()
        values = np.vstack([keys, np.zeros(d)])  # the sink column has a zero value
        np.testing.assert_allclose(got[i], p @ values, rtol=1e-5, atol=1e-6)
    no_sink = attend_with_sink(f32(q), f32(keys), f32(np.full(h, -np.inf)), scale=scale)
    ref = np.exp(q @ keys.T * scale)
    np.testing.assert_allclose(no_sink, (ref / ref.sum(1, keepdims=True)) @ keys, rtol=1e-5, atol=1e-6)


def test_masked_keys_equal_dropped_keys_bit_for_bit():
    h, d, s = 4, 16, 9
    q = f32(RNG.standard_normal((2, h, d)))
    keys = f32(RNG.standard_normal((s, d)))
    sink = f32(RNG.standard_normal(h))
    mask = np.array([[1, 0, 1, 1, 0, 0, 1, 0, 1], [0, 1, 1, 0, 0, 1, 1, 1, 0]], bool)
    got = attend_with_sink(q, keys, sink, scale=0.25, mask=mask)
    for r in range(2):
        assert np.array_equal(got[r], attend_with_sink(q[r], keys[mask[r]], sink, scale=0.25))


# --- MoE --------------------------------------------------------------------------------------

def _router_case(n_exp=8, d=16):
    x = f32(RNG.standard_normal(d))
    gate = f32(RNG.standard_normal((n_exp, d)) / math.sqrt(d))
    logits = gate.astype(np.float64) @ x
    s = np.sqrt(np.log1p(np.exp(logits)))
    return x, gate, s


def test_biased_routing_selects_with_bias_but_weights_without():
    x, gate, s = _router_case()
    plain_ids, plain_w = route(x, gate, n_used=2, bias=f32(np.zeros(8)), scale=1.5)
    assert list(plain_ids) == list(np.argsort(-s)[:2])
    bias = np.zeros(8, np.float32)
    low = int(np.argsort(s)[0])
    bias[low] = 100.0  # forces the weakest expert in
    ids, w = route(x, gate, n_used=2, bias=bias, scale=1.5)
    assert ids[0] == low and ids[1] == plain_ids[0]
    np.testing.assert_allclose(w, s[ids] / s[ids].sum() * 1.5, rtol=1e-5)


def test_hash_routing_uses_tid2eid_of_the_token():
    x, gate, s = _router_case()
    tid2eid = np.array([[0, 1], [5, 2], [7, 3]], np.int32)
    ids, w = route(x, gate, n_used=2, tid2eid=tid2eid, tokens=1, scale=1.5)
    assert list(ids) == [5, 2]
    np.testing.assert_allclose(w, s[[5, 2]] / s[[5, 2]].sum() * 1.5, rtol=1e-5)
    ids2, _ = route(np.stack([x, x]), gate, n_used=2, tid2eid=tid2eid, tokens=np.array([2, 0]), scale=1.5)
    assert ids2.tolist() == [[7, 3], [0, 1]]


def test_router_ties_and_denominator_clamp():
    gate = np.zeros((6, 4), np.float32)  # equal scores everywhere
    ids, _ = route(f32(np.ones(4)), gate, n_used=3, bias=f32(np.zeros(6)))
    assert list(ids) == [0, 1, 2]
    gate[:, 0] = -30.0  # tiny scores: Σ s below 6.1035e-5
    ids, w = route(f32([1, 0, 0, 0]), gate, n_used=2, bias=f32(np.zeros(6)), scale=1.5)
    s = math.sqrt(math.log1p(math.exp(-30.0)))
    np.testing.assert_allclose(w, [s / 6.103515625e-5 * 1.5] * 2, rtol=1e-4)


def test_swiglu_clamps_gate_from_above_only_up_both_sides():
    x = f32([-20, -5, 5, 20])
    eye = np.eye(4, dtype=np.float32)
    y = expert_ffn(x, eye, eye, eye, 10.0)
    g = np.minimum(x.astype(np.float64), 10)
    u = np.clip(x.astype(np.float64), -10, 10)
    np.testing.assert_allclose(y, g * sig(g) * u, rtol=1e-5)
    both = np.clip(x.astype(np.float64), -10, 10)
    assert not np.allclose(y[0], both[0] * sig(both[0]) * u[0], rtol=1e-2)  # gate not clamped below
    np.testing.assert_allclose(expert_ffn(x, eye, eye, eye, 0.0), x * sig(x.astype(np.float64)) * x, rtol=1e-5)
