"""DS4Config: the model's hyperparameters, read from GGUF metadata and validated once.

Keys follow upstream llama.cpp's ``deepseek4.*`` names (ds4_spec.md §11.2), so a DeepSeek-V4
GGUF made for llama.cpp loads, and our tiny test models take exactly the same path. Every value
the math depends on is explicit here; nothing is defaulted silently when its absence would change
the math (spec §11.2 lists the keys llama.cpp gets wrong when absent).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

ARCH = "deepseek4"
PAGE_TOKENS = 128  # logical tokens per page of compressed history
RING_ROWS = 128  # raw sliding-window ring rows per layer per slot


class ConfigError(ValueError):
    """The metadata does not describe a DS4 model we can run (one line, names the key)."""


@dataclass(frozen=True, slots=True)
class RopeParams:
    """RoPE for one layer: base frequency and the YaRN ramp (factor 1 means no YaRN)."""

    base: float
    yarn_factor: float
    orig_ctx: int
    beta_fast: float
    beta_slow: float

    def inv_freqs(self, rope_dim: int) -> list[float]:
        """theta'_k for k in 0..rope_dim/2-1 (spec §4.3), in float64."""
        half = rope_dim // 2
        theta = [self.base ** (-2.0 * k / rope_dim) for k in range(half)]
        if self.yarn_factor == 1.0 or self.orig_ctx <= 0:
            return theta

        def corr(beta: float) -> float:
            return rope_dim * math.log(self.orig_ctx / (2 * math.pi * beta)) / (2 * math.log(self.base))

        low = max(0, math.floor(corr(self.beta_fast)))
        high = min(rope_dim - 1, math.ceil(corr(self.beta_slow)))
        if high == low:
            high = low + 0.001  # as the reference code does, avoid a zero-width ramp
        out = []
        for k in range(half):
            ramp = min(1.0, max(0.0, (k - low) / (high - low)))
            out.append(theta[k] / self.yarn_factor * ramp + theta[k] * (1.0 - ramp))
        return out


