"""The native CPU engine against the numpy reference: teacher-forced at every step, and one free run.

Teacher forcing. The engine runs a sequence one token per step. Before step t its slot's state
(raw ring rows, the compressed and indexer rows its block table names, the fp32 compressor states)
is exported through ``_native._testing.export_slot_state`` and converted into a reference
``SeqState``; the reference then steps the same token from that state. Both therefore start every
step from identical state, so the comparison at step t measures step t alone:

* logits: max|engine − reference| / max|reference| ≤ 1e-4 at every step;
* the rows the step wrote: the raw ring row t mod 128 of each layer and, when the step closes a
  block, the new compressed and indexer rows. Stored rows are rounded (f16, and FP8 or
  Hadamard + FP4 under QAT), and the two sides' fp32 arithmetic differs in the last ulp (different
  summation orders), so an element may land one step of its storage grid apart; the test allows
  exactly that and no more, and nothing else in the ring may change;
* the compressor states (fp32, never rounded): within 1e-4 relative, with identical −inf masks.

To keep a rounding flip in the step's own rows from reaching its logits, the reference stores the
engine's rows once they have passed that check (``_ForcedReference``). What remains between the
two sides is fp32 noise (about 2e-6 relative) plus the decisions of this one step. One of those
is common enough to meet in a few thousand QAT steps: an indexer query value within float noise
of an FP4 rounding midpoint, whose flip changes the indexer's top-k (3 of 28 QAT sequences of 600
steps had one, seeds 20-47; 12 sequences without QAT, seeds 20-31, passed with none). Such a step must match
the reference under that value's other rounding, and a sequence may have at most two of them.

Why not free running: a one-ulp difference flips an f16/FP8/FP4 rounding or a router/indexer
top-k choice now and then, after which two correct implementations diverge; the reference does
the same against itself when its embedding is scaled by 1 + 3e-7 (300 steps: seed 11 with QAT
exceeds 1e-4 at 100 steps from step 44 on, seed 3 without QAT at 2). ``test_free_run_matches_on_a_known_seed``
keeps one free run as the record of that finding: a seed whose 300 steps have no decision within
float noise of its threshold, fed 16 rows a step (prompt packing through the same comparison).

Coverage: a 600-token sequence passes through every prefix length 1..600, the ring wrap (128),
page boundaries (127/128/129, 255/256/257, ...), CSA (ratio 4) and HCA (ratio 128) emissions,
the indexer choosing 8 of up to 150 visible rows, a hash-routed layer and biased routing, with
QAT off and on. The same logits then hold for any packing of the prompt and any neighbours in the
step, because those are bit-identical (tests/test_native_engine.py, batch invariance).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine.plan import StepPlan
from ds4_app.engine.reference import Reference, SeqState, fp4_roundtrip, fp8_e4m3_roundtrip, hadamard
from ds4_app.engine.synth import synthesize

native = pytest.importorskip("ds4_app.engine._native")

MAX_CTX = 640
PAGES_PER_SEQ = MAX_CTX // 128
SEQ_LEN = 600
NEG_INF = np.float32(-np.inf)
STATE_KEYS = ("kv_state", "score_state", "idx_kv_state", "idx_score_state")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("native_parity")


_models: dict[tuple[int, bool], ModelFile] = {}


def tiny_model(model_dir: Path, seed: int, qat: bool) -> ModelFile:
    if (seed, qat) not in _models:
        path = model_dir / f"tiny-{seed}-{int(qat)}.gguf"
        synthesize("tiny", path, seed=seed, qat_numerics=qat)
        _models[seed, qat] = ModelFile.open(path)
    return _models[seed, qat]


def make_engine(mf: ModelFile, *, max_slots: int = 2, n_pages: int = 12, max_rows: int = 16, n_threads: int = 1):
    tensors = [(t.name, t.ggml_type, t.ne, t.offset) for t in mf.tensors.values()]
    return native.Engine(mf.config, str(mf.path), tensors, max_slots=max_slots, max_ctx=MAX_CTX, n_pages=n_pages,
                         max_rows=max_rows, n_threads=n_threads)


def prompt(mf: ModelFile, seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, mf.config.n_vocab, n)


def rel_err(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per row: max |got − want| over the vocabulary, relative to max |want|."""
    return np.max(np.abs(got - want), axis=-1) / np.max(np.abs(want), axis=-1)


