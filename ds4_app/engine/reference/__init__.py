"""Numpy reference of DS4 (ds4_spec.md), the oracle every backend is tested against.

``Reference`` runs the whole model (incremental ``step`` with an explicit ``SeqState``, or
``forward_prompt`` over a whole prompt); the parts are exported for unit tests of other backends.
Numerics are those of design.md §3; see ``Reference`` for the exact choices.
"""

from .attention import (
    attend_with_sink, compress_block, compressor_update, indexer_scores, indexer_select,
    new_compressor_state, pool_block, prompt_blocks, rope_rotate, window_positions,
)
from .mhc import hc_head, hc_post, hc_pre, sinkhorn
from .model import Reference, SeqState
from .moe import combine_experts, expert_ffn, route
from .numerics import (
    fp4_roundtrip, fp8_e4m3_roundtrip, grouped_linear, hadamard, linear, rms_norm, round_e2m1,
    round_e4m3, round_f16, sigmoid, silu, softplus,
)
from .tensors import check_weights, weight_shapes

__all__ = [
    "Reference", "SeqState", "weight_shapes", "check_weights",
    "rms_norm", "linear", "grouped_linear", "sigmoid", "silu", "softplus", "round_f16",
    "fp8_e4m3_roundtrip", "fp4_roundtrip", "round_e4m3", "round_e2m1", "hadamard",
    "sinkhorn", "hc_pre", "hc_post", "hc_head",
    "rope_rotate", "new_compressor_state", "compressor_update", "prompt_blocks", "pool_block",
    "compress_block", "indexer_scores", "indexer_select", "attend_with_sink", "window_positions",
    "route", "expert_ffn", "combine_experts",
]
