"""The GPU step executor (ext/gpu/engine_gpu.cu) against the native CPU engine, and its exactness.

Marked ``gpu`` (conftest skips them without a CUDA/HIP build and a device). On tiny models:

- every step started from the CPU engine's state (``gpu_sync_slot`` copies the CPU slot's rings,
  compressed rows and compressor states into the GPU slot before each step): logits within 2e-3
  relative of the CPU's, on the full tiny preset and on one-kind-of-layer variants (sliding
  window only, CSA only, HCA only), QAT off and on. With QAT on, an indexer query value within
  float noise of an FP4 rounding midpoint may round the other way and change the top-k (the
  parity suite meets this about once in 24 sequences of 600 steps, CPU against the reference):
  at most 2 of 300 steps may exceed the tolerance there, and the median step must stay near
  float noise;
- free running (each engine on its own state), QAT off: the same 2e-3 at every step, and the
  slot state close to the CPU's. With QAT on, free runs of two correct implementations part
  after the first rounding flip (the CPU's own scalar and AVX2 paths do), so they are not compared;
- the FP8, FP4, Hadamard and f16 round trips of the step kernels bit for bit against the reference;
- the same greedy tokens as the CPU engine for 5 prompts;
- batch invariance without tolerance: a sequence's logits bit-identical alone, beside 1-5 others,
  with its prompt packed 1, 4 or 16 rows a step, in any slot and on any pages, and in a reused slot;
- the compressors' parallel prompt path (``use_parallel_compressor``) gives the serial kernel's
  logits and slot states bit for bit;
- width exactness: every packing width 1..16 gives the same bits; CUDA graph replay gives the
  bits of launching each kernel; so do matvec's tall variant and its staged kernel (an LM head of
  16448 rows; the staged kernel also takes q_b and the tiny LM head from 2 rows a step); all three
  are on by default (graphs up to max_ctx 4096), the baseline of these tests is eager, tall and
  staged off;
- the device memory plan equals what the engine allocates; bad plans are refused as on the CPU.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine.memory import plan_device_memory, plan_memory
from ds4_app.engine.plan import StepPlan
from ds4_app.engine.presets import tiny
from ds4_app.engine.synth import synthesize
from tests.engine_cases import MAX_CTX, PAGES_PER_SEQ, Seq, prompt, round_trip_samples, run, tensor_entries

native = pytest.importorskip("ds4_app.engine._native")
pytestmark = pytest.mark.gpu

REL_TOL = 2e-3

VARIANTS = {
    "tiny": tiny(),
    "swa": dataclasses.replace(tiny(), n_layer=2, compress_ratios=(0, 0), swiglu_clamp_exp=(10.0,) * 2,
                               swiglu_clamp_shexp=(10.0,) * 2),
    "csa": dataclasses.replace(tiny(), n_layer=2, compress_ratios=(4, 4), swiglu_clamp_exp=(10.0,) * 2,
                               swiglu_clamp_shexp=(10.0,) * 2),
    "hca": dataclasses.replace(tiny(), n_layer=2, compress_ratios=(128, 128), swiglu_clamp_exp=(10.0,) * 2,
                               swiglu_clamp_shexp=(10.0,) * 2),
    # An LM head of 16448 rows: tall enough for matvec's tall variant (16384 rows and up).
    "tallvocab": dataclasses.replace(tiny(), n_vocab=16384 + 64),
}

_models: dict[tuple[str, int, bool], ModelFile] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu_engine")


def model(model_dir: Path, variant: str = "tiny", seed: int = 5, qat: bool = False) -> ModelFile:
    key = (variant, seed, qat)
    if key not in _models:
        path = model_dir / f"{variant}-{seed}-{int(qat)}.gguf"
        synthesize(VARIANTS[variant], path, seed=seed, qat_numerics=qat)
        _models[key] = ModelFile.open(path)
    return _models[key]


def gpu_engine(mf: ModelFile, *, max_slots: int = 6, max_rows: int = 16):
    n_pages = plan_memory(mf.config, max_slots=max_slots, max_ctx=MAX_CTX).n_pages
    return native.GpuEngine(mf.config, str(mf.path), tensor_entries(mf), max_slots=max_slots, max_ctx=MAX_CTX,
                            n_pages=n_pages, max_rows=max_rows)


def synth_tiny_gpu(tmp_path_factory, seed: int, *, max_slots: int, max_rows: int):
    """(ModelFile, GpuEngine) on a tiny model synthesized with seed: the module fixture of the tests
    that switch one GPU launch setting against another."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    synthesize(tiny(), path, seed=seed)
    mf = ModelFile.open(path)
    return mf, gpu_engine(mf, max_slots=max_slots, max_rows=max_rows)


