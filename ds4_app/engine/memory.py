"""The memory plan: what the native engine allocates, computed before it allocates it.

``plan_memory`` is printed at start (and by ``ds4-app model inspect``) and is exactly what the
C++ engine allocates: a test checks ``Engine.allocated_bytes()`` against it section by section.
The formulas mirror ``ext/engine/paged_state.cpp`` and ``ext/engine/scratch.cpp``.
``plan_device_memory`` is the same for the GPU engine (``ext/gpu/engine_gpu.cu``), whose device
allocations are the CPU engine's paged state plus its own inputs, scratch and a weights copy.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from .config import PAGE_TOKENS, RING_ROWS, DS4Config

SECTIONS = ("rings", "compressor_state", "pages", "block_tables", "scratch", "weights_mapped")
DEVICE_SECTIONS = ("rings", "compressor_state", "pages", "step_inputs", "scratch", "weights_device")
_F16 = 2
_F32 = 4
_ALIGN = 64  # every scratch buffer starts on a cache line


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes per section of the engine's allocations, the page count and their total."""

    sections: dict[str, int]
    n_pages: int
    total: int

    def format(self) -> str:
        """A readable table in MiB, one section a line, then the total and the page count."""
        width = max(len(k) for k in self.sections)
        lines = [f"{'section':<{width}}  {'MiB':>12}"]
        for name, nbytes in self.sections.items():
            lines.append(f"{name:<{width}}  {nbytes / 2**20:12.3f}")
        lines.append(f"{'total':<{width}}  {self.total / 2**20:12.3f}")
        lines.append(f"page pool: {self.n_pages} pages of {PAGE_TOKENS} tokens "
                     f"({self.n_pages * PAGE_TOKENS} tokens of compressed history)")
        return "\n".join(lines)


