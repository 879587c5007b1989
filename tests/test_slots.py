"""Exact tests of the slot manager: admission, page accounting, sessions, eviction, preemption."""

import numpy as np
import pytest

from ds4_app.engine.pages import PagePool, PoolExhausted
from ds4_app.engine.sampling import SamplerConfig
from ds4_app.engine.slots import (AdmissionError, Busy, EmptyPrompt, PromptExceedsPool,
                                  PromptTooLong, SlotManager, SlotState)

GREEDY = SamplerConfig()


def make(n_pages: int, max_slots: int = 4, max_ctx: int = 1024) -> tuple[SlotManager, PagePool]:
    pool = PagePool(n_pages)
    return SlotManager(max_slots, max_ctx, pool), pool


def counts(pool: PagePool) -> tuple[int, int, int]:
    pool.check()
    return pool.n_used, pool.n_reserved, pool.n_free


def prefill(m: SlotManager, i: int, first_token: int = 1) -> None:
    """Drive a slot through its whole prompt the way commit() would, and sample one token."""
    s = m.slot(i)
    m.grow(i, len(s.tokens))
    s.n_computed = len(s.tokens)
    s.tokens.append(first_token)


def decode(m: SlotManager, i: int, n: int) -> None:
    """Run n decode steps on a decoder."""
    s = m.slot(i)
    for _ in range(n):
        m.grow(i, len(s.tokens))
        s.n_computed = len(s.tokens)
        s.tokens.append(2)


# ---- admission ------------------------------------------------------------------------------

def test_admission_errors_are_specific_and_change_nothing():
    m, pool = make(n_pages=2, max_slots=1, max_ctx=512)
    with pytest.raises(EmptyPrompt):
        m.admit("r", [], GREEDY)
    with pytest.raises(PromptTooLong, match="longer than the context of 512"):
        m.admit("r", [1] * 513, GREEDY)
    with pytest.raises(PromptExceedsPool, match="raise --kv-pool-tokens"):
        m.admit("r", [1] * 257, GREEDY)  # 3 pages > 2
    assert counts(pool) == (0, 0, 2) and m.n_free_slots == 1
    assert m.admit("a", [1] * 10, GREEDY) == 0
    with pytest.raises(Busy) as err:
        m.admit("b", [1] * 10, GREEDY)
    assert err.value.reason == "slots" and isinstance(err.value, AdmissionError)
    for e in (EmptyPrompt, PromptTooLong, PromptExceedsPool):
        assert issubclass(e, AdmissionError) and not issubclass(e, Busy)


def test_admission_reserves_prompt_plus_one_page_capped():
    m, pool = make(n_pages=8, max_ctx=512)
    a = m.admit("a", [1] * 200, GREEDY)  # 2 pages + 1
    assert (a, counts(pool), m.slot(a).block_table) == (0, (0, 3, 5), [])
    b = m.admit("b", [1] * 512, GREEDY)  # 4 pages; the extra page would pass max_ctx
    assert (b, counts(pool)) == (1, (0, 7, 1))
    m2, pool2 = make(n_pages=2)
    m2.admit("c", [1] * 200, GREEDY)  # 3 pages can never fit a 2-page pool: prompt alone
    assert counts(pool2) == (0, 2, 0)


def test_busy_on_pages_then_admitted_after_retirement():
    m, pool = make(n_pages=4)
    a = m.admit("a", [1] * 200, GREEDY)
    with pytest.raises(Busy) as err:
        m.admit("b", [1] * 200, GREEDY)
    assert err.value.reason == "pages"
    assert counts(pool) == (0, 3, 1) and m.get(1) is None
    m.retire(a)
    assert counts(pool) == (0, 0, 4)
    assert m.admit("b", [1] * 200, GREEDY) == 0  # lowest free slot again
    assert m.slot(0).request_id == "b" and counts(pool) == (0, 3, 1)