def cpu_engine(mf: ModelFile, *, max_slots: int = 6, max_rows: int = 16):
    n_pages = plan_memory(mf.config, max_slots=max_slots, max_ctx=MAX_CTX).n_pages
    return native.Engine(mf.config, str(mf.path), tensor_entries(mf), max_slots=max_slots, max_ctx=MAX_CTX,
                         n_pages=n_pages, max_rows=max_rows, n_threads=2)


def rel_err(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per row: ||got - want|| / ||want||."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    return np.linalg.norm(g - w, axis=-1) / np.maximum(np.linalg.norm(w, axis=-1), 1e-30)


# --- against the CPU engine -----------------------------------------------------------------------

@pytest.mark.parametrize("variant, qat", [("tiny", False), ("tiny", True), ("swa", False), ("csa", False),
                                          ("csa", True), ("hca", False)])
def test_every_step_from_the_cpu_state_matches(model_dir: Path, variant: str, qat: bool) -> None:
    mf = model(model_dir, variant, seed=11, qat=qat)
    cpu, gpu = cpu_engine(mf, max_slots=2), gpu_engine(mf, max_slots=2)
    tokens = prompt(mf, 3, 300)  # ring wrap, page boundaries, top-8 of up to 75 entries, HCA rows
    table = [5, 0, 7, 2]
    err = np.empty(len(tokens))
    for t, tok in enumerate(tokens):
        native._testing.gpu_sync_slot(cpu, gpu, 1, np.asarray(table, np.int32), t)
        plan = StepPlan.build([(1, int(tok), t, True)], {1: table}, PAGES_PER_SEQ)
        want, got = cpu.step(plan), gpu.step(plan)
        assert np.isfinite(got).all()
        err[t] = rel_err(got, want)[0]
    over = np.nonzero(err > REL_TOL)[0]
    assert len(over) <= (2 if qat else 0), f"steps {over.tolist()} exceed {REL_TOL}: {err[over]}"
    assert np.median(err) <= 2e-5, f"median step error {np.median(err):.2e}"


@pytest.mark.parametrize("variant", ["tiny", "swa", "csa", "hca"])
def test_free_running_logits_match_the_cpu_engine(model_dir: Path, variant: str) -> None:
    mf = model(model_dir, variant, seed=11)
    seqs = [Seq(prompt(mf, 3, 300), slot=1, pages=[4, 0, 7], rows=4),
            Seq(prompt(mf, 4, 170), slot=3, pages=[2, 9], rows=1, start=5)]
    want = run(cpu_engine(mf), seqs)
    got = run(gpu_engine(mf), seqs)
    for g, w in zip(got, want):
        assert np.isfinite(g).all()
        err = rel_err(g, w)
        assert err.max() <= REL_TOL, f"worst step {int(err.argmax())}: {err.max():.2e}"


def test_round_trips_are_the_references_bit_for_bit() -> None:
    from ds4_app.engine.reference import numerics as N

    for x in round_trip_samples(64, None):
        rows = x.reshape(-1, 64)
        assert np.array_equal(native._testing.gpu_qat("fp8", rows), N.fp8_e4m3_roundtrip(rows, 64))
        assert np.array_equal(native._testing.gpu_qat("f16", rows), N.round_f16(rows))
    for x in round_trip_samples(32, None):
        rows = x.reshape(-1, 32)
        assert np.array_equal(native._testing.gpu_qat("fp4", rows), N.fp4_roundtrip(rows, 32))
    for x in round_trip_samples(128, None):
        rows = x.reshape(-1, 128)
        assert np.array_equal(native._testing.gpu_qat("hadamard", rows), N.hadamard(rows))


def test_slot_state_matches_the_cpu_engine(model_dir: Path) -> None:
    mf = model(model_dir, "tiny", seed=12)
    tokens = prompt(mf, 5, 261)
    seq = [Seq(tokens, slot=2, pages=[3, 1, 5], rows=16)]
    cpu, gpu = cpu_engine(mf), gpu_engine(mf)
    run(cpu, seq)
    run(gpu, seq)
    table = np.asarray([3, 1, 5, -1], np.int32)
    want = native._testing.export_slot_state(cpu, 2, table, len(tokens))
    got = native._testing.gpu_export_slot_state(gpu, 2, table, len(tokens))
    for key in want:
        for layer, (g, w) in enumerate(zip(got[key], want[key])):
            if w is None:
                assert g is None
                continue
            assert g.shape == w.shape, (key, layer)
            finite = np.isfinite(w)  # compressor scores hold -inf where a block is absent
            assert np.array_equal(np.isfinite(g), finite), (key, layer)
            assert np.array_equal(g[~finite], w[~finite]), (key, layer)
            scale = max(float(np.abs(w[finite]).max(initial=0.0)), 1e-6)
            assert np.abs(g[finite] - w[finite]).max(initial=0.0) <= 4e-3 * scale, (key, layer)


def test_greedy_tokens_equal_the_cpu_engine(model_dir: Path) -> None:
    mf = model(model_dir, "tiny", seed=13)
    cpu, gpu = cpu_engine(mf), gpu_engine(mf)
    for p in range(5):
        slot, pages = p % 6, [p * 4 + k for k in range(4)]
        tokens = {}
        for name, eng in (("cpu", cpu), ("gpu", gpu)):
            seq = list(prompt(mf, 100 + p, 40 + 17 * p))
            logits = run(eng, [Seq(np.asarray(seq), slot=slot, pages=pages, rows=16)])[0]
            nxt = int(np.argmax(logits[-1]))
            out = []
            for _ in range(48):
                out.append(nxt)
                pos = len(seq)
                seq.append(nxt)
                lg = eng.step(StepPlan.build([(slot, nxt, pos, True)], {slot: pages}, PAGES_PER_SEQ))
                nxt = int(np.argmax(lg[0]))
            tokens[name] = out
            eng.reset_slot(slot)
        assert tokens["gpu"] == tokens["cpu"], f"prompt {p}"


# --- exactness without tolerance ------------------------------------------------------------------

@pytest.fixture(scope="module")
def invariance_case(model_dir: Path):
    mf = model(model_dir, "tiny", seed=5)
    target = prompt(mf, 50, 200)
    eager = gpu_engine(mf)  # the reference bits: every kernel launched one by one, the direct matvec
    eager.use_graphs = False
    eager.use_tall_matvec = False
    eager.use_staged_matvec = False
    baseline = run(eager, [Seq(target, slot=0, pages=[0, 1])])[0]
    return mf, target, baseline


@pytest.mark.parametrize("case", range(6))
def test_batch_invariance(invariance_case, case: int) -> None:
    mf, target, baseline = invariance_case
    rng = np.random.default_rng(1000 + case)
    n_other = case  # 0..5 neighbours
    slots = rng.permutation(6)
    pages = rng.permutation(6 * PAGES_PER_SEQ)
    seqs = [Seq(target, slot=int(slots[0]), pages=[int(x) for x in pages[:2]], rows=[1, 4, 16][case % 3],
                start=int(rng.integers(0, 10)))]
    for i in range(1, n_other + 1):
        seqs.append(Seq(prompt(mf, 1000 + i, int(rng.integers(1, 160))), slot=int(slots[i]),
                        pages=[int(x) for x in pages[2 * i:2 * i + 2]], rows=int(rng.choice([1, 4])),
                        start=int(rng.integers(0, 20))))
    got = run(gpu_engine(mf, max_rows=40), seqs)[0]
    assert np.array_equal(got, baseline)


def test_every_packing_width_gives_the_same_bits(invariance_case) -> None:
    mf, target, baseline = invariance_case
    eng = gpu_engine(mf, max_slots=1)
    for rows in (2, 3, 5, 8, 13, 16):
        eng.reset_slot(0)
        got = run(eng, [Seq(target, slot=0, pages=[1, 0], rows=rows)])[0]
        assert np.array_equal(got, baseline), f"{rows} rows a step"


def test_slot_reuse_matches_a_fresh_engine(invariance_case) -> None:
    mf, target, baseline = invariance_case
    eng = gpu_engine(mf, max_slots=2)
    run(eng, [Seq(prompt(mf, 7, 170), slot=0, pages=[0, 1]), Seq(prompt(mf, 8, 60), slot=1, pages=[2])])
    eng.reset_slot(0)
    got = run(eng, [Seq(target, slot=0, pages=[1, 2], rows=4)])[0]
    assert np.array_equal(got, baseline)


def test_parallel_compressor_gives_the_serial_bits(model_dir: Path) -> None:
    """The compressors of prompt steps a block per finished compressed block, then the state in a
    second launch (use_parallel_compressor, the default), against one block a slot running its lanes
    in order: every lane's logits and every slot's state (rings, compressed rows, the CSA, HCA and
    indexer compressor states) bit for bit, eager and under graphs. Prompts packed 40, 16 and 5 rows
    a step start at every residue of 4 and cross HCA's blocks of 128 (a 300-token prompt finishes two
    inside 40-row steps), beside a sequence fed a row a step (its lone steps take the serial kernel)."""
    mf = model(model_dir, "tiny", seed=14)
    seqs = [Seq(prompt(mf, 60, 300), slot=0, pages=[0, 1, 2], rows=40),
            Seq(prompt(mf, 61, 150), slot=1, pages=[3, 4], rows=16, start=3),
            Seq(prompt(mf, 62, 37), slot=2, pages=[5], rows=5, start=1),
            Seq(prompt(mf, 63, 21), slot=3, pages=[6], rows=1, start=2)]
    gpu = gpu_engine(mf, max_slots=4, max_rows=64)
    assert gpu.use_parallel_compressor  # the default

    def under(parallel: bool, graphs: bool):
        gpu.use_parallel_compressor = parallel
        gpu.use_graphs = graphs
        for s in range(4):
            gpu.reset_slot(s)
        logits = run(gpu, seqs)
        states = []
        for s in seqs:
            table = np.asarray(s.pages + [-1] * (PAGES_PER_SEQ - len(s.pages)), np.int32)
            states.append(native._testing.gpu_export_slot_state(gpu, s.slot, table, len(s.tokens)))
        return logits, states

    serial = under(False, False)
    for graphs in (False, True):
        logits, states = under(True, graphs)
        for got, want in zip(logits, serial[0]):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), graphs
        for got, want in zip(states, serial[1]):
            assert got.keys() == want.keys()
            for key in want:
                for layer, (g, w) in enumerate(zip(got[key], want[key])):
                    assert (g is None) == (w is None), (key, layer)
                    if w is not None:
                        assert np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8)), (
                            key, layer, graphs)


