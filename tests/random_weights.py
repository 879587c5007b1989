"""Random float32 weights for a DS4Config, scaled so activations stay finite through the model.

Matrices are N(0, 1/fan_in) (std 1/√fan_in, fan_in = the last numpy axis), norm weights ≈ 1,
embeddings N(0, 1), biases and offsets small; ``tid2eid`` holds distinct expert ids per token.
"""

from __future__ import annotations

import numpy as np

from ds4_app.engine.config import DS4Config
from ds4_app.engine.reference import weight_shapes


def random_weights(cfg: DS4Config, seed: int = 0) -> dict[str, np.ndarray]:
    """A weights dict (GGUF names, numpy shapes) for ``cfg``, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("ffn_gate_tid2eid.weight"):
            ids = np.argsort(rng.random((shape[0], cfg.n_expert)), axis=1)[:, :shape[1]]
            out[name] = ids.astype(np.int32)
            continue
        if name == "token_embd.weight":
            a = rng.standard_normal(shape)
        elif name.endswith(("_norm.weight", "norm.weight")):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("_scale.weight"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(("_base.weight", "attn_compressor_ape.weight", "indexer_compressor_ape.weight")):
            a = 0.5 * rng.standard_normal(shape)
        elif name.endswith("attn_sinks.weight"):
            a = rng.standard_normal(shape)
        elif name.endswith("exp_probs_b.bias"):
            a = 0.1 * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = a.astype(np.float32)
    return out
