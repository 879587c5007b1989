"""The scheduler: which rows of which slots run in the next engine step.

One rule drives everything: computed tokens catch up to total tokens. A running slot with one
pending token is a decoder and gets one row; a slot with more pending tokens is a prompt catching
up and gets prompt rows. There is no separate prefill or decode path, so prompt rows pack beside
decoders with no special case (vLLM v1).

Per step (limits from ``StepLimits``, upstream's defaults 6 sequences / 16 rows / 4 rows per
concurrent prompt / 16 rows for a lone prompt):

1. every decoder gets one row (if there are more decoders than ``max_seqs``, a rotating window of
   them), after making sure each has pages for it; under page pressure the least recently used
   parked session is evicted, then the newest running request is preempted;
2. the oldest prompts fill the remaining sequences; their row budget is handed out in rounds of
   ``rows_per_prompt`` from a start that rotates every step, so the oldest prompt does not always
   win the last partial round (upstream ``plan_prefill_slices``);
3. the rows become a ``StepPlan``: decoders first, each slot's rows in position order, logits
   only for decoders and for the row that completes a prompt.

``commit`` then advances ``n_computed`` by the rows each slot ran and appends sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4_app.engine.plan import StepLimits, StepPlan
from ds4_app.engine.slots import Preempted, Slot, SlotManager, SlotState

# What commit needs of one slot that ran: (slot, order, base, rows, logits). ``order`` identifies
# the request (a slot index is reused, an admission tick is not); ``base`` is n_computed when the
# step was planned. A plain tuple: one is built per slot per step, and a frozen dataclass costs
# several times as much to build.
_Ran = tuple[int, int, int, int, bool]


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """One planned step: the ``StepPlan`` for the runner plus what ``commit`` needs back.

    ``rows`` maps slot -> rows it runs; ``logit_slots`` lists the slots whose logits the runner
    returns, in lane order; ``n_decode_rows`` counts the lanes that are decoders (the rest are
    prompt rows); ``evicted`` (session ids) and ``preempted`` (requests to resubmit) report what
    making room for this step cost.
    """

    plan: StepPlan
    rows: dict[int, int]
    logit_slots: tuple[int, ...]
    n_decode_rows: int
    evicted: tuple[str | None, ...]
    preempted: tuple[Preempted, ...]
    _ran: tuple[_Ran, ...]

    @property
    def is_empty(self) -> bool:
        """Nothing to run (no running slot had pending tokens)."""
        return self.plan.n_lanes == 0


def split_budget(wants: list[int], budget: int, quantum: int, start: int) -> list[int]:
    """Hand ``budget`` rows to candidates in rounds of ``quantum``, beginning at ``start``.

    ``wants[i]`` caps candidate i. Each round visits every candidate once, in order from the
    rotating start, so the last partial quantum falls on a different candidate each step.
    """
    n = len(wants)
    grants = [0] * n
    while budget > 0:
        moved = False
        for j in range(n):
            i = (start + j) % n
            g = min(quantum, wants[i] - grants[i], budget)
            if g > 0:
                grants[i] += g
                budget -= g
                moved = True
        if not moved:
            break
    return grants


class Scheduler:
    """Builds each step's plan from the slot manager's running slots."""

    def __init__(self, slot_manager: SlotManager, limits: StepLimits) -> None:
        self.slots = slot_manager
        self.limits = limits
        self._prompt_rr = 0  # rotating start of the prompt row rounds
        self._decode_rr = 0  # rotating window when decoders outnumber max_seqs

    def _runnable(self) -> list[Slot]:
        return [s for s in self.slots.running() if not s.length_done]

    def _secure_decoders(self, evicted: list[str | None],
                         preempted: list[Preempted]) -> tuple[list[Slot], list[Slot]]:
        """All decoders, each with pages for its pending token, and the runnable slots they were
        drawn from (oldest first); makes room when needed."""
        while True:
            runnable = self._runnable()
            decoders = [s for s in runnable if s.n_pending == 1]
            if self.slots.ensure_headroom(decoders):
                return decoders, runnable
            if self.slots.idle():
                evicted.append(self.slots.evict_lru())
            else:
                victim = self.slots.preempt_newest()
                assert victim is not None  # a decoder that lacks pages is itself running
                preempted.append(victim)

    def schedule(self) -> ScheduledStep:
        """Plan the next step (grows block tables for the rows it grants)."""
        lim = self.limits
        evicted: list[str | None] = []
        preempted: list[Preempted] = []
        decoders, runnable = self._secure_decoders(evicted, preempted)
        # ensure_headroom only reserves pages, so the runnable set is still the one it checked.
        prompts = [s for s in runnable if s.n_pending > 1]
        if len(decoders) > lim.max_seqs:
            start = self._decode_rr % len(decoders)
            self._decode_rr += lim.max_seqs
            picked = {s.index for s in (decoders[start:] + decoders[:start])[: lim.max_seqs]}
            decoders = [s for s in decoders if s.index in picked]

        cohort = prompts[: lim.max_seqs - len(decoders)]
        lone = not decoders and len(prompts) == 1
        per_seq = lim.lone_prompt_rows if lone else lim.rows_per_prompt
        grants: list[int] = []
        if cohort:
            wants = [min(per_seq, s.n_pending) for s in cohort]
            budget = min(lim.max_rows - len(decoders), len(cohort) * per_seq)
            grants = split_budget(wants, budget, lim.rows_per_prompt,
                                  self._prompt_rr % len(cohort))
            self._prompt_rr += 1

        # The plan's four lane columns, built as lists and turned into one int32 array at the end.
        l_slot: list[int] = []
        l_token: list[int] = []
        l_pos: list[int] = []
        l_logits: list[int] = []
        ran: list[_Ran] = []
        grow = self.slots.grow
        for s in decoders:
            # A decoder's one pending token is its last: it always wants logits.
            base = s.n_computed
            grow(s.index, base + 1)
            l_slot.append(s.index)
            l_token.append(s.tokens[base])
            l_pos.append(base)
            l_logits.append(1)
            ran.append((s.index, s.order, base, 1, True))
        for s, rows in zip(cohort, grants):
            if rows == 0:
                continue
            base = s.n_computed
            end = base + rows
            grow(s.index, end)
            # Only the row at the last known token has logits worth computing: it is the first
            # generated token when it completes the prompt.
            logits = end == len(s.tokens)
            l_slot.extend([s.index] * rows)
            l_token.extend(s.tokens[base:end])
            l_pos.extend(range(base, end))
            l_logits.extend([0] * (rows - 1))
            l_logits.append(int(logits))
            ran.append((s.index, s.order, base, rows, logits))

        lanes = np.array([l_slot, l_token, l_pos, l_logits], dtype=np.int32)  # rows are contiguous
        table_slot = np.array(sorted(r[0] for r in ran), dtype=np.int32)
        plan = StepPlan(lane_slot=lanes[0], lane_token=lanes[1], lane_pos=lanes[2], lane_logits=lanes[3],
                        table_slot=table_slot, block_table=self.slots.block_tables(table_slot))
        return ScheduledStep(plan=plan, rows={r[0]: r[3] for r in ran},
                             logit_slots=tuple(r[0] for r in ran if r[4]), n_decode_rows=len(decoders),
                             evicted=tuple(evicted), preempted=tuple(preempted), _ran=tuple(ran))

    def commit(self, step: ScheduledStep, sampled: dict[int, int]) -> list[int]:
        """Record a finished step: advance ``n_computed`` and append the sampled tokens.

        ``sampled`` maps each slot in ``step.logit_slots`` to the token picked from its logits.
        Slots retired (or reused) since the step was planned are skipped. Returns the slots whose
        request reached its length limit with this step, for the caller to retire or park.
        """
        if len(sampled) != len(step.logit_slots) or not all(s in sampled for s in step.logit_slots):
            raise ValueError(f"sampled tokens for slots {sorted(sampled)}, "
                             f"expected {sorted(step.logit_slots)}")
        done: list[int] = []
        get = self.slots.get
        for slot, order, base, rows, logits in step._ran:
            s = get(slot)
            if s is None or s.order != order or s.state is not SlotState.RUNNING:
                continue
            if s.n_computed != base:
                raise RuntimeError(f"slot {slot} moved since its step was planned")
            s.n_computed += rows
            if logits:
                s.tokens.append(int(sampled[slot]))
                if s.length_done:
                    done.append(slot)
        return done