def test_graph_replay_gives_the_same_bits(invariance_case) -> None:
    mf, target, baseline = invariance_case
    eng = gpu_engine(mf, max_rows=24)
    eng.use_graphs = True
    assert eng.use_graphs
    got = run(eng, [Seq(target, slot=0, pages=[0, 1])])[0]  # one bucket, replayed 199 times
    assert np.array_equal(got, baseline)
    eng.reset_slot(0)
    seqs = [Seq(target, slot=2, pages=[5, 3], rows=4), Seq(prompt(mf, 9, 90), slot=4, pages=[7], rows=16, start=3),
            Seq(prompt(mf, 10, 40), slot=1, pages=[11], rows=1, start=1)]
    got = run(eng, seqs)[0]
    assert np.array_equal(got, baseline)
    assert 2 <= eng.graphs_captured < 60


@pytest.mark.parametrize("graphs", [False, True])
def test_grouped_expert_kernels_give_the_same_bits(invariance_case, graphs: bool) -> None:
    """The grouped kernel variants for Q4_K experts (0 pass 5, 1 the own body, 2 its one-fma
    decode), each with and without chunked loads, against the baseline bits; under graphs a changed
    setting captures new graphs (a graph keeps the kernels it captured)."""
    mf, target, baseline = invariance_case
    seqs = [Seq(target, slot=0, pages=[0, 1], rows=1), Seq(prompt(mf, 56, 70), slot=3, pages=[4, 5], rows=4, start=2)]
    eng = gpu_engine(mf, max_rows=24)
    eng.use_graphs = graphs
    captured = 0
    try:
        for variant in (0, 1, 2):
            for chunked in (False, True):
                native._testing.gpu_set_matvec_grouped(variant)
                native._testing.gpu_set_matvec_chunked(chunked)
                for s in (0, 3):
                    eng.reset_slot(s)
                got = run(eng, seqs)[0]
                assert np.array_equal(got, baseline), f"variant {variant}, chunked {chunked}"
                if graphs:
                    assert eng.graphs_captured > captured, "a changed matvec setting must capture new graphs"
                    captured = eng.graphs_captured
    finally:  # the defaults
        native._testing.gpu_set_matvec_grouped(1)
        native._testing.gpu_set_matvec_chunked(True)