def test_decoder_headroom_top_up_is_exact_and_all_or_nothing():
    m, pool = make(n_pages=6)
    a = m.admit("a", [1] * 100, GREEDY)
    prefill(m, a)  # 101 tokens: 1 page used, 1 reserved
    decode(m, a, 28)  # 129 tokens: the pending token sits on page 2
    m.grow(a, 129)
    assert m.slot(a).block_table == [0, 1] and counts(pool) == (2, 0, 4)
    # A needs one more page of headroom (3 total); B wants 4 (300 tokens + 1): 5 > 4 free.
    with pytest.raises(Busy):
        m.admit("b", [1] * 300, GREEDY)
    assert counts(pool) == (2, 0, 4) and pool.reserved(m.slot(a).handle) == 0
    # 200 tokens want 3: A's top-up (1) + 3 == 4 free, so both happen, exactly.
    b = m.admit("b", [1] * 200, GREEDY)
    assert pool.reserved(m.slot(a).handle) == 1 and pool.reserved(m.slot(b).handle) == 3
    assert counts(pool) == (2, 4, 0)
    with pytest.raises(Busy):
        m.admit("c", [1], GREEDY)
    assert counts(pool) == (2, 4, 0)


def test_admitted_prompt_always_finishes_prefill_on_a_tight_pool():
    m, pool = make(n_pages=5)
    a = m.admit("a", [1] * 100, GREEDY)
    prefill(m, a)
    b = m.admit("b", [1] * 250, GREEDY)  # A holds 2, B reserves 3: the pool is fully promised
    assert counts(pool) == (1, 4, 0)
    with pytest.raises(Busy):
        m.admit("c", [1], GREEDY)
    # The decoder uses its own promised page (position 128 is on page 2) ...
    decode(m, a, 29)
    assert m.slot(a).block_table == [0, 1] and counts(pool) == (2, 3, 0)
    decode(m, a, 127)  # positions up to 255: still two pages
    assert len(m.slot(a).tokens) == 257 and m.ensure_decode_headroom(a) is False
    # ... and then cannot take any of B's promised pages for position 256.
    with pytest.raises(PoolExhausted):
        m.grow(a, 257)
    assert counts(pool) == (2, 3, 0)
    for n in range(1, 251, 7):  # B's prefill, in uneven chunks, never runs out
        m.grow(b, n)
    m.grow(b, 250)
    assert m.slot(b).block_table == [2, 3] and counts(pool) == (4, 1, 0)


def test_grow_appends_exact_ids_and_respects_max_ctx():
    m, pool = make(n_pages=8, max_ctx=384)
    a = m.admit("a", [1] * 300, GREEDY)
    assert m.grow(a, 1) == [0]
    assert m.grow(a, 128) == []
    assert m.grow(a, 129) == [1]
    assert m.grow(a, 300) == [2]
    assert m.block_table(a) == [0, 1, 2]
    with pytest.raises(ValueError):
        m.grow(a, 385)


def test_block_tables_follow_grow_and_retire():
    m, pool = make(n_pages=8, max_ctx=512)  # 4 page columns
    a = m.admit("a", [1] * 300, GREEDY)
    b = m.admit("b", [1] * 10, GREEDY)
    m.grow(b, 10)
    m.grow(a, 300)
    assert m.block_tables(np.array([a, b], dtype=np.int32)).tolist() == [[1, 2, 3, -1], [0, -1, -1, -1]]
    m.retire(a)
    c = m.admit("c", [1] * 5, GREEDY)  # reuses a's slot: none of a's pages may show
    assert c == a
    assert m.block_tables(np.array([b, c], dtype=np.int32)).tolist() == [[0, -1, -1, -1], [-1] * 4]
    m.grow(c, 5)
    rows = m.block_tables(np.array([c], dtype=np.int32))
    assert rows.dtype == np.int32 and rows.tolist() == [[1, -1, -1, -1]]
    rows[0, 0] = 7  # a copy: the manager's tables do not move
    assert m.block_tables(np.array([c], dtype=np.int32)).tolist() == [[1, -1, -1, -1]]


