"""The DS4 tensor table: every trunk tensor's GGUF name, ggml shape and allowed types for a config.

Names and shapes follow ds4_spec.md §11.3 (normative). ``ne`` is in ggml order, [cols, rows, ...]
(the numpy shape is reversed); a matrix's fan-in is ``ne[0]``. The MTP block (``blk.{n_layer}..``
and ``nextn.*``) may also be in a file; it is not part of this table (design.md §3).

``kind`` says which storage types a tensor may have:

- ``"matrix"``: F32, F16, BF16, Q8_0, Q4_K or MXFP4; a block-quantized type only when ``ne[0]`` is
  a multiple of its block size (rows are quantized along ``ne[0]``).
- ``"float"``: F32, F16 or BF16. mHC mixing matrices and the compressors' position biases
  (ape): they feed fp32 math directly (design.md §3), and upstream stores them as F16/F32.
- ``"f32"``: F32 only: norms, sinks, the router bias, mHC scale and base (llama.cpp requires
  F32 for the last two, spec §11.2).
- ``"i32"``: I32 only: the hash-routing table ``ffn_gate_tid2eid``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .config import DS4Config

T = GGMLQuantizationType

# Every type the engine can read, first tier of design.md §4.
SUPPORTED_TYPES: frozenset[int] = frozenset(
    {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.MXFP4, T.I32})

ALLOWED_TYPES: dict[str, frozenset[int]] = {
    "matrix": frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.MXFP4}),
    "float": frozenset({T.F32, T.F16, T.BF16}),
    "f32": frozenset({T.F32}),
    "i32": frozenset({T.I32}),
}


def type_name(ggml_type: int) -> str:
    """The ggml name of a type id (``"Q4_K"``), or ``"type 99"`` for an id ggml does not know."""
    try:
        return T(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def parse_type(name: str | int) -> GGMLQuantizationType:
    """A ggml type from its name (case-insensitive) or id; ValueError names the unknown value."""
    if isinstance(name, int):
        return T(name)
    try:
        return T[name.upper()]
    except KeyError:
        raise ValueError(f"unknown ggml type {name!r}") from None


def tensor_nbytes(ggml_type: int, ne: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and ggml shape occupies (ne[0] must fill whole blocks)."""
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    return math.prod(ne) // block * size


class GgmlShape:
    """The numpy view of a ggml shape ``ne`` (columns first), for classes that carry one."""

    __slots__ = ()
    ne: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy shape (ne reversed)."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)


@dataclass(frozen=True, slots=True)
class TensorSpec(GgmlShape):
    """One trunk tensor: GGUF name, ggml shape (``ne``) and storage kind (module docstring)."""

    name: str
    ne: tuple[int, ...]
    kind: str

    def type_problem(self, ggml_type: int) -> str | None:
        """Why ``ggml_type`` cannot store this tensor, or None when it can."""
        if ggml_type not in SUPPORTED_TYPES:
            return (f"tensor {self.name} has unsupported type {type_name(ggml_type)} "
                    f"(supported: {', '.join(type_name(t) for t in sorted(SUPPORTED_TYPES))})")
        allowed = ALLOWED_TYPES[self.kind]
        if ggml_type not in allowed:
            return (f"tensor {self.name} has type {type_name(ggml_type)}; it must be "
                    f"{' or '.join(type_name(t) for t in sorted(allowed))}")
        block = GGML_QUANT_SIZES[T(ggml_type)][0]
        if self.ne[0] % block:
            return (f"tensor {self.name} has type {type_name(ggml_type)} but its rows of {self.ne[0]} "
                    f"are not a multiple of the block size {block}")
        return None


def tensor_specs(cfg: DS4Config) -> list[TensorSpec]:
    """Every trunk tensor of ``cfg`` (spec §11.3), globals first, then layer by layer."""
    d, v, hc = cfg.n_embd, cfg.n_vocab, cfg.hc_dim
    specs = [
        TensorSpec("token_embd.weight", (d, v), "matrix"),
        TensorSpec("output_norm.weight", (d,), "f32"),
        TensorSpec("output_hc_fn.weight", (hc, cfg.hc_mult), "float"),
        TensorSpec("output_hc_base.weight", (cfg.hc_mult,), "f32"),
        TensorSpec("output_hc_scale.weight", (1,), "f32"),
        TensorSpec("output.weight", (d, v), "matrix"),
    ]
    for i in range(cfg.n_layer):
        specs += _layer_specs(cfg, i)
    return specs


