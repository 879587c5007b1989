"""Exact tests of the page pool: page ids, free order, reservations, stale handles."""

import random

import pytest

from ds4_app.engine.pages import (PAGE_TOKENS, PageHandle, PagePool, PoolExhausted, StaleHandle,
                                  pages_for)


def counts(pool: PagePool) -> tuple[int, int, int]:
    return pool.n_used, pool.n_reserved, pool.n_free


def test_pages_for_rounds_up_to_whole_pages():
    assert PAGE_TOKENS == 128
    assert [pages_for(n) for n in (0, 1, 127, 128, 129, 256, 257)] == [0, 1, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        pages_for(-1)


def test_append_hands_out_lowest_ids_in_order():
    pool = PagePool(8)
    a = pool.acquire(3)
    b = pool.acquire(2)
    assert counts(pool) == (0, 5, 3)
    assert pool.append(b, 1) == [0]  # ids are picked at append time, not at reservation
    assert pool.append(a, 2) == [1, 2]
    assert pool.append(b, 1) == [3]
    assert pool.pages(a) == (1, 2) and pool.pages(b) == (0, 3)
    assert (pool.reserved(a), pool.reserved(b)) == (1, 0)
    assert counts(pool) == (4, 1, 3)
    pool.check()


def test_release_returns_pages_and_lowest_first_reuse():
    pool = PagePool(6)
    a, b, c = pool.acquire(0), pool.acquire(0), pool.acquire(0)
    assert pool.append(a, 2) == [0, 1]
    assert pool.append(b, 2) == [2, 3]
    assert pool.append(c, 2) == [4, 5]
    pool.release(c)
    pool.release(a)
    assert counts(pool) == (2, 0, 4)
    d = pool.acquire(1)
    # Free pages are {0, 1, 4, 5}: the lowest come first, whatever order they were freed in.
    assert pool.append(d, 3) == [0, 1, 4]
    assert pool.append(d, 1) == [5]
    assert counts(pool) == (6, 0, 0)
    pool.check()


def test_release_returns_reservations_too():
    pool = PagePool(4)
    a = pool.acquire(3)
    pool.append(a, 1)
    assert counts(pool) == (1, 2, 1)
    pool.release(a)
    assert counts(pool) == (0, 0, 4)
    pool.check()


def test_reservation_limits_and_exhaustion_changes_nothing():
    pool = PagePool(4)
    a = pool.acquire(2)
    assert pool.can_reserve(2) and not pool.can_reserve(3)
    with pytest.raises(PoolExhausted):
        pool.acquire(3)
    assert pool.n_handles == 1
    b = pool.acquire(1)
    with pytest.raises(PoolExhausted):
        pool.reserve_more(a, 2)
    assert counts(pool) == (0, 3, 1)
    # Append beyond the reservation takes free pages; beyond those it fails atomically.
    assert pool.append(b, 2) == [0, 1]
    assert counts(pool) == (2, 2, 0)
    with pytest.raises(PoolExhausted):
        pool.append(b, 1)
    with pytest.raises(PoolExhausted):
        pool.append(a, 3)
    assert pool.pages(a) == () and pool.reserved(a) == 2
    assert pool.append(a, 2) == [2, 3]
    assert counts(pool) == (4, 0, 0)
    pool.check()


def test_unreserve_gives_pages_back():
    pool = PagePool(4)
    a = pool.acquire(3)
    assert pool.unreserve(a, 1) == 1
    assert counts(pool) == (0, 2, 2)
    with pytest.raises(ValueError):
        pool.unreserve(a, 3)
    assert pool.unreserve(a) == 2
    assert counts(pool) == (0, 0, 4)
    pool.check()


def test_stale_handle_is_refused_after_release_and_reuse():
    pool = PagePool(4)
    a = pool.acquire(1)
    pool.append(a, 1)
    pool.release(a)
    b = pool.acquire(1)
    assert b.id == a.id and b.generation == a.generation + 1
    for op in (lambda: pool.append(a, 1), lambda: pool.release(a), lambda: pool.pages(a),
               lambda: pool.reserve_more(a, 1), lambda: pool.reserved(a)):
        with pytest.raises(StaleHandle):
            op()
    with pytest.raises(StaleHandle):
        pool.append(PageHandle(7, 0), 1)  # never issued
    assert pool.append(b, 1) == [0]  # the stale handle touched nothing
    pool.check()


def test_handle_ids_are_reused_lowest_first():
    pool = PagePool(4)
    hs = [pool.acquire(0) for _ in range(3)]
    pool.release(hs[2])
    pool.release(hs[0])
    assert pool.acquire(0).id == 0
    assert pool.acquire(0).id == 2
    assert pool.acquire(0).id == 3


def test_invariant_holds_under_random_operations():
    rng = random.Random(1234)
    pool = PagePool(16)
    live: list[PageHandle] = []
    for _ in range(2000):
        op = rng.randrange(4)
        try:
            if op == 0:
                live.append(pool.acquire(rng.randrange(4)))
            elif op == 1 and live:
                pool.append(rng.choice(live), rng.randrange(1, 4))
            elif op == 2 and live:
                pool.reserve_more(rng.choice(live), rng.randrange(1, 3))
            elif op == 3 and live:
                pool.release(live.pop(rng.randrange(len(live))))
        except PoolExhausted:
            pass
        pool.check()
        assert pool.n_used + pool.n_reserved + pool.n_free == 16
        assert pool.n_used == sum(len(pool.pages(h)) for h in live)
        assert pool.n_reserved == sum(pool.reserved(h) for h in live)
