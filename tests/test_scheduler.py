"""Exact plans from the scheduler: row grants, lane order, logits flags, rotation, pressure."""

import random

import numpy as np
import pytest

from ds4_app.engine.pages import PagePool
from ds4_app.engine.plan import StepLimits
from ds4_app.engine.sampling import SamplerConfig
from ds4_app.engine.scheduler import Scheduler, ScheduledStep, split_budget
from ds4_app.engine.slots import Busy, PromptTooLong, SlotManager

GREEDY = SamplerConfig()


def make(n_pages: int = 64, max_slots: int = 8, max_ctx: int = 2048,
         limits: StepLimits = StepLimits()) -> tuple[Scheduler, SlotManager, PagePool]:
    pool = PagePool(n_pages)
    m = SlotManager(max_slots, max_ctx, pool)
    return Scheduler(m, limits), m, pool


def step(sch: Scheduler, token: int = 5) -> ScheduledStep:
    """Schedule and commit one step, sampling ``token`` everywhere logits come back."""
    st = sch.schedule()
    sch.commit(st, {s: token for s in st.logit_slots})
    return st


def lanes(st: ScheduledStep) -> list[tuple[int, int, int, int]]:
    p = st.plan
    return list(zip(p.lane_slot.tolist(), p.lane_token.tolist(), p.lane_pos.tolist(),
                    p.lane_logits.tolist()))


def test_split_budget_rounds_from_rotating_start():
    assert split_budget([4, 4, 4, 4], 14, 4, 0) == [4, 4, 4, 2]
    assert split_budget([4, 4, 4, 4], 14, 4, 1) == [2, 4, 4, 4]
    assert split_budget([4, 4, 4, 4], 14, 4, 3) == [4, 4, 2, 4]
    assert split_budget([16], 16, 4, 0) == [16]
    assert split_budget([3, 16, 1], 16, 4, 0) == [3, 12, 1]  # leftovers go round again
    assert split_budget([2, 2], 16, 4, 1) == [2, 2]


def test_lone_prompt_of_40_runs_16_16_8_then_decodes():
    sch, m, pool = make()
    prompt = list(range(100, 140))
    a = m.admit("a", prompt, GREEDY)
    st = step(sch, token=7)
    assert st.rows == {a: 16} and st.logit_slots == ()
    assert lanes(st) == [(a, 100 + i, i, 0) for i in range(16)]
    assert st.plan.block_table.tolist() == [[0] + [-1] * 15]  # 2048 tokens: 16 page columns
    st = step(sch, token=7)
    assert st.rows == {a: 16} and st.plan.lane_pos.tolist() == list(range(16, 32))
    st = step(sch, token=7)
    assert st.rows == {a: 8} and st.logit_slots == (a,)
    assert lanes(st) == [(a, 100 + i, i, int(i == 39)) for i in range(32, 40)]
    assert m.slot(a).tokens == prompt + [7] and m.slot(a).n_computed == 40
    st = step(sch, token=8)
    assert lanes(st) == [(a, 7, 40, 1)]
    assert m.slot(a).tokens == prompt + [7, 8] and counts(pool) == (1, 1)


def counts(pool: PagePool) -> tuple[int, int]:
    pool.check()
    return pool.n_used, pool.n_reserved


def test_three_prompts_beside_two_decoders():
    sch, m, _ = make()
    d1 = m.admit("d1", [11], GREEDY)  # one-token prompts are decoders from the start
    d2 = m.admit("d2", [12], GREEDY)
    ps = [m.admit(f"p{i}", [20 + i] * 30, GREEDY) for i in range(3)]
    st = step(sch)
    assert st.rows == {d1: 1, d2: 1, ps[0]: 4, ps[1]: 4, ps[2]: 4}
    want = [(d1, 11, 0, 1), (d2, 12, 0, 1)]
    for i, p in enumerate(ps):
        want += [(p, 20 + i, pos, 0) for pos in range(4)]
    assert lanes(st) == want
    assert st.logit_slots == (d1, d2)
    assert st.plan.table_slot.tolist() == sorted([d1, d2, *ps])
    st = step(sch)
    assert [r[2] for r in lanes(st)] == [1, 1] + [4, 5, 6, 7] * 3
    assert st.plan.n_lanes == 14 <= StepLimits().max_rows


def test_six_decoders_take_one_row_each_and_block_a_seventh_prompt():
    sch, m, _ = make()
    ds = [m.admit(f"d{i}", [i], GREEDY) for i in range(6)]
    p = m.admit("p", [9] * 50, GREEDY)
    st = step(sch)
    assert st.rows == {d: 1 for d in ds} and p not in st.rows
    assert st.plan.lane_logits.tolist() == [1] * 6
    assert st.logit_slots == tuple(ds)
    m.retire(ds[0])
    st = step(sch)
    assert st.rows == {**{d: 1 for d in ds[1:]}, p: 4}