def _layer_specs(cfg: DS4Config, i: int) -> list[TensorSpec]:
    d, hc, mix = cfg.n_embd, cfg.hc_dim, cfg.hc_mix
    p = f"blk.{i}."
    out: list[TensorSpec] = []

    def add(name: str, ne: tuple[int, ...], kind: str) -> None:
        out.append(TensorSpec(p + name, ne, kind))

    for site in ("attn", "ffn"):
        add(f"hc_{site}_fn.weight", (hc, mix), "float")
        # scale holds one factor each for pre, post and comb (spec §3.1)
        add(f"hc_{site}_scale.weight", (3,), "f32")
        add(f"hc_{site}_base.weight", (mix,), "f32")
    add("attn_norm.weight", (d,), "f32")
    add("ffn_norm.weight", (d,), "f32")

    hd = cfg.head_dim
    add("attn_q_a.weight", (d, cfg.q_lora_rank), "matrix")
    add("attn_q_a_norm.weight", (cfg.q_lora_rank,), "f32")
    add("attn_q_b.weight", (cfg.q_lora_rank, cfg.n_head * hd), "matrix")
    add("attn_kv.weight", (d, hd), "matrix")
    add("attn_kv_a_norm.weight", (hd,), "f32")
    add("attn_sinks.weight", (cfg.n_head,), "f32")
    # grouped low-rank output (spec §4.8): each group maps its heads' slice to o_lora_rank
    add("attn_output_a.weight", (cfg.n_head * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank), "matrix")
    add("attn_output_b.weight", (cfg.o_groups * cfg.o_lora_rank, d), "matrix")

    ratio = cfg.compress_ratios[i]
    if ratio > 0:
        coff = 2 if ratio == 4 else 1  # CSA's overlapping windows carry two channel halves
        add("attn_compressor_kv.weight", (d, coff * hd), "matrix")
        add("attn_compressor_gate.weight", (d, coff * hd), "matrix")
        add("attn_compressor_ape.weight", (coff * hd, ratio), "float")
        add("attn_compressor_norm.weight", (hd,), "f32")
    if ratio == 4:
        ih = cfg.index_head_dim
        add("indexer.attn_q_b.weight", (cfg.q_lora_rank, cfg.index_n_heads * ih), "matrix")
        add("indexer.proj.weight", (d, cfg.index_n_heads), "matrix")
        add("indexer_compressor_kv.weight", (d, 2 * ih), "matrix")
        add("indexer_compressor_gate.weight", (d, 2 * ih), "matrix")
        add("indexer_compressor_ape.weight", (2 * ih, 4), "float")
        add("indexer_compressor_norm.weight", (ih,), "f32")

    e, f = cfg.n_expert, cfg.expert_ffn
    add("ffn_gate_inp.weight", (d, e), "matrix")
    if cfg.is_hash_layer(i):
        add("ffn_gate_tid2eid.weight", (cfg.n_expert_used, cfg.n_vocab), "i32")
    else:
        add("exp_probs_b.bias", (e,), "f32")
    add("ffn_gate_exps.weight", (d, f, e), "matrix")
    add("ffn_up_exps.weight", (d, f, e), "matrix")
    add("ffn_down_exps.weight", (f, d, e), "matrix")
    if cfg.n_expert_shared:
        add("ffn_gate_shexp.weight", (d, f), "matrix")
        add("ffn_up_shexp.weight", (d, f), "matrix")
        add("ffn_down_shexp.weight", (f, d), "matrix")
    return out


def is_mtp_tensor(name: str, cfg: DS4Config) -> bool:
    """True for tensors of the MTP block(s), which a file may carry and we skip (spec §11.3)."""
    if name.startswith("mtp.") or ".nextn." in name or name.startswith("nextn."):
        return True
    if name.startswith("blk."):
        idx = name.split(".", 2)[1]
        if idx.isdigit():
            return cfg.n_layer <= int(idx) < cfg.n_layer + cfg.n_nextn
    return False