@dataclass(frozen=True, slots=True)
class DS4Config:
    """Hyperparameters of a DS4 model (names as in ds4_spec.md §1 and §11.2)."""

    n_vocab: int
    n_embd: int
    n_layer: int  # trunk layers (block_count - nextn)
    n_head: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    compress_ratios: tuple[int, ...]  # one per trunk layer: 0 (SWA), 4 (CSA) or 128 (HCA)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    expert_ffn: int
    expert_weights_scale: float
    n_hash_layers: int
    swiglu_clamp_exp: tuple[float, ...]
    swiglu_clamp_shexp: tuple[float, ...]
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    compress_rope_base: float = 160000.0
    yarn_factor: float = 16.0
    yarn_orig_ctx: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    sliding_window: int = 128
    context_length: int = 1048576
    n_nextn: int = 0
    expert_weights_norm: bool = True
    qat_numerics: bool = False  # ds4app.qat_numerics: the spec §7 round trips (FP8 KV, FP4 indexer)
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.n_layer >= 1, "deepseek4.block_count must leave at least one trunk layer")
        need(len(self.compress_ratios) == self.n_layer,
             f"deepseek4.attention.compress_ratios has {len(self.compress_ratios)} entries for {self.n_layer} layers")
        for i, r in enumerate(self.compress_ratios):
            need(r in (0, 4, 128), f"deepseek4.attention.compress_ratios[{i}] = {r}; DS4 layers use 0, 4 or 128")
        need(self.sliding_window == RING_ROWS,
             f"deepseek4.attention.sliding_window = {self.sliding_window}; the paged engine needs {RING_ROWS}")
        need(self.rope_dim % 2 == 0 and 0 < self.rope_dim <= self.head_dim,
             f"deepseek4.rope.dimension_count = {self.rope_dim} must be even and at most key_length {self.head_dim}")
        need(self.n_head % self.o_groups == 0,
             f"attention.head_count {self.n_head} is not divisible by attention.output_group_count {self.o_groups}")
        need(self.hc_mult >= 1, "hyper_connection.count must be positive")
        need(1 <= self.n_expert_used <= self.n_expert, "expert_used_count must be in 1..expert_count")
        need(self.n_expert_shared in (0, 1), "expert_shared_count must be 0 or 1")
        need(0 <= self.n_hash_layers <= self.n_layer, "hash_layer_count exceeds the layer count")
        need(len(self.swiglu_clamp_exp) == self.n_layer, "swiglu_clamp_exp needs one value per layer")
        need(len(self.swiglu_clamp_shexp) == self.n_layer, "swiglu_clamp_shexp needs one value per layer")
        if any(r == 4 for r in self.compress_ratios):
            d = self.index_head_dim
            need(d >= self.rope_dim and d & (d - 1) == 0,
                 f"attention.indexer.key_length = {d} must be a power of two >= the RoPE dims")
            need(self.index_topk >= 1 and self.index_n_heads >= 1, "the indexer needs heads and a top-k")
        if self.qat_numerics:
            need((self.head_dim - self.rope_dim) % 64 == 0,
                 "qat_numerics needs (key_length - rope dims) to be a multiple of 64 (FP8 blocks)")
            need(self.index_head_dim % 32 == 0, "qat_numerics needs indexer.key_length a multiple of 32")

    # --- derived quantities -------------------------------------------------------------

    @property
    def hc_dim(self) -> int:
        """Width of the flattened mHC state (n_hc · d)."""
        return self.hc_mult * self.n_embd

    @property
    def hc_mix(self) -> int:
        """Rows of an mHC site's fn matrix: (2 + n_hc) · n_hc."""
        return (2 + self.hc_mult) * self.hc_mult

    def is_hash_layer(self, layer: int) -> bool:
        """Layers below hash_layer_count route by token id (tid2eid), not by the biased top-k."""
        return layer < self.n_hash_layers

    def rope(self, layer: int) -> RopeParams:
        """Per-layer RoPE: plain base on sliding-only layers, compressed base + YaRN otherwise."""
        if self.compress_ratios[layer] == 0:
            return RopeParams(self.rope_base, 1.0, 0, self.yarn_beta_fast, self.yarn_beta_slow)
        return RopeParams(self.compress_rope_base, self.yarn_factor, self.yarn_orig_ctx,
                          self.yarn_beta_fast, self.yarn_beta_slow)

    def layers_with_ratio(self, ratio: int) -> list[int]:
        return [i for i, r in enumerate(self.compress_ratios) if r == ratio]

    # --- GGUF metadata ------------------------------------------------------------------

    @staticmethod
    def from_metadata(kv: Mapping[str, Any]) -> "DS4Config":
        """Build and validate a config from GGUF key/values (plain Python values)."""
        arch = kv.get("general.architecture")
        if arch != ARCH:
            raise ConfigError(f"general.architecture is {arch!r}, expected {ARCH!r}")

        def get(key: str, default: Any = _REQUIRED) -> Any:
            full = f"{ARCH}.{key}"
            if full in kv:
                return kv[full]
            if default is _REQUIRED:
                raise ConfigError(f"missing metadata key {full}")
            return default

        block_count = int(get("block_count"))
        nextn = int(get("nextn_predict_layers", 0))
        n_layer = block_count - nextn
        ratios = [int(r) for r in _as_list(get("attention.compress_ratios"))]
        if len(ratios) < block_count:
            raise ConfigError(f"{ARCH}.attention.compress_ratios has {len(ratios)} entries, "
                              f"block_count is {block_count}")

        def per_layer(key: str, default: Any = _REQUIRED) -> tuple[float, ...]:
            v = get(key, default)
            vals = _as_list(v)
            if len(vals) == 1 and not isinstance(v, (list, tuple)):
                return tuple(float(vals[0]) for _ in range(n_layer))
            if len(vals) != block_count:
                raise ConfigError(f"{ARCH}.{key} has {len(vals)} entries, block_count is {block_count}")
            return tuple(float(x) for x in vals[:n_layer])

        gating = int(get("expert_gating_func"))
        if gating != 4:
            raise ConfigError(f"{ARCH}.expert_gating_func = {gating}; DS4 uses 4 (sqrt-softplus)")
        if int(get("attention.head_count_kv")) != 1:
            raise ConfigError(f"{ARCH}.attention.head_count_kv must be 1 (one shared K=V latent)")
        key_len = int(get("attention.key_length"))
        if int(get("attention.value_length")) != key_len:
            raise ConfigError(f"{ARCH}.attention.value_length must equal key_length")
        if int(get("expert_group_count", 0)) not in (0, 1):
            raise ConfigError(f"{ARCH}.expert_group_count: group-limited routing is not DS4")
        scaling = str(get("rope.scaling.type"))
        if scaling not in ("yarn", "none"):
            raise ConfigError(f"{ARCH}.rope.scaling.type = {scaling!r}; DS4 uses yarn")
        ffn = _as_list(get("expert_feed_forward_length"))
        if len(set(int(x) for x in ffn)) != 1:
            raise ConfigError(f"{ARCH}.expert_feed_forward_length must be the same for every layer")
        clamp_exp = per_layer("swiglu_clamp_exp")
        clamp_sh = per_layer("swiglu_clamp_shexp", kv.get(f"{ARCH}.swiglu_clamp_exp"))
        has_csa = any(r == 4 for r in ratios[:n_layer])
        return DS4Config(
            n_vocab=int(get("vocab_size")),
            n_embd=int(get("embedding_length")),
            n_layer=n_layer,
            n_nextn=nextn,
            n_head=int(get("attention.head_count")),
            head_dim=key_len,
            rope_dim=int(get("rope.dimension_count")),
            q_lora_rank=int(get("attention.q_lora_rank")),
            o_groups=int(get("attention.output_group_count")),
            o_lora_rank=int(get("attention.output_lora_rank")),
            sliding_window=int(get("attention.sliding_window")),
            compress_ratios=tuple(ratios[:n_layer]),
            compress_rope_base=float(get("attention.compress_rope_freq_base")),
            index_n_heads=int(get("attention.indexer.head_count", 0 if not has_csa else _REQUIRED)),
            index_head_dim=int(get("attention.indexer.key_length", 0 if not has_csa else _REQUIRED)),
            index_topk=int(get("attention.indexer.top_k", 0 if not has_csa else _REQUIRED)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            n_expert=int(get("expert_count")),
            n_expert_used=int(get("expert_used_count")),
            n_expert_shared=int(get("expert_shared_count")),
            expert_ffn=int(ffn[0]),
            expert_weights_scale=float(get("expert_weights_scale")),
            expert_weights_norm=bool(get("expert_weights_norm")),
            n_hash_layers=int(get("hash_layer_count")),
            hc_mult=int(get("hyper_connection.count")),
            hc_sinkhorn_iters=int(get("hyper_connection.sinkhorn_iterations")),
            hc_eps=float(get("hyper_connection.epsilon")),
            rope_base=float(get("rope.freq_base")),
            yarn_factor=float(get("rope.scaling.factor")) if scaling == "yarn" else 1.0,
            yarn_orig_ctx=int(get("rope.scaling.original_context_length")) if scaling == "yarn" else 0,
            yarn_beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            yarn_beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            swiglu_clamp_exp=clamp_exp,
            swiglu_clamp_shexp=clamp_sh,
            context_length=int(get("context_length")),
            qat_numerics=bool(kv.get("ds4app.qat_numerics", False)),
            extra={k: v for k, v in kv.items() if k.startswith("ds4app.")},
        )

    def metadata_items(self) -> list[tuple[str, Any, str]]:
        """(key, value, kind) triples that ``from_metadata`` reads back to an equal config.

        kind is one of "string", "uint32", "float32", "bool", "int32_array", "float32_array".
        """
        p = ARCH + "."
        n = self.n_layer + self.n_nextn
        ratios = list(self.compress_ratios) + [0] * self.n_nextn
        items: list[tuple[str, Any, str]] = [
            ("general.architecture", ARCH, "string"),
            (p + "block_count", n, "uint32"),
            (p + "context_length", self.context_length, "uint32"),
            (p + "embedding_length", self.n_embd, "uint32"),
            (p + "vocab_size", self.n_vocab, "uint32"),
            (p + "attention.head_count", self.n_head, "uint32"),
            (p + "attention.head_count_kv", 1, "uint32"),
            (p + "attention.key_length", self.head_dim, "uint32"),
            (p + "attention.value_length", self.head_dim, "uint32"),
            (p + "rope.dimension_count", self.rope_dim, "uint32"),
            (p + "attention.q_lora_rank", self.q_lora_rank, "uint32"),
            (p + "attention.output_lora_rank", self.o_lora_rank, "uint32"),
            (p + "attention.output_group_count", self.o_groups, "uint32"),
            (p + "attention.sliding_window", self.sliding_window, "uint32"),
            (p + "attention.compress_ratios", ratios, "int32_array"),
            (p + "attention.compress_rope_freq_base", self.compress_rope_base, "float32"),
            (p + "attention.layer_norm_rms_epsilon", self.norm_eps, "float32"),
            (p + "expert_count", self.n_expert, "uint32"),
            (p + "expert_used_count", self.n_expert_used, "uint32"),
            (p + "expert_shared_count", self.n_expert_shared, "uint32"),
            (p + "expert_feed_forward_length", self.expert_ffn, "uint32"),
            (p + "expert_weights_scale", self.expert_weights_scale, "float32"),
            (p + "expert_weights_norm", self.expert_weights_norm, "bool"),
            (p + "expert_gating_func", 4, "uint32"),
            (p + "hash_layer_count", self.n_hash_layers, "uint32"),
            (p + "hyper_connection.count", self.hc_mult, "uint32"),
            (p + "hyper_connection.sinkhorn_iterations", self.hc_sinkhorn_iters, "uint32"),
            (p + "hyper_connection.epsilon", self.hc_eps, "float32"),
            (p + "rope.freq_base", self.rope_base, "float32"),
            (p + "rope.scaling.type", "yarn" if self.yarn_factor != 1.0 else "none", "string"),
            (p + "rope.scaling.factor", self.yarn_factor, "float32"),
            (p + "rope.scaling.original_context_length", self.yarn_orig_ctx, "uint32"),
            (p + "rope.scaling.yarn_beta_fast", self.yarn_beta_fast, "float32"),
            (p + "rope.scaling.yarn_beta_slow", self.yarn_beta_slow, "float32"),
            (p + "swiglu_clamp_exp", list(self.swiglu_clamp_exp) + [10.0] * self.n_nextn, "float32_array"),
            (p + "swiglu_clamp_shexp", list(self.swiglu_clamp_shexp) + [10.0] * self.n_nextn, "float32_array"),
            (p + "nextn_predict_layers", self.n_nextn, "uint32"),
        ]
        if any(r == 4 for r in self.compress_ratios):
            items += [
                (p + "attention.indexer.head_count", self.index_n_heads, "uint32"),
                (p + "attention.indexer.key_length", self.index_head_dim, "uint32"),
                (p + "attention.indexer.top_k", self.index_topk, "uint32"),
            ]
        if self.qat_numerics:
            items.append(("ds4app.qat_numerics", True, "bool"))
        return items

    def summary(self) -> dict[str, Any]:
        """A plain dict for printing (inspect) and JSON."""
        d = asdict(self)
        d.pop("extra", None)
        return d


class _Required:
    def __repr__(self) -> str:
        return "<required>"


_REQUIRED: Any = _Required()


def _as_list(v: Any) -> list:
    if isinstance(v, (list, tuple)):
        return list(v)
    try:
        import numpy as np

        if isinstance(v, np.ndarray):
            return v.tolist()
    except ImportError:  # pragma: no cover
        pass
    return [v]