@pytest.mark.parametrize("switch", ["use_tall_matvec", "use_staged_matvec"])
def test_matvec_variants_give_the_same_bits(model_dir: Path, switch: str) -> None:
    """matvec's tall variant (the 16448-row LM head) and its staged kernel (products of 2+
    columns: q_b and the LM head) against the direct kernel, eager and under graphs, with rows of
    1, 4 and 2 lanes a step."""
    mf = model(model_dir, "tallvocab", seed=5)
    seqs = [Seq(prompt(mf, 53, 120), slot=0, pages=[0, 1], rows=1),
            Seq(prompt(mf, 54, 70), slot=2, pages=[4, 5], rows=4, start=2),
            Seq(prompt(mf, 55, 40), slot=5, pages=[8], rows=2, start=1)]
    eng = gpu_engine(mf, max_rows=24)
    eng.use_graphs = False
    setattr(eng, switch, False)
    want = run(eng, seqs)
    for graphs in (False, True):
        eng.use_graphs = graphs
        setattr(eng, switch, True)
        assert getattr(eng, switch)
        for s in (0, 2, 5):
            eng.reset_slot(s)
        got = run(eng, seqs)
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), f"{switch}, graphs={graphs}"


def test_staged_least_columns_give_the_same_bits(model_dir: Path) -> None:
    """The staged kernel from 2 columns (the default), from 3 and from 5 (narrower products on the direct
    kernel): the same bits, eager and under graphs, where a changed least width captures new graphs."""
    mf = model(model_dir, "tallvocab", seed=5)
    seqs = [Seq(prompt(mf, 56, 60), slot=0, pages=[0], rows=2),
            Seq(prompt(mf, 57, 70), slot=2, pages=[4], rows=4, start=1),
            Seq(prompt(mf, 58, 40), slot=5, pages=[8], rows=1, start=2)]
    eng = gpu_engine(mf, max_rows=24)
    assert eng.staged_min_cols == 2
    eng.use_graphs = False
    want = run(eng, seqs)
    for graphs in (False, True):
        eng.use_graphs = graphs
        for cols in (3, 5):
            captured = eng.graphs_captured
            eng.staged_min_cols = cols
            assert eng.staged_min_cols == cols
            for s in (0, 2, 5):
                eng.reset_slot(s)
            got = run(eng, seqs)
            for g, w in zip(got, want):
                assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), f"least {cols}, graphs={graphs}"
            if graphs:
                assert eng.graphs_captured > captured
    with pytest.raises(ValueError, match="at least 2 columns"):
        eng.staged_min_cols = 1