# --- the engine's state as a reference SeqState ------------------------------------------------

def export_state(eng, cfg, slot: int, pages: list[int], n_tokens: int) -> SeqState:
    """The slot's state after n_tokens tokens, as the reference holds it.

    The engine keeps a compressor's current-block rows after emitting (the next block overwrites
    them before they are read); the reference resets them to (0, −∞). Rows of the current block
    that no token has written yet are set to (0, −∞) here so the two compare equal.
    """
    d = native._testing.export_slot_state(eng, slot, pages, n_tokens)
    st = SeqState(n_tokens, d["ring"], d["comp"], d["idx_keys"], *(d[k] for k in STATE_KEYS))
    for il, m in enumerate(cfg.compress_ratios):
        if not m:
            continue
        first_unwritten = (m if m == 4 else 0) + n_tokens % m
        last = (m if m == 4 else 0) + m
        for kv, score in ((st.kv_state[il], st.score_state[il]), (st.idx_kv_state[il], st.idx_score_state[il])):
            if kv is not None:
                kv[first_unwritten:last] = 0.0
                score[first_unwritten:last] = NEG_INF
    return st


FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FLOAT_NOISE = 1e-5  # relative to a block's largest magnitude: far above fp32 noise, far below a grid step


def fp4_alternatives(h: np.ndarray) -> list[tuple[tuple, np.ndarray]]:
    """The other admissible FP4 round trips of h (blocks of 32 on the last axis): one per value
    that lies within FLOAT_NOISE of a rounding midpoint, and one per block whose scale sits that
    close to a power of two. Each is (index of the values, their other rounding)."""
    out: list[tuple[tuple, np.ndarray]] = []
    blocks = h.reshape(-1, 32).astype(np.float64)
    flat_q = fp4_roundtrip(h, 32).reshape(-1, 32)
    for b, (x, q) in enumerate(zip(blocks, flat_q)):
        amax = max(float(np.max(np.abs(x))), 6 * 2.0 ** -126)
        s = 2.0 ** np.ceil(np.log2(amax / 6.0))
        tol = FLOAT_NOISE * amax / s
        *lead, off = (int(k) for k in np.unravel_index(b * 32, h.shape))
        lead = tuple(lead)
        for i in np.nonzero(np.abs(np.abs(x / s)[:, None] - (FP4_GRID[1:] + FP4_GRID[:-1]) / 2).min(axis=1) <= tol)[0]:
            mag = abs(x[i] / s)
            lo = FP4_GRID[FP4_GRID <= mag].max()
            hi = FP4_GRID[FP4_GRID >= mag].min() if mag <= 6 else 6.0
            other = hi if abs(abs(q[i]) / s - lo) < 1e-12 else lo
            out.append((lead + (slice(off + i, off + i + 1),), np.array([np.copysign(other * s, x[i])], np.float32)))
        if abs(np.log2(amax / 6.0) - np.round(np.log2(amax / 6.0))) <= FLOAT_NOISE:
            # amax/6 on a power of two: the scale may be that power or the next one up
            scaled = (x * (1 + 2 * FLOAT_NOISE) if np.log2(amax / 6.0) <= np.round(np.log2(amax / 6.0))
                      else x * (1 - 2 * FLOAT_NOISE)).astype(np.float32)
            out.append((lead + (slice(off, off + 32),), fp4_roundtrip(scaled, 32)))
    return out


