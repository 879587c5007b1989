"""DS4 in PyTorch, for training the embedded default model: the same forward as the numpy reference.

``DS4Torch(cfg)`` holds every trunk tensor under its GGUF name in numpy orientation (shape =
reversed ggml ``ne``, so a projection is [out, in]), and ``forward(tokens)`` runs the whole-prompt
forward of ds4_spec.md for a batch of sequences that all start at position 0, exactly as
``ds4_app.engine.reference.Reference.forward_prompt`` does for one:

* mHC with Sinkhorn (4 streams) at both sites of every block and the sigmoid-weighted head;
* sliding-window attention over f16-stored raw K=V rows, plus on compressed layers the rows of
  the softmax-pooling compressor (CSA: ratio 4 with overlapping halves and the lightning indexer's
  top-k; HCA: ratio 128, all visible rows), attention sinks, tail RoPE with the per-layer base and
  YaRN, inverse RoPE of the output, grouped low-rank output projection;
* MoE with sqrt-softplus routing, the selection bias, hash routing on the first layers, the
  shared expert and the SwiGLU clamps.

Numerics follow the reference's choices (design.md §3, QAT round trips off): fp32 everywhere,
RoPE angles in float64 with cos/sin rounded to fp32, raw/compressed rows and indexer keys rounded
to f16 (straight-through in training), indexer ties to the lower row, router weights applied after
the down projection. ``exact=True`` rounds stored rows plainly (no straight-through form); for
checks, also turn TF32 off (export.py does).

Training-only parts, none of which changes the forward: the rounding to f16 passes gradients
straight through; the routed experts are evaluated densely (every expert on every token) and
mixed with a weight matrix that is exactly zero for the experts not selected, which is the same
sum as the sparse form; the indexer's top-k is not differentiable, so the indexer projections
get their gradient only from an auxiliary KL loss (DeepSeek-V3.2's indexer warm-up objective: the
indexer's softmax over the visible compressed rows is pulled towards the main attention's
head-averaged distribution over those rows, with both inputs detached so the main model is not
affected); the router bias ``exp_probs_b`` is no gradient parameter but is moved by the
auxiliary-loss-free balancing rule (``balance_router``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ds4_app.engine.config import DS4Config  # noqa: E402

ROUTER_DENOM_MIN = 6.103515625e-5


def default_config(n_vocab: int) -> DS4Config:
    """The default model's shape: d = 256, 6 layers with ratios 0/4/128, every DS4 feature.

    Head dims keep the tiny-preset constraints (rope dims even and ≤ head dim; indexer head dim a
    power of two ≥ rope dims; head_dim − rope dims a multiple of 64 so QAT numerics stay
    possible); d and the expert width are 256 so Q8_0 and Q4_K blocks divide every row. The
    indexer's top-k (32) is below the visible compressed rows past 128 tokens.
    """
    n_layer = 6
    return DS4Config(
        n_vocab=n_vocab, n_embd=256, n_layer=n_layer, n_head=4, head_dim=128, rope_dim=64,
        q_lora_rank=128, o_groups=2, o_lora_rank=128, compress_ratios=(0, 4, 128, 4, 128, 4),
        index_n_heads=4, index_head_dim=64, index_topk=32,
        n_expert=8, n_expert_used=2, n_expert_shared=1, expert_ffn=256,
        expert_weights_scale=1.5, n_hash_layers=1,
        swiglu_clamp_exp=(10.0,) * n_layer, swiglu_clamp_shexp=(10.0,) * n_layer,
        context_length=4096,
    )


def weight_shapes(cfg: DS4Config) -> dict[str, tuple[int, ...]]:
    """Numpy shape of every trunk tensor by GGUF name (the reversed ``ne`` of tensors.py).

    Taken from the reference's table, which imports no ``gguf`` (the GPU machine has none);
    export.py checks it against ``tensors.tensor_specs``.
    """
    from ds4_app.engine.reference.tensors import weight_shapes as ref_shapes

    return dict(ref_shapes(cfg))


def _key(name: str) -> str:
    return name.replace(".", "~")  # parameter names may not contain dots


@dataclass(slots=True)
class Aux:
    """Training by-products of one forward: the indexer KL loss and router loads per layer."""

    indexer_kl: torch.Tensor
    expert_load: dict[int, torch.Tensor]  # layer -> selections per expert (float, no grad)


class DS4Torch(nn.Module):
    """The DS4 trunk as a torch module; parameters keyed by GGUF name (see module doc)."""

    def __init__(self, cfg: DS4Config, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.params = nn.ParameterDict()
        shapes = weight_shapes(cfg)
        g = torch.Generator().manual_seed(seed)
        self.names: list[str] = []
        for name, shape in shapes.items():
            if name.endswith("ffn_gate_tid2eid.weight"):
                self.register_buffer(_key(name), self._tid2eid(shape, g))
            elif name.endswith("exp_probs_b.bias"):
                self.register_buffer(_key(name), torch.zeros(shape))
            else:
                self.params[_key(name)] = nn.Parameter(self._init(name, shape, g))
            self.names.append(name)
        for il in range(cfg.n_layer):
            inv = torch.tensor(cfg.rope(il).inv_freqs(cfg.rope_dim), dtype=torch.float64)
            self.register_buffer(f"inv_freq_{il}", inv, persistent=False)
        self.exact = False

    # --- weights ---------------------------------------------------------------------------

    def _tid2eid(self, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        # n_used distinct experts per token id, uniformly at random
        v, k = shape
        r = torch.rand(v, self.cfg.n_expert, generator=g)
        return torch.argsort(r, dim=1)[:, :k].to(torch.int32).contiguous()

    def _init(self, name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        cfg = self.cfg
        short = name.split(".", 2)[2] if name.startswith("blk.") else name
        n = cfg.hc_mult

        def normal(std: float) -> torch.Tensor:
            return torch.randn(shape, generator=g) * std

        if short.endswith("norm.weight"):
            return torch.ones(shape)
        if short == "attn_sinks.weight":
            return torch.zeros(shape)
        if short.endswith("_ape.weight"):
            return torch.zeros(shape)
        if short.endswith("hc_attn_scale.weight") or short.endswith("hc_ffn_scale.weight") or short == "output_hc_scale.weight":
            return torch.full(shape, 0.1)
        if short in ("hc_attn_base.weight", "hc_ffn_base.weight"):
            b = torch.zeros(shape)
            b[:n] = math.log(1.0 / (n - 1))  # pre = sigmoid = 1/n: u starts as the stream mean
            b[2 * n:] = (4.0 * torch.eye(n)).reshape(-1)  # comb starts near the identity
            return b
        if short == "output_hc_base.weight":
            return torch.full(shape, math.log(1.0 / (n - 1)))
        if short.endswith("_fn.weight"):
            return normal(0.1 / math.sqrt(shape[-1]))
        if name == "token_embd.weight":
            return normal(1.0)
        fan_in = shape[-1]
        std = 1.0 / math.sqrt(fan_in)
        if short in ("attn_output_b.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight"):
            std /= math.sqrt(2 * cfg.n_layer)  # residual-branch outputs start small
        return normal(std)

    def w(self, name: str) -> torch.Tensor:
        """The tensor stored under GGUF name ``name`` (parameter or buffer)."""
        k = _key(name)
        if k in self.params:
            return self.params[k]
        return getattr(self, k)

    def state_numpy(self) -> dict[str, np.ndarray]:
        """Every trunk tensor as a numpy array by GGUF name (fp32; tid2eid int32)."""
        return {n: self.w(n).detach().cpu().numpy() for n in self.names}

    def load_numpy(self, weights: dict[str, np.ndarray]) -> None:
        """Set every trunk tensor from numpy arrays keyed by GGUF name (shapes must match)."""
        with torch.no_grad():
            for n in self.names:
                t = self.w(n)
                src = torch.from_numpy(np.ascontiguousarray(weights[n])).to(t.device)
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"{n}: shape {tuple(src.shape)}, expected {tuple(t.shape)}")
                t.copy_(src.to(t.dtype))

    # --- numeric helpers ---------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)
        return y * weight if weight is not None else y

    def _f16(self, x: torch.Tensor) -> torch.Tensor:
        r = x.to(torch.float16).to(torch.float32)
        if self.exact or not x.requires_grad:
            return r
        return x + (r - x).detach()  # straight-through: value rounded, gradient identity

    def _rope_table(self, layer: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, rope_dim/2] of positions ``pos`` (float64 angles, rounded to fp32 as the reference)."""
        ang = pos.to(torch.float64)[:, None] * getattr(self, f"inv_freq_{layer}")[None, :]
        return torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last rope_dim dims of x (interleaved pairs); cos/sin broadcast to [..., r/2]."""
        r = self.cfg.rope_dim
        if inverse:
            sin = -sin
        head, tail = x[..., :x.shape[-1] - r], x[..., x.shape[-1] - r:]
        tail = tail.unflatten(-1, (r // 2, 2))
        a, b = tail[..., 0], tail[..., 1]
        rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([head, rot], dim=-1)

    @staticmethod
    def _lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    # --- mHC (spec §3) -----------------------------------------------------------------------

    def _mix(self, x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2)
        rho = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)
        return self._lin(flat, fn) * rho

    def _hc_pre(self, x: torch.Tensor, site: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        n = cfg.hc_mult
        p = f"blk.{layer}.hc_{site}_"
        fn, scale, base = self.w(p + "fn.weight"), self.w(p + "scale.weight"), self.w(p + "base.weight")
        m = self._mix(x, fn)
        pre = torch.sigmoid(scale[0] * m[..., :n] + base[:n]) + cfg.hc_eps
        post = 2.0 * torch.sigmoid(scale[1] * m[..., n:2 * n] + base[n:2 * n])
        c = (scale[2] * m[..., 2 * n:] + base[2 * n:]).unflatten(-1, (n, n))
        eps = cfg.hc_eps
        c = torch.softmax(c, dim=-1) + eps
        c = c / (c.sum(-2, keepdim=True) + eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            c = c / (c.sum(-1, keepdim=True) + eps)
            c = c / (c.sum(-2, keepdim=True) + eps)
        u = (pre.unsqueeze(-1) * x).sum(-2)
        return u, post, c

    @staticmethod
    def _hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        # new stream k = post_k·y + Σ_j C[j,k]·X[j]
        return post.unsqueeze(-1) * y.unsqueeze(-2) + torch.einsum("...jk,...jd->...kd", comb, x)

    # --- attention (spec §4) -----------------------------------------------------------------

    @staticmethod
    def _pool(k: torch.Tensor, z: torch.Tensor, m: int) -> torch.Tensor:
        """Per-channel softmax pooling of every complete block: [B, T, coff·c] -> [B, nb, c]."""
        b, t, w = k.shape
        nb = t // m
        kb = k[:, :nb * m].reshape(b, nb, m, w)
        zb = z[:, :nb * m].reshape(b, nb, m, w)
        if m == 4:
            c = w // 2
            prev_k = torch.cat([torch.zeros_like(kb[:, :1, :, :c]), kb[:, :-1, :, :c]], dim=1)
            prev_z = torch.cat([torch.full_like(zb[:, :1, :, :c], float("-inf")), zb[:, :-1, :, :c]], dim=1)
            kb = torch.cat([prev_k, kb[:, :, :, c:]], dim=2)
            zb = torch.cat([prev_z, zb[:, :, :, c:]], dim=2)
        p = torch.softmax(zb, dim=2)
        return (p * kb).sum(2)

    def _compressed(self, layer: int, prefix: str, x: torch.Tensor, m: int) -> torch.Tensor:
        """Compressed rows of one compressor (pool, weighted RMSNorm, RoPE at j·m, f16)."""
        p = f"blk.{layer}.{prefix}_"
        t = x.shape[1]
        k = self._lin(x, self.w(p + "kv.weight"))
        z = self._lin(x, self.w(p + "gate.weight")) + self.w(p + "ape.weight")[torch.arange(t, device=x.device) % m]
        rows = self._rms(self._pool(k, z, m), self.w(p + "norm.weight"))
        nb = rows.shape[1]
        cos, sin = self._rope_table(layer, torch.arange(nb, device=x.device) * m)
        return self._f16(self._rope(rows, cos, sin))

    def _attention(self, layer: int, x: torch.Tensor, aux: list) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        h, d, m = cfg.n_head, cfg.head_dim, cfg.compress_ratios[layer]
        p = f"blk.{layer}."
        cos, sin = self._rope_table(layer, torch.arange(t, device=x.device))
        q_lat = self._rms(self._lin(x, self.w(p + "attn_q_a.weight")), self.w(p + "attn_q_a_norm.weight"))
        q = self._rms(self._lin(q_lat, self.w(p + "attn_q_b.weight")).unflatten(-1, (h, d)))
        q = self._rope(q, cos[:, None], sin[:, None])
        kv = self._rms(self._lin(x, self.w(p + "attn_kv.weight")), self.w(p + "attn_kv_a_norm.weight"))
        keys = self._f16(self._rope(kv, cos, sin))
        tq = torch.arange(t, device=x.device)[:, None]
        ts = torch.arange(t, device=x.device)[None, :]
        mask = ((ts <= tq) & (ts > tq - cfg.sliding_window)).expand(b, t, t)
        nb = t // m if m else 0
        comp = None
        if nb:
            comp = self._compressed(layer, "attn_compressor", x, m)
            vis = torch.arange(nb, device=x.device)[None, :] < ((tq + 1) // m)  # [T, nb]
            if m == 4:
                sel, scores = self._indexer(layer, x, q_lat, vis)
            else:
                sel = vis.expand(b, t, nb)
            keys = torch.cat([keys, comp], dim=1)
            mask = torch.cat([mask, sel], dim=-1)
        logits = torch.einsum("bthd,bsd->bhts", q, keys) * (1.0 / math.sqrt(d))
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        sink = self.w(p + "attn_sinks.weight")[None, :, None]
        mx = torch.maximum(logits.amax(-1), sink).detach()
        e = torch.exp(logits - mx.unsqueeze(-1))
        denom = e.sum(-1) + torch.exp(sink - mx)
        o = torch.einsum("bhts,bsd->bthd", e, keys) / denom.transpose(1, 2).unsqueeze(-1)
        if nb and m == 4 and self.training:
            aux.append(self._indexer_kl(logits[..., t:].detach(), scores, vis))
        o = self._rope(o, cos[:, None], sin[:, None], inverse=True)
        g = cfg.o_groups
        wo_a = self.w(p + "attn_output_a.weight").unflatten(0, (g, cfg.o_lora_rank))
        z = torch.einsum("btgi,goi->btgo", o.reshape(b, t, g, -1), wo_a)
        return self._lin(z.flatten(-2), self.w(p + "attn_output_b.weight"))

    def _indexer(self, layer: int, x: torch.Tensor, q_lat: torch.Tensor, vis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Lightning indexer (spec §4.5): the selected compressed rows [B, T, nb] and the scores."""
        cfg = self.cfg
        b, t, _ = x.shape
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        p = f"blk.{layer}."
        # the indexer learns only from its KL objective; its inputs are detached from the trunk
        xd, qd = (x.detach(), q_lat.detach()) if self.training else (x, q_lat)
        keys = self._compressed(layer, "indexer_compressor", xd, 4)  # [B, nb, di]
        cos, sin = self._rope_table(layer, torch.arange(t, device=x.device))
        qi = self._rope(self._lin(qd, self.w(p + "indexer.attn_q_b.weight")).unflatten(-1, (hi, di)), cos[:, None], sin[:, None])
        wi = self._lin(xd, self.w(p + "indexer.proj.weight")) * (1.0 / math.sqrt(di * hi))
        dots = torch.relu(torch.einsum("bthd,bsd->bths", qi, keys))
        scores = torch.einsum("bth,bths->bts", wi, dots)
        nb = keys.shape[1]
        k = min(cfg.index_topk, nb)
        masked = scores.detach().masked_fill(~vis, float("-inf"))
        # ties to the lower row, as the reference: subtract a tiny index ramp only among exact ties
        idx = _topk_lowest_index(masked, k)
        sel = torch.zeros(b, t, nb, dtype=torch.bool, device=x.device).scatter_(-1, idx, True) & vis
        return sel, scores

    @staticmethod
    def _indexer_kl(comp_logits: torch.Tensor, scores: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
        """KL(attention over visible compressed rows, head-averaged || softmax of indexer scores).

        Written without data-dependent shapes (no host sync): queries that see no compressed row
        get a zero target and drop out of the mean.
        """
        has = vis.any(-1)  # [T]
        rows_ok = has[:, None]
        lg = torch.where(vis & rows_ok, comp_logits, torch.where(rows_ok, float("-inf"), 0.0))
        target = torch.softmax(lg, dim=-1).mean(1) * vis  # [B, T, nb]
        sc = torch.where(vis & rows_ok, scores, torch.where(rows_ok, float("-inf"), 0.0))
        logp = torch.log_softmax(sc, dim=-1).masked_fill(~vis, 0.0)  # target is 0 there: keep 0·log finite
        kl = (target * (torch.log(target.clamp_min(1e-30)) - logp)).sum(-1)  # [B, T]
        return kl.sum() / (has.sum() * kl.shape[0]).clamp_min(1)

    # --- MoE (spec §5) -----------------------------------------------------------------------

    @staticmethod
    def _swiglu(g: torch.Tensor, u: torch.Tensor, lim: float) -> torch.Tensor:
        if lim > 0:
            u = u.clamp(-lim, lim)
            g = g.clamp(max=lim)
        return F.silu(g) * u

    def _moe(self, layer: int, x: torch.Tensor, tokens: torch.Tensor, loads: dict) -> torch.Tensor:
        cfg = self.cfg
        p = f"blk.{layer}."
        s = torch.sqrt(F.softplus(self._lin(x, self.w(p + "ffn_gate_inp.weight"))))
        if cfg.is_hash_layer(layer):
            ids = self.w(p + "ffn_gate_tid2eid.weight")[tokens].long()
        else:
            ids = _topk_lowest_index((s + self.w(p + "exp_probs_b.bias")).detach(), cfg.n_expert_used)
            loads[layer] = torch.zeros(cfg.n_expert, device=x.device).index_add_(
                0, ids.reshape(-1), torch.ones(ids.numel(), device=x.device))
        wsel = torch.gather(s, -1, ids)
        if cfg.expert_weights_norm:
            wsel = wsel / wsel.sum(-1, keepdim=True).clamp_min(ROUTER_DENOM_MIN)
        wsel = wsel * cfg.expert_weights_scale
        gate = torch.zeros(*x.shape[:-1], cfg.n_expert, device=x.device, dtype=wsel.dtype).scatter_add(-1, ids, wsel)
        lim = float(cfg.swiglu_clamp_exp[layer])
        a = self._swiglu(torch.einsum("btd,efd->btef", x, self.w(p + "ffn_gate_exps.weight")),
                         torch.einsum("btd,efd->btef", x, self.w(p + "ffn_up_exps.weight")), lim)
        # a: [B, T, E, F]; y_e = W2_e a_e, mixed with the (zero where unselected) router weights
        y = torch.einsum("btef,edf->bted", a, self.w(p + "ffn_down_exps.weight"))
        out = torch.einsum("bte,bted->btd", gate, y)
        if cfg.n_expert_shared:
            lim_s = float(cfg.swiglu_clamp_shexp[layer])
            a = self._swiglu(self._lin(x, self.w(p + "ffn_gate_shexp.weight")),
                             self._lin(x, self.w(p + "ffn_up_shexp.weight")), lim_s)
            out = out + self._lin(a, self.w(p + "ffn_down_shexp.weight"))
        return out

    # --- whole model -------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Aux]:
        """Logits [B, T, V] (fp32) of sequences starting at position 0, and the training by-products."""
        cfg = self.cfg
        x = self.w("token_embd.weight")[tokens]
        x = x.unsqueeze(-2).expand(*x.shape[:-1], cfg.hc_mult, cfg.n_embd)
        kl: list[torch.Tensor] = []
        loads: dict[int, torch.Tensor] = {}
        for il in range(cfg.n_layer):
            p = f"blk.{il}."
            u, post, comb = self._hc_pre(x, "attn", il)
            x = self._hc_post(self._attention(il, self._rms(u, self.w(p + "attn_norm.weight")), kl), x, post, comb)
            u, post, comb = self._hc_pre(x, "ffn", il)
            x = self._hc_post(self._moe(il, self._rms(u, self.w(p + "ffn_norm.weight")), tokens, loads), x, post, comb)
        fn = self.w("output_hc_fn.weight")
        m = self._mix(x, fn)
        wgt = torch.sigmoid(self.w("output_hc_scale.weight")[0] * m + self.w("output_hc_base.weight")) + cfg.hc_eps
        h = (wgt.unsqueeze(-1) * x).sum(-2)
        logits = self._lin(self._rms(h, self.w("output_norm.weight")), self.w("output.weight"))
        kl_loss = torch.stack(kl).mean() if kl else logits.new_zeros(())
        return logits, Aux(kl_loss, loads)

    @torch.no_grad()
    def balance_router(self, loads: dict[int, torch.Tensor], rate: float) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): raise the bias of under-used experts, lower over-used."""
        for layer, load in loads.items():
            b = self.w(f"blk.{layer}.exp_probs_b.bias")
            b += rate * torch.sign(load.mean() - load)


def _topk_lowest_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the top ``k`` along the last axis, exact ties broken towards the lower index.

    torch.topk breaks ties arbitrarily; the reference (a stable sort) takes the lower index. A
    stable descending sort gives the reference's choice.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
