"""The weights the reference reads: GGUF tensor names (spec §11.3) and their numpy shapes.

Numpy shape = reversed ggml ne, so a projection W is [out, in] and y = W·x.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..config import DS4Config


def weight_shapes(cfg: DS4Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the trunk needs, by GGUF name, with its numpy shape (MTP tensors excluded)."""
    d, v, h, hd = cfg.n_embd, cfg.n_vocab, cfg.n_head, cfg.head_dim
    n_hc, g, ol = cfg.hc_mult, cfg.o_groups, cfg.o_lora_rank
    ffn, ne = cfg.expert_ffn, cfg.n_expert
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (v, d),
        "output.weight": (v, d),
        "output_norm.weight": (d,),
        "output_hc_fn.weight": (n_hc, n_hc * d),
        "output_hc_base.weight": (n_hc,),
        "output_hc_scale.weight": (1,),
    }
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        m = cfg.compress_ratios[il]
        for site in ("attn", "ffn"):
            shapes[p + f"hc_{site}_fn.weight"] = (cfg.hc_mix, n_hc * d)
            shapes[p + f"hc_{site}_base.weight"] = (cfg.hc_mix,)
            shapes[p + f"hc_{site}_scale.weight"] = (3,)
        shapes.update({
            p + "attn_norm.weight": (d,),
            p + "ffn_norm.weight": (d,),
            p + "attn_q_a.weight": (cfg.q_lora_rank, d),
            p + "attn_q_a_norm.weight": (cfg.q_lora_rank,),
            p + "attn_q_b.weight": (h * hd, cfg.q_lora_rank),
            p + "attn_kv.weight": (hd, d),
            p + "attn_kv_a_norm.weight": (hd,),
            p + "attn_sinks.weight": (h,),
            p + "attn_output_a.weight": (g * ol, (h // g) * hd),
            p + "attn_output_b.weight": (d, g * ol),
            p + "ffn_gate_inp.weight": (ne, d),
            p + "ffn_gate_exps.weight": (ne, ffn, d),
            p + "ffn_up_exps.weight": (ne, ffn, d),
            p + "ffn_down_exps.weight": (ne, d, ffn),
        })
        if m:
            coff = 2 if m == 4 else 1
            shapes.update({
                p + "attn_compressor_kv.weight": (coff * hd, d),
                p + "attn_compressor_gate.weight": (coff * hd, d),
                p + "attn_compressor_ape.weight": (m, coff * hd),
                p + "attn_compressor_norm.weight": (hd,),
            })
        if m == 4:
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            shapes.update({
                p + "indexer.attn_q_b.weight": (hi * di, cfg.q_lora_rank),
                p + "indexer.proj.weight": (hi, d),
                p + "indexer_compressor_kv.weight": (2 * di, d),
                p + "indexer_compressor_gate.weight": (2 * di, d),
                p + "indexer_compressor_ape.weight": (4, 2 * di),
                p + "indexer_compressor_norm.weight": (di,),
            })
        if cfg.is_hash_layer(il):
            shapes[p + "ffn_gate_tid2eid.weight"] = (v, cfg.n_expert_used)
        else:
            shapes[p + "exp_probs_b.bias"] = (ne,)
        if cfg.n_expert_shared:
            shapes.update({
                p + "ffn_gate_shexp.weight": (ffn, d),
                p + "ffn_up_shexp.weight": (ffn, d),
                p + "ffn_down_shexp.weight": (d, ffn),
            })
    return shapes


def check_weights(cfg: DS4Config, weights: Mapping[str, np.ndarray]) -> None:
    """Raise ValueError naming the first missing or misshapen tensor; extra tensors are ignored."""
    for name, shape in weight_shapes(cfg).items():
        if name not in weights:
            raise ValueError(f"missing tensor {name} (numpy shape {shape})")
        got = tuple(np.shape(weights[name]))
        if got != shape:
            raise ValueError(f"tensor {name} has numpy shape {got}, expected {shape}")