class _ForcedReference(Reference):
    """The reference, storing the engine's rows for this step once they were checked.

    ``computed`` collects the rows the reference itself produced, keyed (kind, layer) with kind
    "ring", "comp" or "idx_keys"; ``forced`` holds the engine's rows under the same keys. Under
    QAT it also lists in ``alternatives`` the indexer-query FP4 roundings that float noise could
    flip ((layer, index, values)), and applies the one in ``override``, if any.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forced: dict[tuple[str, int], np.ndarray] = {}
        self.computed: dict[tuple[str, int], np.ndarray] = {}
        self.alternatives: list[tuple[int, tuple, np.ndarray]] = []
        self.override: tuple[int, tuple, np.ndarray] | None = None
        self._layer_of = {id(lay): il for il, lay in enumerate(self._layers)}

    def _take(self, key: tuple[str, int], rows: np.ndarray) -> np.ndarray:
        assert rows.shape[0] == 1, "teacher forcing feeds one token per step"
        self.computed[key] = rows[0].copy()
        return self.forced[key][None] if key in self.forced else rows

    def _raw_kv(self, lay, x, pos):
        return self._take(("ring", self._layer_of[id(lay)]), super()._raw_kv(lay, x, pos))

    def _comp_rows(self, c, lay, kv, score, block_pos, indexer):
        rows = super()._comp_rows(c, lay, kv, score, block_pos, indexer)
        return self._take(("idx_keys" if indexer else "comp", self._layer_of[id(lay)]), rows)

    def _indexer_query(self, lay, q_lat, x, pos):
        if not self.qat:
            return super()._indexer_query(lay, q_lat, x, pos)
        # the reference's own query without the round trip, then the round trip as it does it
        self.qat = False
        try:
            q, w = super()._indexer_query(lay, q_lat, x, pos)
        finally:
            self.qat = True
        h = hadamard(q)
        out = fp4_roundtrip(h, 32)
        il = self._layer_of[id(lay)]
        self.alternatives.extend((il, idx, vals) for idx, vals in fp4_alternatives(h))
        if self.override is not None and self.override[0] == il:
            out[self.override[1]] = self.override[2]
        return out, w


def _f16_step(mag: np.ndarray) -> np.ndarray:
    """The spacing of f16 values at magnitude mag (2^-24 in the subnormal range)."""
    _, e = np.frexp(np.maximum(mag, 2.0 ** -24))
    return np.ldexp(1.0, np.maximum(e - 11, -24))


def check_row(kind: str, got: np.ndarray, want: np.ndarray, cfg, qat: bool, where: str) -> None:
    """The engine's stored row is the reference's, up to one step of the storage grid per element.

    Both sides carry fp32 noise of about 1e-7 of the row's scale, which stays absolute through
    the final RoPE rotation and RMSNorm: a value that ends up small (cancellation) can therefore
    sit several of its own f16 steps away while being 1e-7 of the row apart. So each value may
    differ by one f16 step at its magnitude plus 1e-5 of the row's largest magnitude.
    Under QAT a raw or compressed row's first head_dim − rope_dim values are FP8 (e4m3, 3 mantissa
    bits, per block of 64 scaled by s = 2^⌈log2(amax/448)⌉), so a flip moves a value by at most
    1/8 of its magnitude or by the grid's subnormal step s·2^-9; an indexer row is FP4 after a
    Hadamard transform (e2m1: steps of half the magnitude, or s/2 near zero). A flip is a rare
    event: a handful of values per row at most, or the rounding is systematically wrong.
    """
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    diff = np.abs(got.astype(np.float64) - want)
    mag = np.maximum(np.abs(got), np.abs(want)).astype(np.float64)
    noise = 1e-5 * float(np.max(np.abs(want)))
    near = diff <= _f16_step(mag) + noise
    if not qat:
        assert near.all(), f"{where}: {int((~near).sum())} values beyond one f16 step (max diff {diff.max():.3g})"
        return
    if kind == "idx_keys":
        amax = np.max(np.abs(want.reshape(-1, 32)), axis=-1)
        s = np.repeat(2.0 ** np.ceil(np.log2(np.maximum(amax, 6 * 2.0 ** -126) / 6.0)), 32)
        grid = 0.5 * mag + 0.5 * s
    else:
        nope = cfg.head_dim - cfg.rope_dim
        amax = np.max(np.abs(want[:nope].reshape(-1, 64)), axis=-1)
        s = np.repeat(2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-4) / 448.0)), 64)
        grid = np.concatenate([mag[:nope] / 8 + s * 2.0 ** -9, np.zeros(cfg.rope_dim)])  # the RoPE tail is f16 only
    assert (diff <= grid + _f16_step(mag) + noise).all(), f"{where}: a value moved by more than one grid step"
    assert (~near).sum() <= 4, f"{where}: {int((~near).sum())} values beyond one f16 step"


def teacher_forced(mf: ModelFile, tokens: np.ndarray, *, slot: int, pages: list[int]) -> np.ndarray:
    """Run tokens through the engine one per step; check each step against the reference started
    from the engine's own state. Returns the relative logit error of every step."""
    cfg = mf.config
    qat = cfg.qat_numerics
    eng = make_engine(mf)
    ref = _ForcedReference(cfg, mf.weights_f32())
    win = cfg.sliding_window
    errs = np.empty(len(tokens))
    flips: list[int] = []
    before = export_state(eng, cfg, slot, pages, 0)
    for t, tok in enumerate(tokens):
        got = eng.step(StepPlan.build([(slot, int(tok), t, True)], {slot: pages}, PAGES_PER_SEQ))[0]
        after = export_state(eng, cfg, slot, pages, t + 1)
        ref.forced.clear()
        ref.computed.clear()
        for il, m in enumerate(cfg.compress_ratios):
            ref.forced["ring", il] = after.ring[il][t % win]
            if m and (t + 1) % m == 0:
                ref.forced["comp", il] = after.comp[il][-1]
                if m == 4:
                    ref.forced["idx_keys", il] = after.idx_keys[il][-1]
        ref.alternatives.clear()
        ref.override = None
        state = before.clone()
        want = ref.step(state, int(tok))
        errs[t] = rel_err(got, want)
        if errs[t] > 1e-4:
            # an FP4 rounding of the indexer query within float noise of its midpoint can flip
            # and change the indexer's choice: the engine must then match the other rounding
            for alt in list(ref.alternatives):
                ref.override = alt
                state = before.clone()
                want = ref.step(state, int(tok))
                if rel_err(got, want) <= 1e-4:
                    errs[t] = rel_err(got, want)
                    flips.append(t)
                    break
        assert errs[t] <= 1e-4, f"step {t}: relative logit error {errs[t]:.2e}"
        assert set(ref.computed) == set(ref.forced), f"step {t}: rows written {sorted(ref.forced)}"
        for (kind, il), row in ref.computed.items():
            check_row(kind, ref.forced[kind, il], row, cfg, qat, f"step {t} layer {il} {kind}")
        for il in range(cfg.n_layer):
            # only this token's ring row may have changed; compressed rows before it are final
            others = np.arange(win) != t % win
            assert np.array_equal(after.ring[il][others], before.ring[il][others]), f"step {t} layer {il}: ring"
            assert np.array_equal(after.comp[il][:len(before.comp[il])], before.comp[il])
            assert np.array_equal(after.idx_keys[il][:len(before.idx_keys[il])], before.idx_keys[il])
            for key in STATE_KEYS:
                a, b = getattr(after, key)[il], getattr(state, key)[il]
                if b is None:
                    assert a is None
                    continue
                assert np.array_equal(np.isneginf(a), np.isneginf(b)), f"step {t} layer {il} {key}: -inf mask"
                live = np.isfinite(b)
                if live.any():
                    scale = max(float(np.max(np.abs(b[live]))), 1e-30)
                    assert np.max(np.abs(a[live] - b[live])) <= 1e-4 * scale, f"step {t} layer {il} {key}"
        before = after
    assert len(flips) <= 2, f"steps {flips} matched only under another FP4 rounding: too many to be noise"
    return errs


