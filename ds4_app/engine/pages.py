"""The page pool: physical pages of compressed history, handed out lowest id first.

A page holds the compressed rows of 128 logical tokens (design §5). A sequence owns its pages
through a ``PageHandle``. Each handle has two kinds of holding:

- *appended* pages: real page ids, visible in the sequence's block table, in logical order;
- *reserved* pages: a count of pages promised to the handle but not yet given an id. Ids are
  picked only at append time, so the lowest free ids are always the ones handed out.

Accounting: every page is exactly one of used (appended to some handle), reserved (promised to
some handle) or free (neither), so ``n_used + n_reserved + n_free == n_pages`` always holds.

Handles carry a generation. Releasing a handle bumps its generation, so a copy of the old handle
kept by mistake is refused (``StaleHandle``) instead of silently touching the next owner's pages.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

PAGE_TOKENS = 128


def pages_for(n_tokens: int) -> int:
    """Pages needed to hold the state of ``n_tokens`` logical tokens (ceil(n / 128))."""
    if n_tokens < 0:
        raise ValueError(f"token count must be >= 0, got {n_tokens}")
    return -(-n_tokens // PAGE_TOKENS)


class PagePoolError(RuntimeError):
    """Base class of page pool errors."""


class PoolExhausted(PagePoolError):
    """Not enough unpromised pages for the request; nothing was changed."""


class StaleHandle(PagePoolError):
    """The handle was released (or never issued); its generation no longer matches."""


@dataclass(frozen=True, slots=True)
class PageHandle:
    """A sequence's claim on the pool. ``id`` is reused after release; ``generation`` is not."""

    id: int
    generation: int


@dataclass(slots=True)
class _Holding:
    generation: int
    appended: list[int] = field(default_factory=list)
    reserved: int = 0


class PagePool:
    """Fixed pool of ``n_pages`` pages with per-handle reservations (upstream ``PagedKvPool``)."""

    def __init__(self, n_pages: int) -> None:
        if n_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {n_pages}")
        self.n_pages = n_pages
        # Ids not appended to anyone. Reserved pages stay in here too: a reservation is a count.
        self._unassigned: list[int] = list(range(n_pages))
        self._n_reserved = 0
        self._live: dict[int, _Holding] = {}
        self._free_ids: list[int] = []  # released handle ids, reused lowest first
        self._next_id = 0
        self._generations: dict[int, int] = {}

    # ---- counters -------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        """Pages neither appended nor reserved: what a new reservation can still claim."""
        return len(self._unassigned) - self._n_reserved

    @property
    def n_used(self) -> int:
        """Pages appended to some handle (visible in a block table)."""
        return self.n_pages - len(self._unassigned)

    @property
    def n_reserved(self) -> int:
        """Pages promised to handles but not yet appended."""
        return self._n_reserved

    @property
    def n_handles(self) -> int:
        """Live (unreleased) handles."""
        return len(self._live)

    def can_reserve(self, n: int) -> bool:
        """Whether ``n`` more pages can be promised right now."""
        return 0 <= n <= self.n_free

    # ---- per-handle views -----------------------------------------------------------------
    def pages(self, handle: PageHandle) -> tuple[int, ...]:
        """The handle's appended page ids in logical order."""
        return tuple(self._holding(handle).appended)

    def reserved(self, handle: PageHandle) -> int:
        """Pages promised to the handle and not yet appended."""
        return self._holding(handle).reserved

    def held(self, handle: PageHandle) -> int:
        """Appended plus reserved pages of the handle."""
        h = self._holding(handle)
        return len(h.appended) + h.reserved

    # ---- operations -----------------------------------------------------------------------
    def acquire(self, n_reserved_pages: int = 0) -> PageHandle:
        """Open a handle with ``n_reserved_pages`` promised to it, or raise ``PoolExhausted``."""
        self._check_count(n_reserved_pages)
        if n_reserved_pages > self.n_free:
            raise PoolExhausted(f"cannot reserve {n_reserved_pages} pages: {self.n_free} free")
        if self._free_ids:
            hid = heapq.heappop(self._free_ids)
        else:
            hid, self._next_id = self._next_id, self._next_id + 1
        gen = self._generations.get(hid, 0)
        self._live[hid] = _Holding(generation=gen, reserved=n_reserved_pages)
        self._n_reserved += n_reserved_pages
        return PageHandle(hid, gen)

    def reserve_more(self, handle: PageHandle, n: int) -> None:
        """Promise ``n`` more pages to the handle, or raise ``PoolExhausted`` and change nothing."""
        self._check_count(n)
        h = self._holding(handle)
        if n > self.n_free:
            raise PoolExhausted(f"cannot reserve {n} more pages: {self.n_free} free")
        h.reserved += n
        self._n_reserved += n

    def unreserve(self, handle: PageHandle, n: int | None = None) -> int:
        """Give back ``n`` of the handle's promised pages (all if None); returns how many."""
        h = self._holding(handle)
        n = h.reserved if n is None else n
        self._check_count(n)
        if n > h.reserved:
            raise ValueError(f"handle holds {h.reserved} reserved pages, cannot give back {n}")
        h.reserved -= n
        self._n_reserved -= n
        return n

    def append(self, handle: PageHandle, n: int) -> list[int]:
        """Turn ``n`` pages into real ids appended to the handle, lowest free ids first.

        The handle's reservation is used first; any shortfall comes from free pages. If even the
        free pages do not cover it, ``PoolExhausted`` is raised and nothing changes.
        """
        self._check_count(n)
        h = self._holding(handle)
        from_reserve = min(n, h.reserved)
        extra = n - from_reserve
        if extra > self.n_free:
            raise PoolExhausted(f"cannot append {n} pages: {h.reserved} reserved, {self.n_free} free")
        ids = [heapq.heappop(self._unassigned) for _ in range(n)]
        h.reserved -= from_reserve
        self._n_reserved -= from_reserve
        h.appended.extend(ids)
        return ids

    def release(self, handle: PageHandle) -> None:
        """Return every appended and reserved page of the handle and retire the handle."""
        h = self._holding(handle)
        for pid in h.appended:
            heapq.heappush(self._unassigned, pid)
        self._n_reserved -= h.reserved
        del self._live[handle.id]
        self._generations[handle.id] = h.generation + 1
        heapq.heappush(self._free_ids, handle.id)

    def check(self) -> None:
        """Assert the pool's invariants (debug aid for tests and the engine's debug mode)."""
        appended = [p for h in self._live.values() for p in h.appended]
        assert len(appended) == len(set(appended)), "a page is appended to two handles"
        assert not set(appended) & set(self._unassigned), "an appended page is also unassigned"
        assert sorted(appended + self._unassigned) == list(range(self.n_pages)), "a page leaked"
        assert self._n_reserved == sum(h.reserved for h in self._live.values()), "reserve count"
        assert min((h.reserved for h in self._live.values()), default=0) >= 0, "negative reserve"
        assert self.n_free >= 0, "more pages promised than exist"
        assert self.n_used + self.n_reserved + self.n_free == self.n_pages

    # ---- internals ------------------------------------------------------------------------
    def _holding(self, handle: PageHandle) -> _Holding:
        h = self._live.get(handle.id)
        if h is None or h.generation != handle.generation:
            raise StaleHandle(f"page handle {handle.id} (generation {handle.generation}) is not live")
        return h

    @staticmethod
    def _check_count(n: int) -> None:
        if n < 0:
            raise ValueError(f"page count must be >= 0, got {n}")