def test_max_seqs_limits_prompts_in_admission_order():
    sch, m, _ = make(limits=StepLimits(max_seqs=3, max_rows=16, rows_per_prompt=4,
                                       lone_prompt_rows=16))
    d = m.admit("d", [1], GREEDY)
    ps = [m.admit(f"p{i}", [2] * 40, GREEDY) for i in range(4)]
    st = step(sch)
    assert st.rows == {d: 1, ps[0]: 4, ps[1]: 4}


def test_decoders_beyond_max_seqs_rotate():
    sch, m, _ = make(limits=StepLimits(max_seqs=2, max_rows=16, rows_per_prompt=4,
                                       lone_prompt_rows=16))
    ds = [m.admit(f"d{i}", [i], GREEDY) for i in range(3)]
    served = [sorted(step(sch).rows) for _ in range(3)]
    assert served == [[ds[0], ds[1]], [ds[0], ds[2]], [ds[1], ds[2]]]


def test_lone_prompt_limit_applies_only_without_decoders_and_other_prompts():
    sch, m, _ = make()
    a = m.admit("a", [1] * 100, GREEDY)
    b = m.admit("b", [1] * 100, GREEDY)
    assert step(sch).rows == {a: 4, b: 4}  # two prompts: concurrent limit
    m.retire(b)
    assert step(sch).rows == {a: 16}
    d = m.admit("d", [1], GREEDY)
    assert step(sch).rows == {a: 4, d: 1}  # beside a decoder: concurrent limit


def test_partial_round_rotates_fairly():
    sch, m, _ = make()
    d1, d2 = m.admit("d1", [1], GREEDY), m.admit("d2", [2], GREEDY)
    ps = [m.admit(f"p{i}", [3] * 500, GREEDY) for i in range(4)]
    partial = []
    for _ in range(12):
        st = step(sch)
        assert st.rows[d1] == st.rows[d2] == 1
        grants = [st.rows[p] for p in ps]
        assert sorted(grants) == [2, 4, 4, 4] and st.plan.n_lanes == 16
        partial.append(ps[grants.index(2)])
    assert partial == [ps[3], ps[0], ps[1], ps[2]] * 3


def test_logits_only_for_decoders_and_completing_rows():
    sch, m, _ = make()
    a = m.admit("a", [1] * 6, GREEDY)  # two grants: 4 rows, then the last 2
    b = m.admit("b", [2] * 4, GREEDY)  # exactly one grant: its last row completes the prompt
    st = step(sch)
    assert lanes(st) == ([(a, 1, p, 0) for p in range(4)] + [(b, 2, p, int(p == 3))
                                                              for p in range(4)])
    assert st.logit_slots == (b,)
    st = step(sch)  # b decodes (first), a completes its prompt in 2 rows
    assert lanes(st) == [(b, 5, 4, 1), (a, 1, 4, 0), (a, 1, 5, 1)]
    assert st.logit_slots == (b, a) and st.plan.n_logits == 2


def test_commit_checks_tokens_skips_retired_and_reports_length_done():
    sch, m, _ = make()
    a = m.admit("a", [1], GREEDY, max_new_tokens=2)
    b = m.admit("b", [2], GREEDY)
    st = sch.schedule()
    with pytest.raises(ValueError):
        sch.commit(st, {a: 3})
    with pytest.raises(ValueError):
        sch.commit(st, {a: 3, b: 4, 7: 1})
    m.retire(b)
    c = m.admit("c", [9] * 30, GREEDY)  # reuses b's slot index: the stale result must not land
    assert c == b
    assert sch.commit(st, {a: 3, b: 4}) == []
    assert m.slot(a).tokens == [1, 3] and m.slot(c).tokens == [9] * 30
    assert m.slot(c).n_computed == 0
    st = sch.schedule()
    assert sch.commit(st, {a: 6}) == [a]
    assert m.slot(a).length_done and m.slot(a).n_generated == 2
    st = sch.schedule()
    assert a not in st.rows  # finished: waits for the caller to retire or park it


def test_empty_step_when_nothing_runs():
    sch, m, _ = make()
    st = sch.schedule()
    assert st.is_empty and st.plan.block_table.shape == (0, 16)
    assert sch.commit(st, {}) == []


def run_until(sch: Scheduler, cond, limit: int = 2000) -> ScheduledStep:
    for _ in range(limit):
        st = step(sch)
        if cond(st):
            return st
    raise AssertionError("condition never met")