def test_ensure_decode_headroom_is_preflighted_over_the_cohort():
    m, pool = make(n_pages=4, max_ctx=1024)
    a = m.admit("a", [1] * 128, GREEDY)
    b = m.admit("b", [1] * 128, GREEDY)
    for i in (a, b):
        prefill(m, i)  # 129 tokens: page 1 used, the pending token needs a second page
        pool.unreserve(m.slot(i).handle)
    other = pool.acquire(1)  # someone else holds a promise: one page free
    assert counts(pool) == (2, 1, 1)
    assert m.ensure_decode_headroom(a, b) is False  # each alone fits, both together do not
    assert counts(pool) == (2, 1, 1)
    assert m.ensure_decode_headroom(a) is True  # its extra page is best effort: none left
    assert (pool.reserved(m.slot(a).handle), pool.reserved(m.slot(b).handle)) == (1, 0)
    pool.release(other)
    assert m.ensure_decode_headroom(a, b) is True
    # b's page now comes first (needed), then a's extra page (3rd) as far as the pool allows.
    assert (pool.reserved(m.slot(a).handle), pool.reserved(m.slot(b).handle)) == (1, 1)
    assert counts(pool) == (2, 2, 0)


# ---- sampler state --------------------------------------------------------------------------

def test_seed_zero_is_reproducible_per_slot():
    m, _ = make(n_pages=8)
    a = m.admit("a", [1], SamplerConfig(temperature=1.0, seed=0))
    b = m.admit("b", [1], SamplerConfig(temperature=1.0, seed=0))
    c = m.admit("c", [1], SamplerConfig(temperature=1.0, seed=1))
    d = m.admit("d", [1], SamplerConfig(temperature=1.0))
    draws = [m.slot(i).rng.random(4).tolist() for i in (a, b, c, d)]
    assert draws[0] == draws[1]
    assert draws[0] != draws[2] and draws[0] != draws[3]
    assert m.slot(a).history == [1] and m.slot(a).history is m.slot(a).tokens


def test_length_limits():
    m, _ = make(n_pages=8, max_ctx=256)
    a = m.admit("a", [1] * 10, GREEDY, max_new_tokens=5)
    b = m.admit("b", [1] * 256, GREEDY)
    c = m.admit("c", [1] * 10, SamplerConfig(max_tokens=3))
    assert [m.slot(i).max_len for i in (a, b, c)] == [15, 257, 13]
    prefill(m, b)
    assert m.slot(b).length_done and not m.slot(b).is_decoding
    with pytest.raises(ValueError):
        m.admit("d", [1], GREEDY, max_new_tokens=0)


# ---- resident sessions ----------------------------------------------------------------------

def test_park_keeps_pages_drops_reservation_and_resume_prefills_only_new_tokens():
    m, pool = make(n_pages=8)
    a = m.admit("a", [1] * 100, GREEDY)
    prefill(m, a, first_token=9)
    m.park(a, "chat-1")
    s = m.slot(a)
    assert s.state is SlotState.IDLE and s.session_id == "chat-1"
    assert counts(pool) == (1, 0, 7) and m.find_session("chat-1") == a
    m.resume(a, [5] * 200, "a2", GREEDY)
    assert s.state is SlotState.RUNNING and s.request_id == "a2"
    assert s.n_computed == 100 and s.n_pending == 201 and s.tokens[100] == 9
    assert s.prompt_len == 301 and s.n_generated == 0
    assert counts(pool) == (1, 3, 4)  # 301 tokens: 3 pages + 1, one of them already used
    assert m.find_session("chat-1") is None  # running now, not parked


