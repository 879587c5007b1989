"""The StepPlan: the one object the scheduler hands to a runner each engine step.

A plan is flat and frozen: numpy int32 arrays, no references back into scheduler state
(compare vLLM's ``SchedulerOutput``). Lanes are in chronological order within each slot: a
prompt row reads the rows before it in the same step, so one slot may own several lanes, and
their positions must be consecutive and increasing.

Layout (n = number of lanes, k = number of distinct slots in the step):
- ``lane_slot[n]``: the slot each lane belongs to.
- ``lane_token[n]``: the token id fed at that lane.
- ``lane_pos[n]``: the absolute position of that token in its sequence.
- ``lane_logits[n]``: 1 where the caller wants this lane's logits (a decoder, or the last row of
  a prompt), else 0. Logits come back in lane order for the lanes marked 1.
- ``table_slot[k]`` and ``block_table[k, max_blocks]``: for each slot in the step, its block
  table row (physical page per logical 128-token page, -1 where unassigned).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One engine step: which tokens run at which positions of which slots."""

    lane_slot: np.ndarray
    lane_token: np.ndarray
    lane_pos: np.ndarray
    lane_logits: np.ndarray
    table_slot: np.ndarray
    block_table: np.ndarray

    def __post_init__(self) -> None:
        n = self.lane_slot.shape[0]
        for name in ("lane_slot", "lane_token", "lane_pos", "lane_logits"):
            arr = getattr(self, name)
            if arr.dtype != np.int32 or arr.shape != (n,):
                raise ValueError(f"StepPlan.{name} must be int32 of shape ({n},)")
        k = self.table_slot.shape[0]
        if self.table_slot.dtype != np.int32 or self.block_table.dtype != np.int32:
            raise ValueError("StepPlan tables must be int32")
        if self.block_table.ndim != 2 or self.block_table.shape[0] != k:
            raise ValueError("StepPlan.block_table must have one row per table_slot")
        if not set(self.lane_slot.tolist()) <= set(self.table_slot.tolist()):
            raise ValueError("every lane's slot needs a block-table row")

    @property
    def n_lanes(self) -> int:
        return int(self.lane_slot.shape[0])

    @property
    def n_logits(self) -> int:
        return int(self.lane_logits.sum())

    @staticmethod
    def build(lanes: list[tuple[int, int, int, bool]], tables: dict[int, list[int]] | dict[int, np.ndarray],
              max_blocks: int) -> "StepPlan":
        """Build a plan from ``(slot, token, pos, want_logits)`` lanes and per-slot block tables."""
        arr = np.asarray([(s, t, p, int(w)) for s, t, p, w in lanes], dtype=np.int32).reshape(-1, 4)
        slots = sorted(tables)
        bt = np.full((len(slots), max_blocks), -1, dtype=np.int32)
        for i, s in enumerate(slots):
            row = np.asarray(tables[s], dtype=np.int32)[:max_blocks]
            bt[i, : row.shape[0]] = row
        return StepPlan(
            lane_slot=np.ascontiguousarray(arr[:, 0]),
            lane_token=np.ascontiguousarray(arr[:, 1]),
            lane_pos=np.ascontiguousarray(arr[:, 2]),
            lane_logits=np.ascontiguousarray(arr[:, 3]),
            table_slot=np.asarray(slots, dtype=np.int32),
            block_table=bt,
        )


@dataclass(frozen=True, slots=True)
class StepLimits:
    """How much one step may carry; these belong to the backend and are configurable.

    Defaults are upstream's: up to 6 sequences and 16 rows a step, each decoder one row, each
    concurrent prompt up to 4 rows, a lone prompt with no decoder up to all 16 rows. A runner
    takes its backend's policy from ``runner.default_limits`` (a GPU takes far more rows).
    """

    max_seqs: int = 6
    max_rows: int = 16
    rows_per_prompt: int = 4
    lone_prompt_rows: int = 16

    def __post_init__(self) -> None:
        if not (1 <= self.rows_per_prompt <= self.lone_prompt_rows <= self.max_rows):
            raise ValueError("StepLimits needs 1 <= rows_per_prompt <= lone_prompt_rows <= max_rows")
        if not 1 <= self.max_seqs <= self.max_rows:
            raise ValueError("StepLimits needs 1 <= max_seqs <= max_rows")