def test_page_pressure_evicts_idle_session_before_preempting():
    sch, m, pool = make(n_pages=3)
    a = m.admit("a", [1], GREEDY)
    step(sch)
    m.park(a, "A")  # holds page 0
    b = m.admit("b", [2] * 128, GREEDY)  # reserves pages for 128 tokens + 1
    st = run_until(sch, lambda st: st.evicted != ())
    assert st.evicted == ("A",) and st.preempted == () and m.n_evictions == 1
    assert st.plan.lane_pos.tolist() == [256]  # b's first row on its third page
    assert m.block_table(b) == [1, 2, 0] and m.find_session("A") is None


def test_page_pressure_preempts_the_newest_running_request():
    sch, m, pool = make(n_pages=4)
    a = m.admit("a", [1] * 128, GREEDY)
    b = m.admit("b", [2] * 100, GREEDY)
    st = run_until(sch, lambda st: st.preempted != ())
    (p,) = st.preempted
    assert p.request_id == "b" and m.get(b) is None and m.n_preemptions == 1
    # Both prefill 4 rows a step (a: 32 steps, b: 25), then decode; a reaches position 256
    # (its third page) when b has 236 tokens, still on its own two pages.
    assert len(p.tokens) == 236 and len(m.slot(a).tokens) == 258
    assert st.rows == {a: 1} and st.plan.lane_pos.tolist() == [256]
    # a held pages 0 and 2, b 1 and 3; b's pages came back and a took the lowest.
    assert m.block_table(a) == [0, 2, 1] and counts(pool) == (3, 1)


def test_newest_decoder_short_of_pages_preempts_itself():
    sch, m, _ = make(n_pages=4)
    a = m.admit("a", [1] * 100, GREEDY)
    b = m.admit("b", [2] * 128, GREEDY)
    st = run_until(sch, lambda st: st.preempted != ())
    assert st.preempted[0].request_id == "b" and st.rows == {a: 1}
    assert len(st.preempted[0].tokens) == 257


def simulate(seed: int) -> tuple[int, int, int]:
    """A random workload; asserts the plan and pool invariants at every step."""
    rnd = random.Random(seed)
    lim = StepLimits()
    sch, m, pool = make(n_pages=10, max_slots=6, max_ctx=700, limits=lim)
    waiting: list[tuple[str, list[int]]] = []
    n_done = 0
    for t in range(1000):
        if rnd.random() < 0.3:
            waiting.append((f"r{t}", [rnd.randrange(50) for _ in range(rnd.randrange(1, 300))]))
        while waiting:
            rid, prompt = waiting[0]
            try:
                m.admit(rid, prompt, GREEDY, max_new_tokens=rnd.randrange(1, 300))
            except Busy:
                break
            waiting.pop(0)
        idle = m.idle()
        if idle and rnd.random() < 0.1:
            try:
                m.resume(rnd.choice(idle).index, [1] * rnd.randrange(0, 100), f"r{t}", GREEDY)
            except (Busy, PromptTooLong):
                pass
        before = {s.index: (s.n_computed, len(s.tokens)) for s in m.running()}
        st = sch.schedule()
        for p in st.preempted:
            waiting.insert(0, (p.request_id, list(p.tokens)))
        p = st.plan
        assert p.n_lanes <= lim.max_rows and len(st.rows) <= lim.max_seqs
        decoders = [i for i in st.rows if before[i][1] - before[i][0] == 1]
        assert all(st.rows[i] == 1 for i in decoders) and st.n_decode_rows == len(decoders)
        assert all(a.flags.c_contiguous for a in (p.lane_slot, p.lane_token, p.lane_pos, p.lane_logits,
                                                  p.table_slot, p.block_table))
        assert p.table_slot.tolist() == sorted(st.rows)
        for i, rows in st.rows.items():
            mine = p.lane_slot == i
            pos = p.lane_pos[mine]
            assert pos.tolist() == list(range(before[i][0], before[i][0] + rows))
            assert p.lane_token[mine].tolist() == m.slot(i).tokens[before[i][0]:before[i][0] + rows]
            row = p.block_table[p.table_slot.tolist().index(i)]
            assert (row[pos // 128] >= 0).all()  # every lane's page is mapped
            table = m.block_table(i)
            assert row.tolist() == table + [-1] * (row.shape[0] - len(table))
        assert np.array_equal(p.lane_logits == 1,
                              p.lane_pos == np.array([before[i][1] - 1 for i in p.lane_slot]))
        for i in sch.commit(st, {s: rnd.randrange(50) for s in st.logit_slots}):
            n_done += 1
            if rnd.random() < 0.5:
                m.retire(i)
            else:
                m.park(i, f"s{i}")
        pool.check()
    return n_done, m.n_preemptions, m.n_evictions


def test_random_workloads_keep_every_invariant():
    totals = np.array([simulate(seed) for seed in range(4)]).sum(axis=0)
    assert (totals > 0).all() and totals[0] > 20  # requests finished, were preempted, evicted