def test_resume_too_long_or_busy_leaves_session_parked():
    m, pool = make(n_pages=4, max_ctx=300)
    a = m.admit("a", [1] * 100, GREEDY)
    prefill(m, a)
    m.park(a, "s")
    with pytest.raises(PromptTooLong):
        m.resume(a, [1] * 200, "a2", GREEDY)  # 101 + 200 > 300
    b = m.admit("b", [1] * 200, GREEDY)  # reserves 3 of the 3 free pages
    with pytest.raises(Busy):
        m.resume(a, [1] * 10, "a2", GREEDY)  # would need a second page
    s = m.slot(a)
    assert s.state is SlotState.IDLE and len(s.tokens) == 101 and counts(pool) == (1, 3, 0)
    m.retire(b)
    m.resume(a, [1] * 10, "a2", GREEDY)
    assert counts(pool) == (1, 1, 2)


def test_lru_eviction_order():
    m, pool = make(n_pages=16)
    for rid in "abc":
        i = m.admit(rid, [1] * 10, GREEDY)
        prefill(m, i)
    m.park(0, "A")
    m.park(1, "B")
    m.park(2, "C")
    m.resume(0, [3], "a2", GREEDY)
    m.park(0, "A")  # A is now the most recently used
    assert [s.session_id for s in m.idle()] == ["B", "C", "A"]
    assert [m.evict_lru(), m.evict_lru(), m.evict_lru(), m.evict_lru()] == ["B", "C", "A", None]
    assert m.n_evictions == 3 and counts(pool) == (0, 0, 16)


def test_admission_evicts_idle_sessions_only_when_that_makes_room():
    m, pool = make(n_pages=4, max_slots=2)
    for rid in "ab":
        i = m.admit(rid, [1] * 10, GREEDY)
        prefill(m, i)
    m.park(1, "B")
    m.park(0, "A")
    c = m.admit("c", [1] * 10, GREEDY)  # no free slot: the LRU session (B) goes
    assert c == 1 and m.find_session("B") is None and m.find_session("A") == 0
    assert m.n_evictions == 1
    with pytest.raises(Busy):  # needs 4 pages: even evicting A (1 page) leaves 3
        m.admit("d", [1] * 300, GREEDY, evict_idle=True)
    assert m.find_session("A") == 0 and m.n_evictions == 1
    m.retire(c)
    with pytest.raises(Busy):
        m.admit("d", [1] * 300, GREEDY, evict_idle=False)
    assert m.admit("d", [1] * 300, GREEDY) == 0  # evicting A now makes exactly enough room
    assert m.find_session("A") is None and m.n_evictions == 2 and counts(pool) == (0, 4, 0)


def test_preempt_newest_running_request():
    m, pool = make(n_pages=16)
    a = m.admit("a", [1] * 10, GREEDY, max_new_tokens=10, session_id="S")
    b = m.admit("b", [2] * 10, GREEDY)
    c = m.admit("c", [3] * 10, SamplerConfig(temperature=1.0, seed=4))
    for i in (a, b, c):
        prefill(m, i, first_token=7)
    m.park(b, "B")  # parked slots are not running: never preempted
    decode(m, a, 2)
    rng_c = m.slot(c).rng
    p = m.preempt_newest()
    assert (p.request_id, p.tokens, p.rng) == ("c", tuple([3] * 10 + [7]), rng_c)
    assert m.get(c) is None
    p = m.preempt_newest()
    assert (p.request_id, p.session_id, p.max_new_tokens) == ("a", "S", 7)
    assert p.tokens == tuple([1] * 10 + [7, 2, 2])
    assert m.preempt_newest() is None and m.n_preemptions == 2
    assert m.find_session("B") == b and counts(pool) == (1, 0, 15)
    # Resubmitting continues the same generator.
    i = m.admit(p.request_id, p.tokens, p.sampler, max_new_tokens=p.max_new_tokens, rng=p.rng)
    assert m.slot(i).rng is p.rng and m.slot(i).max_len == 13 + 7


def test_resumed_session_is_the_newest_request():
    m, _ = make(n_pages=16)
    a = m.admit("a", [1] * 10, GREEDY)
    prefill(m, a)
    m.park(a, "A")
    m.admit("b", [1] * 10, GREEDY)
    m.resume(a, [4], "a2", GREEDY)
    assert m.preempt_newest().request_id == "a2"