@pytest.mark.parametrize("seed, qat", [(3, False), (4, False), (5, False), (11, True), (12, True), (13, True)])
def test_teacher_forced_every_step(model_dir: Path, seed: int, qat: bool) -> None:
    mf = tiny_model(model_dir, seed, qat)
    cfg = mf.config
    # what one sequence covers: ring wrap, four page boundaries, both ratios, the indexer choosing
    # fewer rows than visible, hash and biased routing
    assert set(cfg.compress_ratios) == {0, 4, 128} and cfg.index_topk < SEQ_LEN // 4
    assert 0 < cfg.n_hash_layers < cfg.n_layer and cfg.qat_numerics == qat
    # slot 1 on scattered pages: reads go through the block table
    errs = teacher_forced(mf, prompt(mf, seed, SEQ_LEN), slot=1, pages=[7, 2, 9, 0, 4])
    assert errs.max() <= 1e-4


def test_export_refuses_unassigned_pages(model_dir: Path) -> None:
    mf = tiny_model(model_dir, 3, False)
    eng = make_engine(mf)
    tokens = prompt(mf, 3, 140)
    for t, tok in enumerate(tokens):
        eng.step(StepPlan.build([(0, int(tok), t, True)], {0: [3, 5]}, PAGES_PER_SEQ))
    st = export_state(eng, mf.config, 0, [3, 5], 140)
    assert [len(c) for c in st.comp] == [0, 35, 1, 35] and [len(k) for k in st.idx_keys] == [0, 35, 0, 35]
    with pytest.raises(ValueError, match="logical page 1"):
        native._testing.export_slot_state(eng, 0, [3], 140)
    with pytest.raises(ValueError, match="slot"):
        native._testing.export_slot_state(eng, 2, [3, 5], 140)


