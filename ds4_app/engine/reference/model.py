"""The whole DS4 model in numpy (spec §2): per-sequence state, incremental step, whole-prompt forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np

from ..config import DS4Config
from .attention import (
    attend_with_sink, compress_block, compressor_update, indexer_scores, indexer_select,
    new_compressor_state, prompt_blocks, rope_rotate, window_positions,
)
from .mhc import hc_head, hc_post, hc_pre
from .moe import combine_experts, expert_ffn, route
from .numerics import (
    F32, fp4_roundtrip, fp8_e4m3_roundtrip, grouped_linear, hadamard, linear, rms_norm, round_f16,
)
from .tensors import check_weights

_CHUNK_ELEMS = 1 << 22  # bound on the temporaries of the whole-prompt attention and indexer


@dataclass(slots=True)
class SeqState:
    """Explicit state of one sequence (spec §8, design.md §5), updated in place by ``step``.

    Per layer: ``ring`` [window, head_dim] raw KV rows (row = position mod window, f16-rounded
    values in fp32); ``comp`` [n, head_dim] compressed rows in block order (empty on sliding-only
    layers); ``idx_keys`` [n, index_head_dim] indexer keys (empty except on CSA layers); the fp32
    compressor states ``kv_state``/``score_state`` (CSA [2m, 2·head_dim], HCA [m, head_dim]) and
    ``idx_kv_state``/``idx_score_state`` (CSA [8, 2·index_head_dim]), None where a layer has none.
    """

    pos: int
    ring: list[np.ndarray]
    comp: list[np.ndarray]
    idx_keys: list[np.ndarray]
    kv_state: list[np.ndarray | None]
    score_state: list[np.ndarray | None]
    idx_kv_state: list[np.ndarray | None]
    idx_score_state: list[np.ndarray | None]

    def clone(self) -> "SeqState":
        """A deep copy (snapshot) of the state."""
        def cp(xs: list) -> list:
            return [None if a is None else a.copy() for a in xs]
        return SeqState(self.pos, cp(self.ring), cp(self.comp), cp(self.idx_keys), cp(self.kv_state),
                        cp(self.score_state), cp(self.idx_kv_state), cp(self.idx_score_state))


@dataclass(slots=True)
class _Compressor:
    wkv: np.ndarray
    wgate: np.ndarray
    ape: np.ndarray
    norm: np.ndarray


@dataclass(slots=True)
class _Layer:
    """One block's weights, in the shapes the math wants (views of the caller's arrays)."""

    ratio: int
    inv_freqs: np.ndarray  # float64 θ'_k of this layer's RoPE table
    hc_attn: tuple[np.ndarray, np.ndarray, np.ndarray]  # fn, scale, base
    hc_ffn: tuple[np.ndarray, np.ndarray, np.ndarray]
    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    wq_a: np.ndarray
    q_norm: np.ndarray
    wq_b: np.ndarray
    wkv: np.ndarray
    kv_norm: np.ndarray
    sinks: np.ndarray
    wo_a: np.ndarray  # [G, o_lora, (H/G)·D]
    wo_b: np.ndarray
    comp: _Compressor | None
    idx_comp: _Compressor | None
    idx_wq_b: np.ndarray | None
    idx_proj: np.ndarray | None
    gate: np.ndarray
    bias: np.ndarray | None
    tid2eid: np.ndarray | None
    exps: tuple[np.ndarray, np.ndarray, np.ndarray]  # gate, up, down
    shexp: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    clamp_exp: float
    clamp_shexp: float


def _row_chunks(n: int, per_row: int) -> Iterator[slice]:
    step = max(1, _CHUNK_ELEMS // max(1, per_row))
    for a in range(0, n, step):
        yield slice(a, min(n, a + step))


class Reference:
    """Numpy oracle of ds4_spec.md with the numerics of design.md §3, shared by every backend.

    * fp32 throughout: activations, residual streams, RMSNorm, mHC, softmax, router, compressor
      pooling. Weights arrive dequantized to fp32 (as llama.cpp uses them).
    * Raw KV rows, compressed KV rows and indexer keys are stored rounded to f16; the current
      token attends to its own rounded row. Compressor state stays fp32.
    * ``qat=True`` adds the spec §7 round trips items 1–2: FP8 e4m3 on KV dims [0:D−r] (blocks of
      64) of raw and attention-compressor rows, before the f16 rounding; Hadamard + FP4 (blocks of
      32) on indexer queries and indexer keys. With ``qat=False`` the indexer applies no Hadamard
      (it would cancel in q·k). Spec §7 item 3 (FP8 activations into the GEMMs) is NOT
      implemented: the GEMMs take fp32 activations, as llama.cpp's do.
    * Indexer top-k: k = min(index_topk, visible), by score descending, ties to the lower row
      index; all visible rows when they fit. Router top-k on score + bias, ties to the lower
      expert id; weights from the unbiased scores, denominator max(Σ, 6.1035e-5).
    * The router weight multiplies a routed expert's output after its down projection (equal to
      applying it before, in exact arithmetic; llama.cpp's order).
    * RoPE angles are formed in float64 and cos/sin rounded to fp32.

    ``step`` (one token, explicit ``SeqState``) and ``forward_prompt`` (all positions at once,
    masks and block pooling, no state) are independent formulations that agree bit for bit.
    """

    def __init__(self, cfg: DS4Config, weights: Mapping[str, np.ndarray], *, qat: bool | None = None):
        check_weights(cfg, weights)
        self.cfg = cfg
        self.qat = cfg.qat_numerics if qat is None else bool(qat)
        if self.qat:
            if (cfg.head_dim - cfg.rope_dim) % 64:
                raise ValueError("QAT numerics need head_dim − rope dims to be a multiple of 64 (FP8 blocks)")
            if any(r == 4 for r in cfg.compress_ratios) and cfg.index_head_dim % 32:
                raise ValueError("QAT numerics need the indexer head dim to be a multiple of 32 (FP4 blocks)")

        def f(name: str) -> np.ndarray:
            return np.ascontiguousarray(weights[name], dtype=F32)

        self._embd = f("token_embd.weight")
        self._output = f("output.weight")
        self._output_norm = f("output_norm.weight")
        self._hc_head = (f("output_hc_fn.weight"), f("output_hc_scale.weight"), f("output_hc_base.weight"))
        self._layers = [self._load_layer(cfg, il, f, weights) for il in range(cfg.n_layer)]

    @staticmethod
    def _load_layer(cfg: DS4Config, il: int, f, weights: Mapping[str, np.ndarray]) -> _Layer:
        p = f"blk.{il}."
        m = cfg.compress_ratios[il]
        g = cfg.o_groups

        def comp(prefix: str) -> _Compressor:
            return _Compressor(f(p + prefix + "_kv.weight"), f(p + prefix + "_gate.weight"),
                               f(p + prefix + "_ape.weight"), f(p + prefix + "_norm.weight"))

        wo_a = f(p + "attn_output_a.weight")
        return _Layer(
            ratio=m,
            inv_freqs=np.asarray(cfg.rope(il).inv_freqs(cfg.rope_dim), dtype=np.float64),
            hc_attn=(f(p + "hc_attn_fn.weight"), f(p + "hc_attn_scale.weight"), f(p + "hc_attn_base.weight")),
            hc_ffn=(f(p + "hc_ffn_fn.weight"), f(p + "hc_ffn_scale.weight"), f(p + "hc_ffn_base.weight")),
            attn_norm=f(p + "attn_norm.weight"), ffn_norm=f(p + "ffn_norm.weight"),
            wq_a=f(p + "attn_q_a.weight"), q_norm=f(p + "attn_q_a_norm.weight"), wq_b=f(p + "attn_q_b.weight"),
            wkv=f(p + "attn_kv.weight"), kv_norm=f(p + "attn_kv_a_norm.weight"),
            sinks=f(p + "attn_sinks.weight"),
            wo_a=wo_a.reshape(g, cfg.o_lora_rank, wo_a.shape[1]), wo_b=f(p + "attn_output_b.weight"),
            comp=comp("attn_compressor") if m else None,
            idx_comp=comp("indexer_compressor") if m == 4 else None,
            idx_wq_b=f(p + "indexer.attn_q_b.weight") if m == 4 else None,
            idx_proj=f(p + "indexer.proj.weight") if m == 4 else None,
            gate=f(p + "ffn_gate_inp.weight"),
            bias=None if cfg.is_hash_layer(il) else f(p + "exp_probs_b.bias"),
            tid2eid=np.asarray(weights[p + "ffn_gate_tid2eid.weight"], dtype=np.int64) if cfg.is_hash_layer(il) else None,
            exps=(f(p + "ffn_gate_exps.weight"), f(p + "ffn_up_exps.weight"), f(p + "ffn_down_exps.weight")),
            shexp=(f(p + "ffn_gate_shexp.weight"), f(p + "ffn_up_shexp.weight"), f(p + "ffn_down_shexp.weight"))
            if cfg.n_expert_shared else None,
            clamp_exp=float(cfg.swiglu_clamp_exp[il]),
            clamp_shexp=float(cfg.swiglu_clamp_shexp[il]),
        )

    # --- public API ---------------------------------------------------------------------------

    def layer_inv_freqs(self, layer: int) -> np.ndarray:
        """The RoPE table θ'_k (float64) used for every rotation in ``layer``."""
        return self._layers[layer].inv_freqs

    def new_state(self) -> SeqState:
        """A fresh sequence at position 0: empty caches, compressor states (0, −∞)."""
        cfg = self.cfg
        n = cfg.n_layer
        st = SeqState(0, [np.zeros((cfg.sliding_window, cfg.head_dim), F32) for _ in range(n)],
                      [np.zeros((0, cfg.head_dim), F32) for _ in range(n)],
                      [np.zeros((0, cfg.index_head_dim), F32) for _ in range(n)],
                      [None] * n, [None] * n, [None] * n, [None] * n)
        for il, m in enumerate(cfg.compress_ratios):
            if m:
                st.kv_state[il], st.score_state[il] = new_compressor_state(m, cfg.head_dim)
            if m == 4:
                st.idx_kv_state[il], st.idx_score_state[il] = new_compressor_state(4, cfg.index_head_dim)
        return st

    def step(self, state: SeqState, token: int) -> np.ndarray:
        """Feed ``token`` at position ``state.pos``; return its logits [n_vocab] (fp32) and advance."""
        token = self._check_token(token)
        t = state.pos
        tokens = np.array([token])
        x = self._embed(tokens)
        for il, lay in enumerate(self._layers):
            x = self._block(lay, x, tokens, lambda xn, il=il, lay=lay: self._attention_step(state, il, lay, xn, t))
        state.pos = t + 1
        return self._head(x)[0]

    def prefill(self, state: SeqState, tokens: Sequence[int]) -> np.ndarray:
        """``step`` over each token in turn; the logits of the last one."""
        if len(tokens) == 0:
            raise ValueError("prefill needs at least one token")
        logits = None
        for tok in tokens:
            logits = self.step(state, tok)
        return logits

    def forward_prompt(self, tokens: Sequence[int]) -> np.ndarray:
        """Whole-prompt forward from position 0, all positions at once: logits [T, n_vocab].

        Matrix form: causal window and compressed-row masks, block pooling of every complete
        block, the indexer over all queries; no incremental state.
        """
        toks = np.array([self._check_token(t) for t in tokens], dtype=np.int64)
        if toks.size == 0:
            raise ValueError("forward_prompt needs at least one token")
        x = self._embed(toks)
        for lay in self._layers:
            x = self._block(lay, x, toks, lambda xn, lay=lay: self._attention_prompt(lay, xn))
        return self._head(x)

    # --- shared per-row pieces ----------------------------------------------------------------

    def _check_token(self, token: int) -> int:
        token = int(token)
        if not 0 <= token < self.cfg.n_vocab:
            raise ValueError(f"token id {token} outside the vocabulary (0..{self.cfg.n_vocab - 1})")
        return token

    def _embed(self, tokens: np.ndarray) -> np.ndarray:
        e = self._embd[tokens]
        return np.ascontiguousarray(np.repeat(e[:, None, :], self.cfg.hc_mult, axis=1))

    def _head(self, x: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        fn, scale, base = self._hc_head
        h = hc_head(x, fn, scale, base, norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps)
        return linear(self._output, rms_norm(h, self._output_norm, cfg.norm_eps))

    def _block(self, lay: _Layer, x: np.ndarray, tokens: np.ndarray, attention) -> np.ndarray:
        """Spec §2 step 3: attention site then FFN site, each through hc_pre / hc_post."""
        cfg = self.cfg
        kw = dict(norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
        u, post, comb = hc_pre(x, *lay.hc_attn, **kw)
        x = hc_post(attention(rms_norm(u, lay.attn_norm, cfg.norm_eps)), x, post, comb)
        u, post, comb = hc_pre(x, *lay.hc_ffn, **kw)
        return hc_post(self._ffn(lay, rms_norm(u, lay.ffn_norm, cfg.norm_eps), tokens), x, post, comb)

    def _query(self, lay: _Layer, x: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """§4.1: (q latent [N, q_lora], q [N, H, D] per-head normed and rotated)."""
        cfg = self.cfg
        q_lat = rms_norm(linear(lay.wq_a, x), lay.q_norm, cfg.norm_eps)
        q = linear(lay.wq_b, q_lat).reshape(x.shape[0], cfg.n_head, cfg.head_dim)
        q = rope_rotate(rms_norm(q, None, cfg.norm_eps), pos[:, None], lay.inv_freqs)
        return q_lat, q

    def _store_kv(self, rows: np.ndarray) -> np.ndarray:
        """Storage of raw and attention-compressor rows: (QAT FP8 on dims [0:D−r]) then f16."""
        if self.qat:
            rows = rows.copy()
            nope = self.cfg.head_dim - self.cfg.rope_dim
            rows[..., :nope] = fp8_e4m3_roundtrip(rows[..., :nope], 64)
        return round_f16(rows)

    def _store_idx(self, rows: np.ndarray) -> np.ndarray:
        """Storage of indexer keys: (QAT Hadamard + FP4) then f16."""
        if self.qat:
            rows = fp4_roundtrip(hadamard(rows), 32)
        return round_f16(rows)

    def _raw_kv(self, lay: _Layer, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """§4.2: the stored K = V row of each token [N, D]."""
        kv = rms_norm(linear(lay.wkv, x), lay.kv_norm, self.cfg.norm_eps)
        return self._store_kv(rope_rotate(kv, pos, lay.inv_freqs))

    @staticmethod
    def _comp_inputs(c: _Compressor, x: np.ndarray, pos: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """§4.4: k_t = W_kv·x_t and z_t = W_gate·x_t + ape[t mod m], [N, coff·c] each."""
        return linear(c.wkv, x), linear(c.wgate, x) + c.ape[pos % m]

    def _comp_rows(self, c: _Compressor, lay: _Layer, kv: np.ndarray, score: np.ndarray,
                   block_pos: np.ndarray, indexer: bool) -> np.ndarray:
        rows = compress_block(kv, score, c.norm, block_pos, lay.inv_freqs, self.cfg.norm_eps)
        return self._store_idx(rows) if indexer else self._store_kv(rows)

    def _indexer_query(self, lay: _Layer, q_lat: np.ndarray, x: np.ndarray, pos: np.ndarray,
                       ) -> tuple[np.ndarray, np.ndarray]:
        """§4.5: indexer query heads [N, Hi, di] (rotated; QAT: Hadamard + FP4) and head weights [N, Hi]."""
        cfg = self.cfg
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        q = linear(lay.idx_wq_b, q_lat).reshape(x.shape[0], hi, di)
        q = rope_rotate(q, pos[:, None], lay.inv_freqs)
        if self.qat:
            q = fp4_roundtrip(hadamard(q), 32)
        w = linear(lay.idx_proj, x) * F32(1.0 / np.sqrt(float(di * hi)))
        return q, w

    def _attn_out(self, lay: _Layer, o: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """§4.8: inverse RoPE at the query position, grouped low-rank output projection."""
        cfg = self.cfg
        n = o.shape[0]
        o = rope_rotate(o, pos[:, None], lay.inv_freqs, inverse=True)
        z = grouped_linear(lay.wo_a, o.reshape(n, cfg.o_groups, -1))
        return linear(lay.wo_b, z.reshape(n, -1))

    def _ffn(self, lay: _Layer, x: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """§5: routed experts (weighted after W2, added in selection order) plus the shared expert."""
        cfg = self.cfg
        ids, w = route(x, lay.gate, n_used=cfg.n_expert_used, bias=lay.bias, tid2eid=lay.tid2eid,
                       tokens=tokens, scale=cfg.expert_weights_scale, normalize=cfg.expert_weights_norm)
        y = np.zeros((x.shape[0], ids.shape[1], cfg.n_embd), F32)
        gate, up, down = lay.exps
        for e in np.unique(ids):
            rows, slots = np.nonzero(ids == e)
            y[rows, slots] = expert_ffn(x[rows], gate[e], up[e], down[e], lay.clamp_exp)
        out = combine_experts(y, w)
        if lay.shexp is not None:
            out = out + expert_ffn(x, *lay.shexp, lay.clamp_shexp)
        return out

    # --- attention: incremental ---------------------------------------------------------------

    def _attention_step(self, st: SeqState, il: int, lay: _Layer, x: np.ndarray, t: int) -> np.ndarray:
        cfg = self.cfg
        win = cfg.sliding_window
        m = lay.ratio
        pos = np.array([t])
        q_lat, q = self._query(lay, x, pos)
        st.ring[il][t % win] = self._raw_kv(lay, x, pos)[0]
        keys = [st.ring[il][window_positions(t, win) % win]]  # oldest first
        if m:
            k, z = self._comp_inputs(lay.comp, x, pos, m)
            cand = compressor_update(st.kv_state[il], st.score_state[il], k[0], z[0], t, m)
            if cand is not None:
                row = self._comp_rows(lay.comp, lay, cand[0][None], cand[1][None], np.array([t + 1 - m]), False)
                st.comp[il] = np.concatenate([st.comp[il], row])
            n_vis = (t + 1) // m
            if m == 4:
                k, z = self._comp_inputs(lay.idx_comp, x, pos, 4)
                cand = compressor_update(st.idx_kv_state[il], st.idx_score_state[il], k[0], z[0], t, 4)
                if cand is not None:
                    row = self._comp_rows(lay.idx_comp, lay, cand[0][None], cand[1][None], np.array([t - 3]), True)
                    st.idx_keys[il] = np.concatenate([st.idx_keys[il], row])
                qi, wi = self._indexer_query(lay, q_lat, x, pos)
                scores = indexer_scores(qi, wi, st.idx_keys[il][:n_vis])[0]
                keys.append(st.comp[il][indexer_select(scores, n_vis, cfg.index_topk)])
            else:
                keys.append(st.comp[il][:n_vis])
        o = attend_with_sink(q, np.concatenate(keys), lay.sinks, scale=1.0 / np.sqrt(cfg.head_dim))
        return self._attn_out(lay, o, pos)

    # --- attention: whole prompt --------------------------------------------------------------

    def _attention_prompt(self, lay: _Layer, x: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        n = x.shape[0]
        m = lay.ratio
        pos = np.arange(n)
        q_lat, q = self._query(lay, x, pos)
        keys = self._raw_kv(lay, x, pos)
        tq, ts = pos[:, None], pos[None, :]
        mask = (ts <= tq) & (ts > tq - cfg.sliding_window)
        if m:
            k, z = self._comp_inputs(lay.comp, x, pos, m)
            ck, cz = prompt_blocks(k, z, m)
            nb = ck.shape[0]
            comp = self._comp_rows(lay.comp, lay, ck, cz, np.arange(nb) * m, False)
            n_vis = (pos + 1) // m
            if m == 4:
                k, z = self._comp_inputs(lay.idx_comp, x, pos, 4)
                ik, iz = prompt_blocks(k, z, 4)
                idx_keys = self._comp_rows(lay.idx_comp, lay, ik, iz, np.arange(nb) * 4, True)
                qi, wi = self._indexer_query(lay, q_lat, x, pos)
                comp_mask = np.zeros((n, nb), bool)
                for sl in _row_chunks(n, cfg.index_n_heads * max(nb, 1) * cfg.index_head_dim):
                    scores = indexer_scores(qi[sl], wi[sl], idx_keys)
                    for r, t in enumerate(range(sl.start, sl.stop)):
                        comp_mask[t, indexer_select(scores[r], int(n_vis[t]), cfg.index_topk)] = True
            else:
                comp_mask = np.arange(nb)[None, :] < n_vis[:, None]
            keys = np.concatenate([keys, comp])
            mask = np.concatenate([mask, comp_mask], axis=1)
        o = np.empty_like(q)
        for sl in _row_chunks(n, cfg.n_head * keys.shape[0] * cfg.head_dim):
            o[sl] = attend_with_sink(q[sl], keys, lay.sinks, scale=1.0 / np.sqrt(cfg.head_dim), mask=mask[sl])
        return self._attn_out(lay, o, pos)
