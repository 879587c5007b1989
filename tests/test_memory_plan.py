"""The memory plan: byte formulas by hand, and equality with what the native engine allocates."""

from __future__ import annotations

import math

import pytest

from ds4_app.engine.memory import SECTIONS, MemoryPlan, _scratch_buffers, plan_memory
from ds4_app.engine.presets import flash, tiny


def test_tiny_sections_by_hand() -> None:
    cfg = tiny()  # ratios (0, 4, 128, 4), head_dim 128, index_head_dim 64
    plan = plan_memory(cfg, max_slots=2, max_ctx=512)
    assert plan.n_pages == 4 * 2
    s = plan.sections
    assert list(s) == list(SECTIONS)
    assert s["rings"] == 4 * 2 * 128 * 128 * 2
    # two CSA layers: value+score [8, 256] and indexer value+score [8, 128]; one HCA [128, 128] pair
    per_slot_floats = 2 * (2 * 8 * 256 + 2 * 8 * 128) + 2 * 128 * 128
    assert s["compressor_state"] == 2 * per_slot_floats * 4
    # per page: each CSA layer 32 rows of 128 plus 32 indexer rows of 64; the HCA layer one row
    assert s["pages"] == 8 * (2 * 32 * (128 + 64) + 128) * 2
    assert s["block_tables"] == (2 * 4 + 8) * 4
    assert s["weights_mapped"] == 0
    assert plan.total == sum(s.values())


def test_flash_sections_by_hand() -> None:
    cfg = flash()
    plan = plan_memory(cfg, max_slots=6, max_ctx=4096, weights_bytes=123)
    assert plan.n_pages == 192  # upstream's example: (4096, 6 slots) gives 192 blocks
    s = plan.sections
    assert s["rings"] == 43 * 6 * 128 * 512 * 2
    per_slot_floats = 21 * (2 * 8 * 1024 + 2 * 8 * 256) + 20 * 2 * 128 * 512
    assert s["compressor_state"] == 6 * per_slot_floats * 4
    page_bytes = (21 * 32 * (512 + 128) + 20 * 512) * 2
    assert page_bytes == 6880 * 128  # spec §8: 3440 f16 elements of compressed history per token
    assert s["pages"] == 192 * page_bytes
    assert s["weights_mapped"] == 123


@pytest.mark.parametrize("max_ctx, slots, pool, pages", [
    (4096, 6, None, 192), (129, 6, None, 12), (131072, 6, None, 6144), (131072, 6, 24576, 192), (100, 1, 1, 1),
])
def test_page_count(max_ctx: int, slots: int, pool: int | None, pages: int) -> None:
    assert plan_memory(flash(4), max_slots=slots, max_ctx=max_ctx, kv_pool_tokens=pool).n_pages == pages


def test_doubling_slots_doubles_only_per_slot_sections() -> None:
    for cfg in (tiny(), flash(4)):
        one = plan_memory(cfg, max_slots=3, max_ctx=2048, kv_pool_tokens=8192).sections
        two = plan_memory(cfg, max_slots=6, max_ctx=2048, kv_pool_tokens=8192).sections
        assert two["rings"] == 2 * one["rings"]
        assert two["compressor_state"] == 2 * one["compressor_state"]
        assert two["pages"] == one["pages"]  # the pool is shared
        assert two["scratch"] == one["scratch"]  # scratch scales with rows, not slots
        pages = 8192 // 128
        assert two["block_tables"] - pages * 4 == 2 * (one["block_tables"] - pages * 4)


def test_scratch_scales_with_rows_and_is_cache_line_padded() -> None:
    cfg = tiny()
    small = plan_memory(cfg, max_slots=1, max_ctx=1024, max_rows=1).sections["scratch"]
    big = plan_memory(cfg, max_slots=1, max_ctx=1024, max_rows=16).sections["scratch"]
    assert small % 64 == 0 and big % 64 == 0
    assert 15 * small < big <= 16 * small
    elems = dict(_scratch_buffers(cfg, 16, 1024))
    assert elems["att_logits"] == 16 * cfg.n_head * (128 + max(min(cfg.index_topk, 1024 // 4), 1024 // 128))
    assert elems["idx_scores"] == 16 * (1024 // 4)


def test_sliding_only_model_has_no_compressed_state() -> None:
    from dataclasses import replace

    cfg = replace(tiny(), compress_ratios=(0, 0, 0, 0))
    s = plan_memory(cfg, max_slots=2, max_ctx=256).sections
    assert s["compressor_state"] == 0 and s["pages"] == 0
    assert dict(_scratch_buffers(cfg, 4, 256))["idx_q"] == 0


def test_format_lists_every_section() -> None:
    plan = plan_memory(tiny(), max_slots=2, max_ctx=512, weights_bytes=3 << 20)
    text = plan.format()
    for name in SECTIONS:
        assert name in text
    assert "total" in text and "8 pages" in text
    assert f"{plan.total / 2**20:.3f}" in text


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        plan_memory(tiny(), max_slots=0, max_ctx=10)
    with pytest.raises(ValueError):
        plan_memory(tiny(), max_slots=1, max_ctx=10, kv_pool_tokens=0)


def test_plan_is_frozen() -> None:
    plan = plan_memory(tiny(), max_slots=1, max_ctx=128)
    assert isinstance(plan, MemoryPlan)
    with pytest.raises(AttributeError):
        plan.total = 0  # type: ignore[misc]


# --- against the native engine ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    native = pytest.importorskip("ds4_app.engine._native")
    from ds4_app.engine.gguf_file import ModelFile
    from ds4_app.engine.synth import synthesize

    path = tmp_path_factory.mktemp("plan") / "tiny.gguf"
    synthesize("tiny", path, seed=3)
    mf = ModelFile.open(path)
    tensors = [(t.name, t.ggml_type, t.ne, t.offset) for t in mf.tensors.values()]
    try:
        native.Engine(mf.config, str(path), tensors, max_slots=1, max_ctx=128, n_pages=1, max_rows=1, n_threads=1)
    except RuntimeError as e:
        if "no engine" in str(e):
            pytest.skip("this _native build has no engine")
        raise
    return native, mf, tensors


@pytest.mark.parametrize("slots, ctx, pool, rows", [(1, 128, None, 1), (2, 600, None, 16), (3, 1000, 5000, 4)])
def test_engine_allocates_the_plan(tiny_model, slots: int, ctx: int, pool: int | None, rows: int) -> None:
    native, mf, tensors = tiny_model
    plan = plan_memory(mf.config, max_slots=slots, max_ctx=ctx, kv_pool_tokens=pool, max_rows=rows,
                       weights_bytes=mf.file_size)
    eng = native.Engine(mf.config, str(mf.path), tensors, max_slots=slots, max_ctx=ctx, n_pages=plan.n_pages,
                        max_rows=rows, n_threads=1)
    assert eng.allocated_bytes() == plan.sections
    assert math.isclose(sum(eng.allocated_bytes().values()), plan.total)