def plan_memory(cfg: DS4Config, *, max_slots: int, max_ctx: int, kv_pool_tokens: int | None = None,
                max_rows: int = 16, weights_bytes: int = 0) -> MemoryPlan:
    """The engine's allocations for ``max_slots`` sequences of up to ``max_ctx`` tokens.

    With D = head_dim, Di = index_head_dim, CSA/HCA the layers of ratio 4/128, and S = max_slots:

    - n_pages = ceil(kv_pool_tokens / 128) if given, else ceil(max_ctx / 128) * S.
    - rings = n_layer * S * 128 * D * 2 (f16 raw window rows, every layer).
    - compressor_state = S * 4 * (|CSA| * (2*8*2D + 2*8*2Di) + |HCA| * 2*128*D)
      (fp32 value and score: CSA 8 rows at double width, its indexer likewise, HCA 128 rows).
    - pages = n_pages * 2 * (|CSA| * 32 * (D + Di) + |HCA| * D)
      (f16 compressed rows of 128 tokens: 32 rows per CSA layer plus 32 indexer rows, 1 per HCA).
    - block_tables = (S * ceil(max_ctx / 128) + n_pages) * 4 (int32 tables, plus a page -> slot
      map that lets a step refuse a page named by two slots).
    - scratch = sum over the step arena's buffers (``_scratch_buffers``) of 4 * elements rounded
      up to 64 bytes; it scales with max_rows, and with max_ctx only through the indexer's
      candidate list and the attention logits.
    - weights_mapped = weights_bytes (the model file, mapped read-only, not copied).

    Doubling S doubles rings, compressor_state and block_tables; pages depend only on n_pages.
    """
    if max_slots < 1 or max_ctx < 1 or max_rows < 1:
        raise ValueError("plan_memory needs max_slots, max_ctx and max_rows >= 1")
    if kv_pool_tokens is not None and kv_pool_tokens < 1:
        raise ValueError(f"kv_pool_tokens must be positive, got {kv_pool_tokens}")
    pages_per_seq = -(-max_ctx // PAGE_TOKENS)
    n_pages = -(-kv_pool_tokens // PAGE_TOKENS) if kv_pool_tokens is not None else pages_per_seq * max_slots

    d_head, d_idx = cfg.head_dim, cfg.index_head_dim
    n_csa = len(cfg.layers_with_ratio(4))
    n_hca = len(cfg.layers_with_ratio(128))
    state_floats = n_csa * (2 * 8 * 2 * d_head + 2 * 8 * 2 * d_idx) + n_hca * 2 * 128 * d_head
    page_elems = n_csa * (PAGE_TOKENS // 4) * (d_head + d_idx) + n_hca * d_head
    sections = {
        "rings": cfg.n_layer * max_slots * RING_ROWS * d_head * _F16,
        "compressor_state": max_slots * state_floats * _F32,
        "pages": n_pages * page_elems * _F16,
        "block_tables": (max_slots * pages_per_seq + n_pages) * 4,
        "scratch": sum(_padded(n) for _, n in _scratch_buffers(cfg, max_rows, max_ctx)),
        "weights_mapped": int(weights_bytes),
    }
    return MemoryPlan(sections=sections, n_pages=n_pages, total=sum(sections.values()))


def plan_device_memory(cfg: DS4Config, *, max_slots: int, max_ctx: int, kv_pool_tokens: int | None = None,
                       max_rows: int = 16, weights_bytes: int = 0,
                       tensor_core_weights: Iterable[tuple[str, int, tuple[int, ...]]] | None = None) -> MemoryPlan:
    """The GPU engine's device allocations (``GpuEngine.allocated_bytes()`` equals these sections).

    rings, compressor_state and pages are ``plan_memory``'s (the same layout in device memory).
    With R = max_rows and B = ceil(max_ctx / 128):

    - step_inputs = (10 * R + R * B) * 4: the int32 arrays one host-to-device copy refreshes each
      step (ten per-lane or per-slot arrays, then up to R block-table rows).
    - scratch = sum over ``_device_scratch_buffers`` of bytes rounded up to 256, plus, when the
      tensor-core products are on (``DS4_GPU_MMA``; pass the file's weights as
      ``tensor_core_weights``: (name, ggml type, ne) each), ``tensor_core_scratch_bytes``.
    - weights_device = weights_bytes (the whole model file is copied to the device once).
    """
    host = plan_memory(cfg, max_slots=max_slots, max_ctx=max_ctx, kv_pool_tokens=kv_pool_tokens,
                       max_rows=max_rows, weights_bytes=weights_bytes)
    blocks = -(-max_ctx // PAGE_TOKENS)
    sections = {
        "rings": host.sections["rings"],
        "compressor_state": host.sections["compressor_state"],
        "pages": host.sections["pages"],
        "step_inputs": (10 * max_rows + max_rows * blocks) * 4,
        "scratch": sum(-(-b // _DEVICE_ALIGN) * _DEVICE_ALIGN
                       for _, b in _device_scratch_buffers(cfg, max_rows, max_ctx))
                   + (tensor_core_scratch_bytes(cfg, tensor_core_weights, max_rows)
                      if tensor_core_weights is not None else 0),
        "weights_device": int(weights_bytes),
    }
    return MemoryPlan(sections=sections, n_pages=host.n_pages, total=sum(sections.values()))


_DEVICE_ALIGN = 256

# The tensor-core products (ext/gpu/mma_matvec.cuh, ext/gpu/MMA.md "Phase 2"): the weight types they
# take (Q8_0, F16, Q4_K, BF16 as ggml type ids), and the expert parts the grouped scratch is sized for.
_MMA_TYPES = frozenset({8, 1, 12, 30})
_MMA_GROUPED_PARTS = 16  # engine_gpu.cu kMmaGroupedScratchParts


def _mma_kslices(ne0: int, ne1: int) -> int:
    """mma_kslices: how many pieces K is split into, from the shape alone."""
    n256, tiles, ks = ne0 // 256, (ne1 + 63) // 64, 1
    while ks < 16 and tiles * ks < 256 and n256 > 0 and n256 % (2 * ks) == 0:
        ks *= 2
    return ks


def _mma_dense_bytes(ne0: int, ne1: int, ncols: int) -> int:
    """mma_matvec_scratch_bytes: K-slice partials, and above 16 columns the split activations."""
    ks = _mma_kslices(ne0, ne1)
    part = ks * ncols * ne1 * 4 if ks > 1 else 0
    if ncols <= 16:
        return part
    return -(-ncols // 64) * 64 * (2 * ne0 + ne0 // 32) * 4 + -(-part // _DEVICE_ALIGN) * _DEVICE_ALIGN


def _mma_grouped_bytes(ne0: int, ne1: int, parts: int) -> int:
    """mma_grouped_scratch_bytes: K-slice partials of up to ``parts`` expert parts of 8 columns."""
    ks = _mma_kslices(ne0, ne1)
    return ks * 8 * parts * ne1 * 4 if ks > 1 else 0


def tensor_core_scratch_bytes(cfg: DS4Config, weights: Iterable[tuple[str, int, tuple[int, ...]]],
                              max_rows: int) -> int:
    """The one scratch buffer the GPU engine adds with the tensor-core products on: the largest any
    product wants at max_rows columns (attn_output_a per group of o_lora_rank rows; expert stacks
    for at most 16 parts), over the weights the tensor cores take, rounded up to 256 bytes."""
    need = 0
    for name, ggml_type, ne in weights:
        if ggml_type not in _MMA_TYPES or ne[0] % 256 or name == "token_embd.weight" or "_ape." in name:
            continue
        if len(ne) == 3:
            need = max(need, _mma_grouped_bytes(ne[0], ne[1], min(max_rows * cfg.n_expert_used, _MMA_GROUPED_PARTS)))
        elif len(ne) == 2:
            rows = ne[1] // cfg.o_groups if name.endswith("attn_output_a.weight") else ne[1]
            need = max(need, _mma_dense_bytes(ne[0], rows, max_rows))
    return -(-need // _DEVICE_ALIGN) * _DEVICE_ALIGN


def tensor_cores_requested() -> bool:
    """Whether ``DS4_GPU_MMA`` asks for the tensor-core products (the GPU module reads the same
    variable once; under HIP it keeps them off, which ``Runner`` accounts for)."""
    value = os.environ.get("DS4_GPU_MMA", "")
    return value not in ("", "0")


def _device_scratch_buffers(cfg: DS4Config, max_rows: int, max_ctx: int) -> list[tuple[str, int]]:
    """The GPU engine's scratch buffers in allocation order: (name, bytes). Mirrors carve_scratch."""
    R = max_rows
    d, hc, hd, nh = cfg.n_embd, cfg.hc_mult, cfg.head_dim, cfg.n_head
    ihd, inh, K, F = cfg.index_head_dim, cfg.index_n_heads, cfg.n_expert_used, cfg.expert_ffn
    csa = 4 in cfg.compress_ratios
    hca = 128 in cfg.compress_ratios
    cw = 2 * hd if csa else (hd if hca else 0)
    icw = 2 * ihd if csa else 0
    n_idx = max_ctx // 4 if csa else 0
    n_sel = min(cfg.index_topk, max_ctx // 4) if csa else 0
    shared = cfg.n_expert_shared == 1
    return [
        ("x_hc", 4 * R * hc * d),
        ("x_hc_next", 4 * R * hc * d),  # the one-launch mHC sites' post writes the streams apart
        ("hc_mix", 4 * R * (2 + hc) * hc),
        ("hc_post", 4 * R * hc),
        ("hc_comb", 4 * R * hc * hc),
        ("u", 4 * R * d),
        ("q_lat", 4 * R * cfg.q_lora_rank),
        ("q", 4 * R * nh * hd),
        ("kv", 4 * R * hd),
        ("kv16", 2 * R * hd),
        ("comp_kv", 4 * R * cw),
        ("comp_sc", 4 * R * cw),
        ("idx_q", 4 * R * inh * ihd if csa else 0),
        ("idx_w", 4 * R * inh if csa else 0),
        ("idx_kv", 4 * R * icw),
        ("idx_sc", 4 * R * icw),
        ("attn_out", 4 * R * nh * hd),
        ("o_low", 4 * R * cfg.o_groups * cfg.o_lora_rank),
        ("y", 4 * R * d),
        ("router", 4 * R * cfg.n_expert),
        ("sel_w", 4 * R * K),
        ("sel_id", 4 * R * K),
        ("pair_row", 4 * R * K),
        ("sorted_pairs", 4 * R * K),
        ("parts", 12 * R * K),
        ("n_parts", 4),
        ("route_done", 4),  # the fused router's block counter (ext/gpu/ds4_gpu.h router_route)
        ("ex_gate", 4 * R * K * F),
        ("ex_up", 4 * R * K * F),
        ("ex_down", 4 * R * K * d),
        ("sh_gate", 4 * R * F if shared else 0),
        ("sh_up", 4 * R * F if shared else 0),
        ("sh_down", 4 * R * d if shared else 0),
        ("comp_sel", 4 * R * n_sel),
        ("idx_scores", 4 * R * n_idx),
        ("head_in", 4 * R * d),
        ("logits", 4 * R * cfg.n_vocab),
        ("rope_inv_freq", 8 * cfg.n_layer * (cfg.rope_dim // 2)),
        # attention's split partials: R x n_head x 8 splits x (head_dim + 2) floats (paged_ops.cu)
        ("attn_part", 4 * R * nh * 8 * (hd + 2)),
        # the logit lanes' greedy tokens (step_argmax), then the argmax's work area: 64 splits a row
        # of (value, index) (ext/gpu/ds4_gpu.h argmax_work_bytes)
        ("argmax", 4 * R + 8 * 64 * R),
        # the integer Q8_0/Q4_K products' planes of X (ext/gpu/xplanes.cuh): 112 bytes per 32
        # elements of the widest X a product reads, max_rows columns (or the experts' down input, a
        # row per pair)
        ("x_planes", max(R * (max(nh * hd, hc * d, d, cfg.q_lora_rank, cfg.o_groups * cfg.o_lora_rank, F) // 32),
                         R * K * (F // 32)) * 112),
        # the planes producer kernels write beside their output: u's, then q_lat's, the shared
        # SwiGLU's or head_in's (GivenPlanes, ext/gpu/matvec_fused.h)
        ("planes_u", R * (d // 32) * 112),
        ("planes_b", R * (max(d, cfg.q_lora_rank, F) // 32) * 112),
        # the fused mHC sites' block sums (ext/gpu/step_ops.h hc_site): per row and block (256
        # elements of one of the 4 streams) a double and (2 + 4) 4 floats
        ("hc_site", R * 4 * -(-d // 256) * (8 + 4 * 24)),
    ]


def _padded(elems: int) -> int:
    return -(-elems * 4 // _ALIGN) * _ALIGN


def _scratch_buffers(cfg: DS4Config, max_rows: int, max_ctx: int) -> list[tuple[str, int]]:
    """The step arena's buffers in allocation order: (name, 4-byte elements). Mirrors Scratch."""
    R = max_rows
    d, hc, hd, nh = cfg.n_embd, cfg.hc_mult, cfg.head_dim, cfg.n_head
    ihd, inh, K = cfg.index_head_dim, cfg.index_n_heads, cfg.n_expert_used
    csa = 4 in cfg.compress_ratios
    hca = 128 in cfg.compress_ratios
    cw = 2 * hd if csa else (hd if hca else 0)  # compressor projection width
    icw = 2 * ihd if csa else 0
    n_idx = max_ctx // 4 if csa else 0  # indexer candidates of one query
    n_comp = max(min(cfg.index_topk, max_ctx // 4) if csa else 0, max_ctx // 128 if hca else 0)
    n_keys = RING_ROWS + n_comp
    pool_w = max(hd if (csa or hca) else 0, ihd if csa else 0)
    return [
        ("x_hc", R * hc * d),
        ("hc_mix", R * (2 + hc) * hc),
        ("hc_post", R * hc),
        ("hc_comb", R * hc * hc),
        ("u", R * d),
        ("q_lat", R * cfg.q_lora_rank),
        ("q", R * nh * hd),
        ("kv", R * hd),
        ("comp_kv", R * cw),
        ("comp_sc", R * cw),
        ("idx_q", R * inh * ihd if csa else 0),
        ("idx_w", R * inh if csa else 0),
        ("idx_kv", R * icw),
        ("idx_sc", R * icw),
        ("ape", R * max(cw, icw)),
        ("attn_out", R * nh * hd),
        ("o_low", R * cfg.o_groups * cfg.o_lora_rank),
        ("y", R * d),
        ("router", R * cfg.n_expert),
        ("sel_w", R * K),
        ("sel_id", R * K),
        ("ex_in", R * d),
        ("ex_gate", R * cfg.expert_ffn),
        ("ex_up", R * cfg.expert_ffn),
        ("ex_down", R * d),
        ("ex_out", R * K * d),
        ("att_logits", R * nh * n_keys),
        ("comp_sel", R * n_comp),
        ("idx_scores", R * n_idx),
        ("idx_order", R * n_idx),
        ("pooled", R * pool_w),
        ("head_in", R * d),
        ("rope", R * cfg.rope_dim),
    ]
