"""Test helpers shared by the CPU engine's tests (tests/test_native_engine.py) and the GPU
engine's (tests/gpu/test_gpu_engine.py): sequences fed step by step, their prompts, the weight
list an engine binds, and rows for the round-trip kernels. Both sides run the same cases, so a
difference between the engines is never a difference between two copies of a helper."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine.plan import StepPlan

MAX_CTX = 512
PAGES_PER_SEQ = MAX_CTX // 128


def tensor_entries(mf: ModelFile) -> list[tuple[str, int, tuple[int, ...], int]]:
    """The (name, ggml type, shape, file offset) list an engine binds its weights from."""
    return [(t.name, t.ggml_type, t.ne, t.offset) for t in mf.tensors.values()]


@dataclass(slots=True)
class Seq:
    """A sequence fed to an engine: its tokens, slot, pages, rows per step and start step."""

    tokens: np.ndarray
    slot: int
    pages: list[int]
    rows: int = 1
    start: int = 0


def run_fresh(eng, seqs: list[Seq]) -> list[np.ndarray]:
    """run() from empty slots: every sequence's slot reset first."""
    for s in seqs:
        eng.reset_slot(s.slot)
    return run(eng, seqs)


def run(eng, seqs: list[Seq]) -> list[np.ndarray]:
    """Feed every sequence (all lanes want logits) until done; logits [len, n_vocab] per sequence."""
    out = [np.empty((len(s.tokens), eng.n_vocab), np.float32) for s in seqs]
    pos = [0] * len(seqs)
    step = 0
    while any(p < len(s.tokens) for p, s in zip(pos, seqs)):
        lanes, owner = [], []
        for i, s in enumerate(seqs):
            if step < s.start:
                continue
            for k in range(pos[i], min(len(s.tokens), pos[i] + s.rows)):
                lanes.append((s.slot, int(s.tokens[k]), k, True))
                owner.append((i, k))
        step += 1
        if not lanes:
            continue
        tables = {s.slot: s.pages for i, s in enumerate(seqs) if any(o[0] == i for o in owner)}
        logits = eng.step(StepPlan.build(lanes, tables, PAGES_PER_SEQ))
        for row, (i, k) in enumerate(owner):
            out[i][k] = logits[row]
            pos[i] = k + 1
    return out


def prompt(mf: ModelFile, seed: int, n: int) -> np.ndarray:
    """n random token ids of mf's vocabulary, fixed by seed."""
    return np.random.default_rng(seed).integers(0, mf.config.n_vocab, n)


def round_trip_samples(block: int, seed: int | None) -> list[np.ndarray]:
    """Rows for the round trips: many scales, exact FP4 ties, f16 halfway values, lone outliers.

    seed None draws fresh values each call (the GPU tests); an int repeats them (the CPU tests).
    Every array's length is a multiple of block."""
    rng = np.random.default_rng(seed)
    out = [(rng.standard_normal(block * 64) * s).astype(np.float32) for s in (1e-30, 1e-6, 1e-2, 1.0, 300.0, 1e5)]
    # exact ties of the FP4 grid and halfway f16 values, zeros, a lone outlier per block
    ties = np.tile(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0, 0.0, -0.0], np.float32), block)
    out.append(ties[: (ties.size // block) * block])
    spiky = np.zeros(block * 4, np.float32)
    spiky[::block] = 1000.0
    spiky[1::block] = 1e-3
    out.append(spiky)
    halfway = (np.arange(1, block * 4 + 1, dtype=np.float32) + 0.5) * np.float32(2.0 ** -10)
    out.append(halfway.astype(np.float32))
    return out