@pytest.mark.parametrize("graphs", [False, True])
def test_device_argmax_equals_the_logits_argmax(model_dir: Path, graphs: bool) -> None:
    """step_argmax (the greedy token of each logit lane, taken on the device) against numpy's
    argmax of step's logits, two engines fed the same plans: prompt rows with and without logits,
    several slots, a step with no logit lane."""
    mf = model(model_dir, "tiny", seed=5)
    engines = [gpu_engine(mf), gpu_engine(mf)]
    for eng in engines:
        eng.use_graphs = graphs
    rng = np.random.default_rng(3)
    tables = {0: [0, 1], 2: [4, 5], 3: [7]}
    pos = {0: 0, 2: 0, 3: 0}
    for step in range(40):
        lanes = []
        for slot in (0, 2, 3):
            rows = 4 if step < 3 and slot != 3 else 1
            for _ in range(rows):
                lanes.append((slot, int(rng.integers(0, mf.config.n_vocab)), pos[slot], step % 7 != 1 or slot == 0))
                pos[slot] += 1
        if step == 5:
            lanes = [(s, t, p, False) for s, t, p, _ in lanes]
        plan = StepPlan.build(lanes, tables, PAGES_PER_SEQ)
        want = engines[0].step(plan).argmax(axis=1)
        got = engines[1].step_argmax(plan)
        assert got.dtype == np.int32 and got.shape == (plan.n_logits,)
        assert np.array_equal(got, want), f"step {step}"


