"""Runner and the native Engine binding on the tiny preset.

Options and limits, the memory plan against what the engine allocated, step-plan validation
(one-line ValueErrors before any C++ runs), the reference backend's plan semantics, and
the exactness a runner must keep: a sequence's logits do not depend on what shares its step.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from ds4_app.engine.plan import StepLimits, StepPlan

native = pytest.importorskip("ds4_app.engine._native")
from ds4_app.engine.runner import (BACKENDS, BackendUnavailable, Runner, default_limits,  # noqa: E402
                                   default_max_rows)


@pytest.fixture(scope="module")
def cpu(tiny_model):
    return Runner(tiny_model, max_slots=3, max_ctx=512, n_threads=2)


@pytest.fixture(scope="module")
def prompt(tiny_model):
    rng = np.random.default_rng(11)
    return [int(t) for t in rng.integers(0, tiny_model.config.n_vocab, 24)]


def tables(slots, n_blocks=4):
    """Distinct physical pages per slot (slot s owns pages s*n_blocks ..)."""
    return {s: list(range(s * n_blocks, (s + 1) * n_blocks)) for s in slots}


def plan_of(lanes, slots=None):
    slots = sorted({s for s, *_ in lanes}) if slots is None else slots
    return StepPlan.build(lanes, tables(slots), 4)


def run_alone(runner, slot, tokens):
    """Feed tokens one lane per step from position 0; logits of every position."""
    runner.reset_slot(slot)
    return np.stack([runner.step(plan_of([(slot, t, p, True)]))[0] for p, t in enumerate(tokens)])


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# --- options ---------------------------------------------------------------------------------


def test_unknown_backend_names_the_choices(tiny_model):
    with pytest.raises(ValueError, match="cpu, reference, cuda, hip"):
        Runner(tiny_model, backend="tpu")


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_gpu_backend_missing_from_the_build_is_a_clear_error(tiny_model, backend):
    if native.gpu_backend() == backend:
        pytest.skip(f"this build has {backend}")
    with pytest.raises(BackendUnavailable, match=f"DS4_GPU={backend}"):
        Runner(tiny_model, backend=backend)


def test_limits_default_to_upstream_policy_fitted_to_max_rows(tiny_model):
    assert Runner(tiny_model, max_slots=1, max_ctx=256).limits == StepLimits()
    r = Runner(tiny_model, max_slots=1, max_ctx=256, max_rows=3)
    assert r.limits == StepLimits(max_seqs=3, max_rows=3, rows_per_prompt=3, lone_prompt_rows=3)
    assert r.max_rows == 3
    custom = StepLimits(max_seqs=2, max_rows=32, rows_per_prompt=8, lone_prompt_rows=32)
    r = Runner(tiny_model, max_slots=1, max_ctx=256, limits=custom)
    assert r.limits is custom and r.max_rows == 32
    with pytest.raises(ValueError, match="must agree"):
        Runner(tiny_model, max_slots=1, max_ctx=256, max_rows=16, limits=custom)


def test_cpu_and_reference_default_to_16_rows_and_upstream_policy(tiny_model):
    # Upstream's policy whatever max_slots is (8 slots still decode 6 a step on the CPU); a
    # larger max_rows goes to a lone prompt, the concurrent prompts keep 4 rows each.
    for backend in ("cpu", "reference"):
        assert default_max_rows(backend) == 16
        r = Runner(tiny_model, backend=backend, max_slots=8, max_ctx=256)
        assert r.max_rows == 16 and r.limits == StepLimits()
    r = Runner(tiny_model, max_slots=8, max_ctx=256, max_rows=32)
    assert r.limits == StepLimits(max_seqs=6, max_rows=32, rows_per_prompt=4, lone_prompt_rows=32)
    with pytest.raises(ValueError, match="bad runner options: .*max_rows=0"):
        Runner(tiny_model, max_slots=1, max_ctx=256, max_rows=0)


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_gpu_default_limits(backend):
    """No GPU here: the policy function itself. 512 rows; a lone prompt takes them all, a prompt
    beside others 64; every resident slot decodes in one step (at least upstream's 6)."""
    assert default_max_rows(backend) == 512
    assert default_limits(512, backend, 8) == StepLimits(max_seqs=8, max_rows=512, rows_per_prompt=64,
                                                         lone_prompt_rows=512)
    assert default_limits(512, backend, 2).max_seqs == 6
    assert default_limits(512, backend, 40).max_seqs == 40
    assert default_limits(16, backend, 8) == StepLimits(max_seqs=8, max_rows=16, rows_per_prompt=16,
                                                        lone_prompt_rows=16)
    assert default_limits(4, backend, 8) == StepLimits(max_seqs=4, max_rows=4, rows_per_prompt=4,
                                                       lone_prompt_rows=4)
    assert default_limits(1, backend, 1) == StepLimits(max_seqs=1, max_rows=1, rows_per_prompt=1,
                                                       lone_prompt_rows=1)


def test_pages_follow_kv_pool_tokens_or_slots_times_context(tiny_model):
    assert Runner(tiny_model, max_slots=3, max_ctx=300).n_pages == 3 * 3
    assert Runner(tiny_model, max_slots=3, max_ctx=300, kv_pool_tokens=1000).n_pages == 8


def test_memory_plan_is_what_the_engine_allocated(cpu):
    assert cpu.allocated_bytes() == cpu.memory_plan.sections
    assert cpu.memory_plan.n_pages == cpu.n_pages


def test_device_names_threads_and_simd_path(cpu):
    assert cpu.backend == "cpu"
    assert cpu.device == f"cpu (2 threads, {native.simd_path()})"
    assert Runner(cpu.model, max_slots=1, max_ctx=128).n_threads == native.physical_cores()


def test_qat_override_reaches_the_config(tiny_model):
    r = Runner(tiny_model, backend="reference", max_slots=1, max_ctx=128, qat_numerics=True)
    assert r.config.qat_numerics and not tiny_model.config.qat_numerics


def test_backend_list_is_what_runner_accepts():
    assert BACKENDS == ("cpu", "reference", "cuda", "hip")


# --- plan validation -------------------------------------------------------------------------


def raw_plan(**over):
    base = dict(lane_slot=[0], lane_token=[1], lane_pos=[0], lane_logits=[1], table_slot=[0],
                block_table=[[0, 1, -1, -1]])
    base.update(over)
    return types.SimpleNamespace(**{k: np.asarray(v, dtype=np.int32) for k, v in base.items()})


@pytest.mark.parametrize("over,match", [
    (dict(lane_slot=[3], table_slot=[3]), r"lane_slot\[0\] = 3 is out of range 0..2"),
    (dict(lane_slot=[-1], table_slot=[-1]), r"lane_slot\[0\] = -1"),
    (dict(lane_token=[1024]), r"lane_token\[0\] = 1024 is out of range 0..1023"),
    (dict(lane_pos=[512]), r"lane_pos\[0\] = 512 is out of range 0..511"),
    (dict(lane_pos=[-2]), r"lane_pos\[0\] = -2"),
    (dict(lane_logits=[2]), r"lane_logits\[0\] = 2"),
    (dict(block_table=[[0, 99, -1, -1]]), r"block_table\[1\] = 99"),
    (dict(block_table=[[0, -2, -1, -1]]), r"block_table\[1\] = -2"),
    (dict(lane_slot=[1]), "lane slot 1 has no block-table row"),
    (dict(table_slot=[0, 0], block_table=[[0, -1], [1, -1]]), "names a slot twice"),
    (dict(lane_slot=[0, 0], lane_token=[1, 2], lane_pos=[0, 2], lane_logits=[0, 1]),
     "lane 1: slot 0 position 2 does not follow"),
    (dict(lane_slot=[0] * 17, lane_token=[1] * 17, lane_pos=list(range(17)), lane_logits=[0] * 17),
     "17 lanes; this engine takes at most max_rows=16"),
])
def test_bad_plans_are_one_line_value_errors(cpu, over, match):
    with pytest.raises(ValueError, match=match) as e:
        cpu.step(raw_plan(**over))
    assert "\n" not in str(e.value)


def test_reset_slot_out_of_range(cpu):
    with pytest.raises(ValueError, match="slot 3 is out of range"):
        cpu.reset_slot(3)


def test_empty_plan_returns_no_logits(cpu):
    out = cpu.step(StepPlan.build([], {}, 4))
    assert out.shape == (0, cpu.config.n_vocab) and out.dtype == np.float32


# --- stepping --------------------------------------------------------------------------------


def test_step_returns_logits_of_the_marked_lanes_in_lane_order(cpu, prompt):
    alone0 = run_alone(cpu, 0, prompt[:3])
    alone1 = run_alone(cpu, 1, prompt[3:5])
    cpu.reset_slot(0)
    cpu.reset_slot(1)
    lanes = [(1, prompt[3], 0, False), (0, prompt[0], 0, True), (1, prompt[4], 1, True),
             (0, prompt[1], 1, False), (0, prompt[2], 2, True)]
    out = cpu.step(plan_of(lanes))
    assert out.shape == (3, cpu.config.n_vocab) and out.dtype == np.float32
    assert np.array_equal(bits(out), bits(np.stack([alone0[0], alone1[1], alone0[2]])))


def test_step_argmax_is_the_argmax_of_the_logits(cpu, prompt):
    """The greedy tokens the service asks for when every logit lane is plain greedy."""
    lanes = [(1, prompt[3], 0, False), (0, prompt[0], 0, True), (1, prompt[4], 1, True)]
    cpu.reset_slot(0)
    cpu.reset_slot(1)
    want = cpu.step(plan_of(lanes)).argmax(axis=1)
    cpu.reset_slot(0)
    cpu.reset_slot(1)
    got = cpu.step_argmax(plan_of(lanes))
    assert got.dtype == np.int32 and np.array_equal(got, want)
    assert cpu.step_argmax(StepPlan.build([], {}, 4)).shape == (0,)


def test_logits_do_not_depend_on_what_shares_the_step(cpu, prompt):
    """Decode slot 0 alone, then beside a prompt of slot 1 split into varying rows: same bits."""
    alone = run_alone(cpu, 0, prompt[:10])
    other = prompt[10:24]
    cpu.reset_slot(0)
    cpu.reset_slot(1)
    got, p1 = [], 0
    for pos, tok in enumerate(prompt[:10]):
        k = [1, 4, 2, 3, 0, 4][pos % 6]  # prompt rows of slot 1 sharing this step
        lanes = [(1, other[p1 + j], p1 + j, j == k - 1) for j in range(min(k, len(other) - p1))]
        p1 += len(lanes)
        lanes.insert(pos % 2 * len(lanes), (0, tok, pos, True))  # before or after slot 1's rows
        out = cpu.step(plan_of(lanes))
        mine = next(i for i, lane in enumerate(lanes) if lane[0] == 0)
        got.append(out[sum(1 for lane in lanes[:mine] if lane[3])])
    assert np.array_equal(bits(np.stack(got)), bits(alone))


def test_reset_slot_starts_a_fresh_sequence(cpu, prompt):
    first = run_alone(cpu, 2, prompt[:5])
    again = run_alone(cpu, 2, prompt[:5])
    assert np.array_equal(bits(first), bits(again))


def test_native_agrees_with_the_reference_backend(tiny_model, cpu, prompt):
    ref = Runner(tiny_model, backend="reference", max_slots=3, max_ctx=512)
    assert ref.device == "cpu (numpy reference)"
    want = run_alone(ref, 0, prompt[:6])
    got = run_alone(cpu, 0, prompt[:6])
    assert np.max(np.abs(got - want)) <= 1e-3 * np.max(np.abs(want))


# --- reference backend -----------------------------------------------------------------------


def test_reference_backend_honours_plans(tiny_model, prompt):
    from ds4_app.engine.reference import Reference

    oracle = Reference(tiny_model.config, tiny_model.weights_f32())
    st0, st1 = oracle.new_state(), oracle.new_state()
    want = [oracle.step(st0, prompt[0]), oracle.step(st1, prompt[5]), oracle.step(st0, prompt[1])]
    r = Runner(tiny_model, backend="reference", max_slots=2, max_ctx=256)
    out = r.step(plan_of([(0, prompt[0], 0, True), (1, prompt[5], 0, True), (0, prompt[1], 1, True)]))
    assert np.array_equal(bits(out), bits(np.stack(want)))


def test_reference_backend_refuses_a_position_it_cannot_reach_and_keeps_its_state(tiny_model, prompt):
    r = Runner(tiny_model, backend="reference", max_slots=2, max_ctx=256)
    first = r.step(plan_of([(0, prompt[0], 0, True)]))
    with pytest.raises(ValueError, match="slot 0 is at position 1, the plan feeds 3"):
        r.step(plan_of([(1, prompt[1], 0, True), (0, prompt[1], 3, True)]))
    with pytest.raises(ValueError, match="lane_token"):
        r.step(plan_of([(0, prompt[1], 1, True), (0, 10**6, 2, True)]))
    r.step(plan_of([(1, prompt[1], 0, True)]))  # slot 1 did not move either
    r.reset_slot(0)
    assert np.array_equal(bits(r.step(plan_of([(0, prompt[0], 0, True)]))), bits(first))