# --- free running -----------------------------------------------------------------------------

def test_free_run_matches_on_a_known_seed(model_dir: Path) -> None:
    """The record of the drift finding (module docstring): a free run agrees at 1e-4 only on a
    seed without near-ties; seed 3's 300 steps are such a run on both SIMD paths."""
    mf = tiny_model(model_dir, 3, False)
    tokens = prompt(mf, 3, 300)
    ref = Reference(mf.config, mf.weights_f32())
    state = ref.new_state()
    want = np.stack([ref.step(state, int(t)) for t in tokens])
    eng = make_engine(mf, n_threads=2)
    pages = [5, 0, 3]
    got = []
    for a in range(0, len(tokens), 16):
        lanes = [(1, int(tokens[k]), k, True) for k in range(a, min(a + 16, len(tokens)))]
        got.append(eng.step(StepPlan.build(lanes, {1: pages}, PAGES_PER_SEQ)))
    err = rel_err(np.concatenate(got), want)
    assert err.max() <= 1e-4, f"step {int(err.argmax())}: relative error {err.max():.2e}"


def test_qat_round_trips_change_the_logits(model_dir: Path) -> None:
    """QAT is really on in the engine: the same weights without it are far from the QAT reference."""
    mf = tiny_model(model_dir, 11, True)
    plain = tiny_model(model_dir, 11, False)
    tokens = prompt(mf, 11, 8)
    ref = Reference(mf.config, mf.weights_f32())
    state = ref.new_state()
    want = np.stack([ref.step(state, int(t)) for t in tokens])
    got = {}
    for name, m in (("qat", mf), ("plain", plain)):
        eng = make_engine(m)
        got[name] = np.concatenate([eng.step(StepPlan.build([(0, int(tok), t, True)], {0: [1]}, PAGES_PER_SEQ))
                                    for t, tok in enumerate(tokens)])
    assert rel_err(got["qat"], want).max() <= 1e-4
    assert rel_err(got["plain"], want).min() > 1e-2
    # and the FP8 rows really are on the e4m3 grid: a stored raw row is its own round trip
    eng = make_engine(mf)
    eng.step(StepPlan.build([(0, int(tokens[0]), 0, True)], {0: [1]}, PAGES_PER_SEQ))
    row = export_state(eng, mf.config, 0, [1], 1).ring[1][0]
    nope = mf.config.head_dim - mf.config.rope_dim
    assert np.array_equal(fp8_e4m3_roundtrip(row[:nope], 64), row[:nope])