def test_defaults_and_their_environment_switches(model_dir: Path, monkeypatch) -> None:
    mf = model(model_dir, "tiny", seed=5)
    monkeypatch.delenv("DS4_GPU_GRAPHS", raising=False)
    monkeypatch.delenv("DS4_GPU_MV_TALL", raising=False)
    monkeypatch.delenv("DS4_GPU_MV_STAGED", raising=False)
    eng = gpu_engine(mf, max_slots=1)
    assert eng.use_graphs and eng.use_tall_matvec  # checked bit for bit and faster on an H200
    assert eng.use_staged_matvec
    n_pages = plan_memory(mf.config, max_slots=1, max_ctx=8192).n_pages
    big = native.GpuEngine(mf.config, str(mf.path), tensor_entries(mf), max_slots=1, max_ctx=8192, n_pages=n_pages)
    assert not big.use_graphs and big.use_tall_matvec  # graphs only up to the max_ctx measured
    monkeypatch.setenv("DS4_GPU_GRAPHS", "0")
    monkeypatch.setenv("DS4_GPU_MV_TALL", "0")
    monkeypatch.setenv("DS4_GPU_MV_STAGED", "0")
    eng = gpu_engine(mf, max_slots=1)
    assert not eng.use_graphs and not eng.use_tall_matvec and not eng.use_staged_matvec
    monkeypatch.setenv("DS4_GPU_GRAPHS", "1")
    big = native.GpuEngine(mf.config, str(mf.path), tensor_entries(mf), max_slots=1, max_ctx=8192, n_pages=n_pages)
    assert big.use_graphs


# --- plan checks and memory -------------------------------------------------------------------

def test_bad_plans_are_refused_as_on_the_cpu(invariance_case) -> None:
    mf, target, baseline = invariance_case
    eng = gpu_engine(mf, max_slots=2)
    first = run(eng, [Seq(target[:131], slot=0, pages=[0, 1], rows=16)])[0]
    bad = StepPlan.build([(0, int(target[131]), 131, True)], {0: [0]}, PAGES_PER_SEQ)
    with pytest.raises(ValueError, match="unassigned"):
        eng.step(bad)
    shared = StepPlan.build([(0, int(target[131]), 131, True), (1, 5, 0, True)], {0: [0, 1], 1: [1]}, PAGES_PER_SEQ)
    with pytest.raises(ValueError, match="twice"):
        eng.step(shared)
    tail = [eng.step(StepPlan.build([(0, int(target[k]), k, True)], {0: [0, 1]}, PAGES_PER_SEQ))[0]
            for k in range(131, len(target))]
    assert np.array_equal(np.concatenate([first, np.stack(tail)]), baseline)


def test_allocations_equal_the_device_memory_plan(model_dir: Path) -> None:
    for variant in ("tiny", "swa"):
        mf = model(model_dir, variant, seed=5)
        eng = native.GpuEngine(mf.config, str(mf.path), tensor_entries(mf), max_slots=3, max_ctx=1000, n_pages=11,
                               max_rows=7)
        plan = plan_device_memory(mf.config, max_slots=3, max_ctx=1000, kv_pool_tokens=11 * 128, max_rows=7,
                                  weights_bytes=mf.file_size)
        assert eng.allocated_bytes() == plan.sections


def test_runner_builds_the_gpu_backend(model_dir: Path) -> None:
    from ds4_app.engine.runner import Runner

    mf = model(model_dir, "tiny", seed=5)
    backend = native.gpu_backend()
    runner = Runner(mf, backend=backend, max_slots=2, max_ctx=MAX_CTX)
    assert runner.device.startswith(backend)
    assert runner.allocated_bytes() == runner.memory_plan.sections
    logits = runner.step(StepPlan.build([(0, 3, 0, True), (1, 4, 0, False)], {0: [0], 1: [4]}, PAGES_PER_SEQ))
    assert logits.shape == (1, mf.config.n_vocab) and np.isfinite(logits).all()
