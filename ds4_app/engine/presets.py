"""Named model shapes: ``tiny`` for tests, ``flash-l4`` and ``flash`` for DeepSeek-V4-Flash.

Only the hyperparameters live here; the tensor types of each preset live with the synthesizer.
"""

from __future__ import annotations

from .config import DS4Config

FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)


def tiny() -> DS4Config:
    """Small enough for fast CPU tests, with every DS4 feature.

    Ratios 0, 4, 128 and 4 again; layer 0 hash-routed; an indexer whose top-k (8) is smaller
    than the visible compressed rows past 32 tokens; 8 experts, 2 per token, plus the shared
    expert; 4 mHC streams. d and the expert width are 256 so every quantized type's block size
    (Q4_K needs rows of 256) divides them.
    """
    return DS4Config(
        n_vocab=1024, n_embd=256, n_layer=4, n_head=4, head_dim=128, rope_dim=64,
        q_lora_rank=64, o_groups=2, o_lora_rank=64, compress_ratios=(0, 4, 128, 4),
        index_n_heads=4, index_head_dim=64, index_topk=8,
        n_expert=8, n_expert_used=2, n_expert_shared=1, expert_ffn=256,
        expert_weights_scale=1.5, n_hash_layers=1,
        swiglu_clamp_exp=(10.0,) * 4, swiglu_clamp_shexp=(10.0,) * 4,
        context_length=4096,
    )


def flash(n_layer: int = 43) -> DS4Config:
    """DeepSeek-V4-Flash (spec §1.1), optionally truncated to its first ``n_layer`` layers."""
    return DS4Config(
        n_vocab=129280, n_embd=4096, n_layer=n_layer, n_head=64, head_dim=512, rope_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, compress_ratios=FLASH_RATIOS[:n_layer],
        index_n_heads=64, index_head_dim=128, index_topk=512,
        n_expert=256, n_expert_used=6, n_expert_shared=1, expert_ffn=2048,
        expert_weights_scale=1.5, n_hash_layers=min(3, n_layer),
        swiglu_clamp_exp=(10.0,) * n_layer, swiglu_clamp_shexp=(10.0,) * n_layer,
        context_length=1048576,
    )


PRESETS = {"tiny": tiny, "flash-l4": lambda: flash(4), "flash": flash}


def preset(name: str) -> DS4Config:
    """The config of a named preset; ValueError names the choices."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
