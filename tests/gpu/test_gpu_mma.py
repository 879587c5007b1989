"""The tensor-core matvec inside the GPU paths (pass 8; ext/gpu/MMA.md "Phase 2"), switch on.

Marked ``gpu`` (conftest skips them without a CUDA/HIP build and a device); in a build without the
tensor-core kernels (HIP) ``gpu_set_matvec_mma(True)`` returns False and they skip. Hooks
(``_testing``): ``gpu_set_matvec_mma(on) -> bool`` (process-wide, DS4_GPU_MMA=1) and the ordinary
ones of test_gpu_kernels.py / test_gpu_fused.py, which route through the tensor cores while it is on:

- routing: a Q8_0/Q4_K/F16/BF16 product with K % 256 == 0 changes its bits with the switch (so the
  tensor cores really ran), MXFP4, F32 and a Q8_0 K that is not a multiple of 256 do not;
- width exactness: every column of an N-column product (N 2..17, 64, 256) bit-identical to that
  column alone, at K-slices 16, 4 and 1 with ragged row counts, tall/staged asked or not;
- accuracy: within 1e-5 of sum |w x| of float64, activations spread over six decades;
- grouped: every (expert, lane) pair bit-identical to its expert's single-column product (parts of
  1 and 8, kernel widths 1-8, lanes routing twice to an expert); the fused gate/up pair declines;
- matvec_multi and matvec_batched: every product bit-identical to its own call;
- the engine (tiny model): logits within 2e-3 of the CPU engine's and the same greedy tokens over
  40 steps; batch invariance without tolerance (alone, beside 1-5 others, packed 4 and 16 rows a
  step, eager and under graphs); the switch captures new graphs and changes the logits, and changes
  nothing in a model with no product the tensor cores take; the scratch it allocates.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine import memory
from ds4_app.engine.memory import plan_device_memory, tensor_core_scratch_bytes
from ds4_app.engine.plan import StepPlan
from ds4_app.engine.presets import flash, tiny
from ds4_app.engine.synth import synthesize
from tests.engine_cases import PAGES_PER_SEQ, Seq, prompt, run
from tests.gpu.test_gpu_engine import REL_TOL, cpu_engine, gpu_engine, model, rel_err
from tests.gpu.test_gpu_kernels import GEOMETRY, NAMES, tame_raw

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing
pytestmark = pytest.mark.gpu

Q8_0, Q4_K, MXFP4, F16, BF16, F32 = 8, 12, 39, 1, 30, 0
MMA_TYPES = [Q8_0, Q4_K, F16, BF16]
MMA_IDS = [NAMES[t] for t in MMA_TYPES]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def switch_on() -> None:
    if not T.gpu_set_matvec_mma(True):
        T.gpu_set_matvec_mma(False)
        pytest.skip("this build has no tensor-core kernels (HIP)")


@pytest.fixture
def mma():
    """The tensor-core switch on for one test, off after it (its default)."""
    switch_on()
    yield
    T.gpu_set_matvec_mma(False)


def expert_slice(t: int, raw: np.ndarray, ne0: int, ne1: int, e: int) -> np.ndarray:
    n = ne0 // GEOMETRY[t][0] * GEOMETRY[t][1] * ne1
    return raw[e * n:(e + 1) * n]


# --- dense products ---------------------------------------------------------------------------------

def test_the_switch_routes_exactly_the_supported_products(mma) -> None:
    """With the switch on, the supported types' products are no longer the SIMT kernels' bits (both
    within float noise of each other); every other product keeps its bits."""
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 4128)).astype(np.float32)
    for t, ne0, routed in [(Q8_0, 4096, True), (Q4_K, 4096, True), (F16, 4096, True), (BF16, 4096, True),
                           (MXFP4, 4096, False), (F32, 4096, False), (Q8_0, 4128, False)]:
        raw = tame_raw(t, ne0 * 300, rng)
        on = T.gpu_matmul(t, raw, ne0, 300, x[:, :ne0])
        T.gpu_set_matvec_mma(False)
        off = T.gpu_matmul(t, raw, ne0, 300, x[:, :ne0])
        switch_on()
        assert np.array_equal(bits(on), bits(off)) != routed, (NAMES[t], ne0)
        assert np.allclose(on, off, rtol=1e-4, atol=1e-4 * np.abs(off).max())


# (ne0, ne1): K-slices 16 (5 row blocks), 4 (2 row blocks) and 1; no row count a multiple of 64.
SHAPES = [(4096, 300), (1024, 77), (256, 1000)]


@pytest.mark.parametrize("ne0, ne1", SHAPES, ids=["ks16", "ks4", "ks1"])
@pytest.mark.parametrize("t", MMA_TYPES, ids=MMA_IDS)
def test_every_column_has_its_single_column_bits(t: int, ne0: int, ne1: int, mma) -> None:
    """Widths 2..17 (narrow passes of 8 and 16), 64 and 256 (the wide path with the hook's
    scratch), from the first column and ending at the last: each column equals its own 1-column
    call; tall and staged (SIMT launch choices) change nothing."""
    rng = np.random.default_rng()
    raw = tame_raw(t, ne0 * ne1, rng)
    x = rng.standard_normal((256, ne0)).astype(np.float32)
    single = np.concatenate([T.gpu_matmul(t, raw, ne0, ne1, x[c:c + 1]) for c in range(256)])
    for width in [*range(2, 18), 64, 256]:
        for start in sorted({0, 256 - width}):
            y = T.gpu_matmul(t, raw, ne0, ne1, x[start:start + width])
            assert np.array_equal(bits(y), bits(single[start:start + width])), (NAMES[t], width, start)
    for width in (1, 5, 17):
        y = T.gpu_matmul(t, raw, ne0, ne1, x[:width], tall=True, staged=True)
        assert np.array_equal(bits(y), bits(single[:width])), (NAMES[t], width, "tall, staged")


@pytest.mark.parametrize("t", MMA_TYPES, ids=MMA_IDS)
def test_accuracy_against_float64(t: int, mma) -> None:
    """|y - y64| <= 1e-5 sum_k |w_k x_k| at 1, 16 (narrow) and 64 (wide) columns, the activations
    spread over 10^-3 .. 10^3 so the hi/lo split carries every one of their bits."""
    rng = np.random.default_rng()
    ne0, ne1 = 4096, 300
    raw = tame_raw(t, ne0 * ne1, rng)
    x = (rng.standard_normal((64, ne0)) * 10.0 ** rng.uniform(-3, 3, (64, ne0))).astype(np.float32)
    w = T.dequantize(t, raw, ne0 * ne1).reshape(ne1, ne0).astype(np.float64)
    x64 = x.astype(np.float64)
    ref, scale = x64 @ w.T, np.abs(x64) @ np.abs(w).T
    for width in (1, 16, 64):
        y = T.gpu_matmul(t, raw, ne0, ne1, x[:width]).astype(np.float64)
        ratio = np.abs(y - ref[:width]) / scale[:width]
        assert ratio.max() <= 1e-5, (NAMES[t], width, float(ratio.max()))


@pytest.mark.parametrize("t", [Q8_0, Q4_K, F16], ids=["Q8_0", "Q4_K", "F16"])
def test_batched_members_equal_their_own_products(t: int, mma) -> None:
    """matvec_batched (the grouped output projection) runs each member on the tensor cores with the
    bits of its own call: widths 1, 3, 16 and 17."""
    rng = np.random.default_rng()
    ne0, rows, n_batch = 1024, 512, 8
    raw = tame_raw(t, ne0 * rows * n_batch, rng)
    x = rng.standard_normal((17, n_batch * ne0)).astype(np.float32)
    for width in (1, 3, 16, 17):
        got = T.gpu_matmul_batched(t, raw, ne0, rows * n_batch, n_batch, x[:width])
        for i in range(n_batch):
            own = T.gpu_matmul(t, expert_slice(t, raw, ne0, rows, i), ne0, rows, x[:width, i * ne0:(i + 1) * ne0])
            assert np.array_equal(bits(got[:, i * rows:(i + 1) * rows]), bits(own)), (NAMES[t], width, i)


def test_multi_equals_each_product_alone(mma) -> None:
    """matvec_multi over five tensor-core products and two SIMT ones (F32, MXFP4): every output has
    its own call's bits at every width; at one column the launches are one per tensor-core product
    and one per SIMT type."""
    rng = np.random.default_rng()
    ne0 = 1024
    mix = [(Q8_0, 1024), (F32, 24), (Q8_0, 512), (F16, 1024), (MXFP4, 600), (BF16, 300), (Q4_K, 77)]
    products = [(t, tame_raw(t, ne0 * rows, rng), rows) for t, rows in mix]
    x = rng.standard_normal((40, ne0)).astype(np.float32)
    for width in (1, 2, 5, 8, 9, 16, 17, 40):
        want = [T.gpu_matmul(t, raw, ne0, rows, x[:width]) for t, raw, rows in products]
        got, launches = T.gpu_matmul_multi(products, ne0, x[:width])
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(bits(g), bits(w)), (width, NAMES[mix[i][0]], mix[i][1])
        if width == 1:
            assert launches == 5 + 2


# --- grouped products -------------------------------------------------------------------------------

@pytest.mark.parametrize("ne0, ne1", [(512, 96), (2048, 200)], ids=["ks2", "ks8"])
@pytest.mark.parametrize("t", MMA_TYPES, ids=MMA_IDS)
def test_grouped_pairs_equal_single_columns(t: int, ne0: int, ne1: int, mma) -> None:
    """Every pair of the expert-grouped product equals its expert's 1-column product: 1, 5 and 40
    lanes of 3 routes over 8 experts (repeats within a lane allowed), parts of 8 and of 1, every
    kernel width."""
    rng = np.random.default_rng()
    n_expert = 8
    raw = tame_raw(t, ne0 * ne1 * n_expert, rng)
    for n_lanes in (1, 5, 40):
        x = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
        pair_expert = rng.integers(0, n_expert, n_lanes * 3).astype(np.int32)
        x_row = np.repeat(np.arange(n_lanes, dtype=np.int32), 3)
        single = np.stack([T.gpu_matmul(t, expert_slice(t, raw, ne0, ne1, e), ne0, ne1, x[r:r + 1])[0]
                           for e, r in zip(pair_expert, x_row)])
        for max_part in (8, 1):
            for max_cols in (1, 2, 4, 8):
                y = T.gpu_matmul_grouped(t, raw, ne0, ne1, n_expert, x, pair_expert, x_row, max_part, max_cols)
                assert np.array_equal(bits(y), bits(single)), (NAMES[t], n_lanes, max_part, max_cols)


def test_grouped_pair_declines_tensor_core_stacks(mma) -> None:
    """The fused gate/up(/SwiGLU) launch does not take Q4_K stacks the tensor cores take: the
    separate grouped products (tensor cores) and the swiglu kernel give the outputs."""
    rng = np.random.default_rng()
    ne0, ne1, n_expert, n_lanes = 2048, 200, 4, 5
    raw_g, raw_u = tame_raw(Q4_K, ne0 * ne1 * n_expert, rng), tame_raw(Q4_K, ne0 * ne1 * n_expert, rng)
    x = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
    pe = np.concatenate([rng.choice(n_expert, 3, replace=False) for _ in range(n_lanes)]).astype(np.int32)
    xr = np.repeat(np.arange(n_lanes, dtype=np.int32), 3)
    gate = T.gpu_matmul_grouped(Q4_K, raw_g, ne0, ne1, n_expert, x, pe, xr, 8)
    up = T.gpu_matmul_grouped(Q4_K, raw_u, ne0, ne1, n_expert, x, pe, xr, 8)
    g, u, fused = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, 8, n_lanes)
    assert not fused
    assert np.array_equal(bits(g), bits(gate)) and np.array_equal(bits(u), bits(up))
    s, _, fused = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, 8, n_lanes, 10.0)
    assert not fused and np.array_equal(bits(s), bits(T.gpu_swiglu(gate, up, 10.0)))


# --- the engine ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu_mma")


def test_logits_and_greedy_tokens_match_the_cpu_engine(model_dir: Path, mma) -> None:
    """Three prompts (16 rows a step), then 40 greedy steps, both engines fed the CPU's tokens: every
    step's logits within 2e-3 relative of the CPU's and the same argmax."""
    mf = model(model_dir, "tiny", seed=13)
    cpu, gpu = cpu_engine(mf), gpu_engine(mf)
    for p in range(3):
        slot, pages = p, [4 * p + k for k in range(4)]
        seq = list(prompt(mf, 100 + p, 40 + 17 * p))
        want = run(cpu, [Seq(np.asarray(seq), slot=slot, pages=pages, rows=16)])[0]
        got = run(gpu, [Seq(np.asarray(seq), slot=slot, pages=pages, rows=16)])[0]
        assert np.isfinite(got).all() and rel_err(got, want).max() <= REL_TOL, f"prompt {p}"
        nxt = int(np.argmax(want[-1]))
        for step in range(40):
            assert int(np.argmax(got[-1])) == nxt, f"prompt {p}, step {step}"
            plan = StepPlan.build([(slot, nxt, len(seq), True)], {slot: pages}, PAGES_PER_SEQ)
            seq.append(nxt)
            want, got = cpu.step(plan), gpu.step(plan)
            assert rel_err(got, want)[0] <= REL_TOL, f"prompt {p}, step {step}: {rel_err(got, want)[0]:.2e}"
            nxt = int(np.argmax(want[0]))
        cpu.reset_slot(slot)
        gpu.reset_slot(slot)


@pytest.fixture(scope="module")
def mma_baseline(model_dir: Path):
    """The reference bits with the switch on: a 200-token prompt alone, one row a step, every kernel
    launched one by one (no graphs; SIMT products on the direct kernel)."""
    mf = model(model_dir, "tiny", seed=5)
    target = prompt(mf, 50, 200)
    switch_on()
    try:
        eng = gpu_engine(mf)
        eng.use_graphs = False
        eng.use_tall_matvec = False
        eng.use_staged_matvec = False
        baseline = run(eng, [Seq(target, slot=0, pages=[0, 1])])[0]
    finally:
        T.gpu_set_matvec_mma(False)
    return mf, target, baseline


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("case", range(6))
def test_batch_invariance(mma_baseline, case: int, graphs: bool, mma) -> None:
    """The target sequence beside 0-5 others (1 or 4 rows a step each; up to 36 columns a product,
    the tensor cores' wide path), itself packed 1, 4 or 16 rows a step, in random slots and pages:
    its logits have the baseline's bits."""
    mf, target, baseline = mma_baseline
    rng = np.random.default_rng(1000 + case)
    slots = rng.permutation(6)
    pages = rng.permutation(6 * PAGES_PER_SEQ)
    seqs = [Seq(target, slot=int(slots[0]), pages=[int(x) for x in pages[:2]], rows=[1, 4, 16][case % 3],
                start=int(rng.integers(0, 10)))]
    for i in range(1, case + 1):
        seqs.append(Seq(prompt(mf, 1000 + i, int(rng.integers(1, 160))), slot=int(slots[i]),
                        pages=[int(x) for x in pages[2 * i:2 * i + 2]], rows=int(rng.choice([1, 4])),
                        start=int(rng.integers(0, 20))))
    eng = gpu_engine(mf, max_rows=40)
    eng.use_graphs = graphs
    got = run(eng, seqs)[0]
    assert np.array_equal(bits(got), bits(baseline))


def test_every_packing_width_gives_the_same_bits(mma_baseline, mma) -> None:
    mf, target, baseline = mma_baseline
    eng = gpu_engine(mf, max_slots=1, max_rows=24)
    for rows in (2, 3, 4, 5, 8, 13, 16, 17, 24):
        eng.reset_slot(0)
        got = run(eng, [Seq(target, slot=0, pages=[1, 0], rows=rows)])[0]
        assert np.array_equal(bits(got), bits(baseline)), f"{rows} rows a step"


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_the_switch_changes_the_logits_and_captures_new_graphs(mma_baseline, graphs: bool) -> None:
    """One engine, the switch off, on, off: each setting gives its own eager bits (the tensor-core
    ones are the baseline, the others differ from it); under graphs the first change captures new
    graphs (a graph never replays under the other setting) and the change back replays the first
    setting's."""
    mf, target, baseline = mma_baseline
    seqs = [Seq(target, slot=0, pages=[0, 1], rows=1), Seq(prompt(mf, 56, 70), slot=3, pages=[4, 5], rows=4, start=2)]
    eng = gpu_engine(mf, max_rows=24)
    eng.use_graphs = graphs
    captured = eng.graphs_captured
    out = {}
    try:
        for i, on in enumerate((False, True, False)):
            if on:
                switch_on()
            else:
                T.gpu_set_matvec_mma(False)
            for s in (0, 3):
                eng.reset_slot(s)
            got = run(eng, seqs)
            if on in out:
                for a, b in zip(got, out[on]):
                    assert np.array_equal(bits(a), bits(b)), "the same setting twice"
            out[on] = got
            if graphs and i < 2:
                assert eng.graphs_captured > captured, "the tensor-core switch must capture new graphs"
            elif graphs:
                assert eng.graphs_captured == captured, "the switch-off graphs replay"
            captured = eng.graphs_captured
    finally:
        T.gpu_set_matvec_mma(False)
    assert np.array_equal(bits(out[True][0]), bits(baseline))
    assert not np.array_equal(bits(out[False][0]), bits(baseline))
    assert rel_err(out[True][0], out[False][0]).max() <= REL_TOL


# The tiny model with every matrix in a type the tensor cores do not take.
SIMT_ONLY_TYPES = {"embd": "F32", "output": "MXFP4", "attn": "MXFP4", "compressor": "F32", "compressor_ape": "F32",
                   "indexer": "F32", "hc_fn": "F32", "exps_gate_up": "MXFP4", "exps_down": "MXFP4",
                   "shexp": "MXFP4"}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_the_switch_changes_nothing_without_supported_products(model_dir: Path, graphs: bool) -> None:
    """A tiny model stored in F32 and MXFP4 only: the logits with the switch on are the switch-off
    bits, and no tensor-core scratch is allocated."""
    path = model_dir / "tiny-simt-only.gguf"
    if not path.exists():
        synthesize(tiny(), path, seed=5, types=SIMT_ONLY_TYPES)
    mf = ModelFile.open(path)
    seqs = [Seq(prompt(mf, 57, 60), slot=0, pages=[0, 1], rows=4),
            Seq(prompt(mf, 58, 40), slot=2, pages=[2], rows=1, start=1)]
    out = {}
    try:
        for on in (False, True):
            if on:
                switch_on()
            eng = gpu_engine(mf)
            eng.use_graphs = graphs
            out[on] = run(eng, seqs)
            assert eng.allocated_bytes()["scratch"] == plan_device_memory(
                mf.config, max_slots=6, max_ctx=eng.max_ctx, kv_pool_tokens=eng.n_pages * 128, max_rows=16,
                weights_bytes=mf.file_size).sections["scratch"]
    finally:
        T.gpu_set_matvec_mma(False)
    for a, b in zip(out[False], out[True]):
        assert np.array_equal(bits(a), bits(b))


# --- the scratch the engine allocates ---------------------------------------------------------------
#
# What plan_device_memory must add to "scratch" with the switch on: the largest of
#   dense:   mma_matvec_scratch_bytes(W, max_rows) over the step's products (attn_output_a per group
#            of o_lora_rank rows),
#   grouped: mma_grouped_scratch_bytes(W, min(max_rows * n_expert_used, 16)) over the expert stacks,
# over the weights the tensor cores take (Q8_0, Q4_K, F16, BF16 with K % 256 == 0), rounded up to
# 256 bytes: ds4_app.engine.memory.tensor_core_scratch_bytes (mma_matvec.cu's formulas restated),
# which the Runner's plan adds when DS4_GPU_MMA is set.

def expected_mma_scratch(mf, max_rows: int) -> int:
    return tensor_core_scratch_bytes(mf.config, [(t.name, t.ggml_type, tuple(t.ne)) for t in mf.tensors.values()],
                                     max_rows)


@pytest.mark.parametrize("max_rows", [7, 40])
def test_scratch_is_the_plan_plus_the_tensor_core_scratch(model_dir: Path, max_rows: int) -> None:
    """Built with the switch on, the engine's scratch section is the plan's plus the tensor-core
    scratch above (every other section as planned); built with it off, the plan's until a step runs
    with the switch on, which adds the same."""
    mf = model(model_dir, "tiny", seed=5)
    plan = plan_device_memory(mf.config, max_slots=3, max_ctx=1000, kv_pool_tokens=11 * 128, max_rows=max_rows,
                              weights_bytes=mf.file_size).sections
    extra = expected_mma_scratch(mf, max_rows)
    assert extra > 0  # the tiny hc_fn products (K 1024, 4 K-slices) want partials at any width

    def build():
        return native.GpuEngine(mf.config, str(mf.path), [(t.name, t.ggml_type, t.ne, t.offset)
                                                          for t in mf.tensors.values()],
                                max_slots=3, max_ctx=1000, n_pages=11, max_rows=max_rows)

    try:
        late = build()
        assert late.allocated_bytes() == plan
        switch_on()
        eng = build()
        got = eng.allocated_bytes()
        assert got["scratch"] == plan["scratch"] + extra
        assert {k: v for k, v in got.items() if k != "scratch"} == {k: v for k, v in plan.items() if k != "scratch"}
        run(late, [Seq(prompt(mf, 59, 3), slot=0, pages=[0])])
        assert late.allocated_bytes() == got
    finally:
        T.gpu_set_matvec_mma(False)


def test_flash_shapes_of_the_scratch_formula() -> None:
    """The K-slice counts MMA.md lists for flash-l4 (q_a 16, kv 16, q_b 1, shared gate/up 8, down 4,
    LM head 1, routed gate/up 8, down 4), so the formulas above describe the kernels' shapes."""
    c = flash(4)
    mma_kslices = memory._mma_kslices
    assert mma_kslices(c.n_embd, c.q_lora_rank) == 16
    assert mma_kslices(c.n_embd, c.head_dim) == 16
    assert mma_kslices(c.q_lora_rank, c.n_head * c.head_dim) == 1
    assert mma_kslices(c.n_embd, c.expert_ffn) == 8
    assert mma_kslices(c.expert_ffn, c.n_embd) == 4
    assert mma_kslices(c.n_embd, c.n_vocab) == 1
