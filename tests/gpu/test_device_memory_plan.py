"""The GPU engine's device memory plan by hand (needs no device; test_gpu_engine.py checks the plan
against what a GpuEngine allocates on one)."""

from __future__ import annotations

from dataclasses import replace

from ds4_app.engine.memory import DEVICE_SECTIONS, _device_scratch_buffers, plan_device_memory, plan_memory
from ds4_app.engine.presets import flash, tiny


def test_tiny_device_sections_by_hand() -> None:
    cfg = tiny()  # ratios (0, 4, 128, 4), head_dim 128, index_head_dim 64, top-k 8, vocab 1024
    plan = plan_device_memory(cfg, max_slots=2, max_ctx=512, max_rows=4, weights_bytes=1000)
    host = plan_memory(cfg, max_slots=2, max_ctx=512, max_rows=4)
    s = plan.sections
    assert list(s) == list(DEVICE_SECTIONS)
    for name in ("rings", "compressor_state", "pages"):  # the CPU layout, in device memory
        assert s[name] == host.sections[name]
    assert plan.n_pages == host.n_pages == 8
    assert s["step_inputs"] == (10 * 4 + 4 * 4) * 4  # ten arrays of 4 lanes, 4 table rows of 4 blocks
    assert s["weights_device"] == 1000
    bufs = dict(_device_scratch_buffers(cfg, 4, 512))
    assert bufs["kv16"] == 2 * 4 * 128
    assert bufs["logits"] == 4 * 4 * 1024
    assert bufs["idx_scores"] == 4 * 4 * (512 // 4)
    assert bufs["comp_sel"] == 4 * 4 * 8
    assert bufs["parts"] == 12 * 4 * 2  # one (expert, first, count) per (lane, selection) pair
    assert s["scratch"] == sum(-(-b // 256) * 256 for b in bufs.values())
    assert plan.total == sum(s.values())


def test_device_plan_scales_with_rows_and_context() -> None:
    cfg = flash(4)
    a = plan_device_memory(cfg, max_slots=8, max_ctx=4096, max_rows=16).sections
    b = plan_device_memory(cfg, max_slots=8, max_ctx=4096, max_rows=64).sections
    c = plan_device_memory(cfg, max_slots=8, max_ctx=8192, max_rows=16).sections
    assert b["scratch"] > 3.5 * a["scratch"]
    assert b["rings"] == a["rings"] and b["pages"] == a["pages"]
    assert c["step_inputs"] - a["step_inputs"] == 16 * 32 * 4  # 32 more blocks per table row
    assert c["pages"] == 2 * a["pages"]  # default pool: ceil(max_ctx / 128) pages per slot


def test_sliding_only_model_has_no_indexer_buffers() -> None:
    cfg = replace(tiny(), compress_ratios=(0, 0, 0, 0))
    bufs = dict(_device_scratch_buffers(cfg, 4, 256))
    assert bufs["idx_q"] == bufs["idx_scores"] == bufs["comp_sel"] == bufs["comp_kv"] == 0
