"""The engine's L2 prefetch (ext/gpu/l2_prefetch.cu, README "Pass 9"): a speed switch that must not
change a bit, and the ranges it asks for.

Marked ``gpu`` (conftest skips them without a CUDA/HIP build and a device). The engine interface:

- ``GpuEngine.use_l2_prefetch``: the switch (default off; on only where the device can prefetch, i.e. CUDA
  compute capability 9.0+; ``DS4_GPU_L2_PREFETCH=0/1`` at construction); setting it on where the
  device cannot leaves it off;
- ``GpuEngine.l2_prefetch_window_bytes``: the most one window asks for (half the L2, or
  ``DS4_GPU_L2_PREFETCH_BYTES``);
- ``GpuEngine.l2_prefetch_log()``: (window, layer, file offset, bytes) of every range the last
  launched step asked for.

The logits tests compare the switch on and off bit for bit, eagerly and under graphs (where the switch
must capture new graphs: it is part of the graph key), at one and three lanes, with the default cap
and with a cap that cuts ranges at offsets that are not multiples of 16 (the launcher trims them).
The log tests check each window against the file's tensor table: which tensors, in which order, each
from its first byte, never past its end, at most the cap in all.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_cases import PAGES_PER_SEQ, Seq, prompt, run_fresh
from tests.gpu.test_gpu_fused import bits, gpu_engine, tiny_model_file  # noqa: F401 (fixture)

native = pytest.importorskip("ds4_app.engine._native")
pytestmark = pytest.mark.gpu

SMALL_CAP = 40_008  # cuts the tiny model's windows mid-tensor, at offsets that are not multiples of 16

# The tensors each window names, in order (absent ones, e.g. a sliding layer's compressor, skipped).
ATTN_PROLOGUE = ("hc_attn_fn", "attn_q_a", "attn_kv", "attn_compressor_kv", "attn_compressor_gate", "indexer.proj",
                 "indexer_compressor_kv", "indexer_compressor_gate", "attn_q_b", "indexer.attn_q_b")
ATTN = ("attn_output_a", "attn_output_b")
FFN_PROLOGUE = ("hc_ffn_fn", "ffn_gate_inp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
HEAD = ("output_hc_fn.weight", "output.weight")


def supported(mf) -> bool:
    """Whether this device can prefetch (the switch stays off where it cannot)."""
    eng = gpu_engine(mf)
    eng.use_l2_prefetch = True
    return eng.use_l2_prefetch


@pytest.fixture
def no_prefetch_env(monkeypatch):
    monkeypatch.delenv("DS4_GPU_L2_PREFETCH", raising=False)
    monkeypatch.delenv("DS4_GPU_L2_PREFETCH_BYTES", raising=False)
    return monkeypatch


# --- the switch -----------------------------------------------------------------------------------

def test_switch_default_environment_and_setter(tiny_model_file, no_prefetch_env) -> None:  # noqa: F811
    """Default off (measured slower on the H200); DS4_GPU_L2_PREFETCH=0/1 at construction; the setter
    turns it on (only where supported) and off again; the window cap is half the L2 unless
    DS4_GPU_L2_PREFETCH_BYTES names one, and a malformed value is refused."""
    mf = tiny_model_file
    can = supported(mf)
    eng = gpu_engine(mf)
    assert eng.use_l2_prefetch is False
    eng.use_l2_prefetch = True
    assert eng.use_l2_prefetch == can
    eng.use_l2_prefetch = False
    assert eng.use_l2_prefetch is False
    eng.use_l2_prefetch = True
    assert eng.use_l2_prefetch == can
    if can:
        assert eng.l2_prefetch_window_bytes > 0
    no_prefetch_env.setenv("DS4_GPU_L2_PREFETCH", "0")
    assert gpu_engine(mf).use_l2_prefetch is False
    no_prefetch_env.setenv("DS4_GPU_L2_PREFETCH", "1")
    assert gpu_engine(mf).use_l2_prefetch == can
    no_prefetch_env.setenv("DS4_GPU_L2_PREFETCH_BYTES", str(SMALL_CAP))
    assert gpu_engine(mf).l2_prefetch_window_bytes == SMALL_CAP
    no_prefetch_env.setenv("DS4_GPU_L2_PREFETCH_BYTES", "25MB")
    with pytest.raises(ValueError, match="DS4_GPU_L2_PREFETCH_BYTES"):
        gpu_engine(mf)


# --- bits -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cap", [None, SMALL_CAP], ids=["half-l2", "small-cap"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_logits_are_the_same_with_prefetch_on_and_off(tiny_model_file, no_prefetch_env, graphs: bool,  # noqa: F811
                                                      cap: int | None) -> None:
    """20 decode steps at one lane and 20 at three lanes (three slots, one starting a step late): the
    logits with the prefetch on equal those with it off, bit for bit; under graphs turning the switch
    captures new graphs."""
    mf = tiny_model_file
    if not supported(mf):
        pytest.skip("this device cannot prefetch into L2 (the switch stays off)")
    if cap is not None:
        no_prefetch_env.setenv("DS4_GPU_L2_PREFETCH_BYTES", str(cap))
    cases = [
        [Seq(prompt(mf, 91, 20), slot=0, pages=[0])],
        [Seq(prompt(mf, 92, 20), slot=1, pages=[1]),
         Seq(prompt(mf, 93, 20), slot=3, pages=[2]),
         Seq(prompt(mf, 94, 21), slot=5, pages=[3], start=1)],
    ]
    eng = gpu_engine(mf)
    eng.use_graphs = graphs
    passes = []
    captured = eng.graphs_captured
    for i, on in enumerate((False, True, False)):
        eng.use_l2_prefetch = on
        assert eng.use_l2_prefetch is on
        res = []
        for seqs in cases:
            res.append(run_fresh(eng, seqs))
        if graphs and i < 2:
            assert eng.graphs_captured > captured, "the prefetch switch must capture new graphs"
        elif graphs:  # the second "off" pass replays the graphs the first one captured
            assert eng.graphs_captured == captured
        else:
            assert (len(eng.l2_prefetch_log()) > 0) == on
        captured = eng.graphs_captured
        passes.append(res)
    for p, res in enumerate(passes[1:], start=1):
        for case, (want, got) in enumerate(zip(passes[0], res)):
            for k, (a, b) in enumerate(zip(want, got)):
                assert np.isfinite(a).all()
                assert np.array_equal(bits(a), bits(b)), f"pass {p}, case {case}, sequence {k}"


# --- what a step asks for -------------------------------------------------------------------------

def expected_windows(mf, cap: int, with_head: bool) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(window, layer, [(offset, bytes), ...]) in launch order, from the file's tensor table: each
    window's tensors in order from their first byte until cap bytes, the last one cut short."""
    n_layer = mf.config.n_layer
    tensors = mf.tensors

    def window(kind: int, layer: int, names: list[str]):
        left, ranges = cap, []
        for name in names:
            t = tensors.get(name)
            if t is None or left == 0:
                continue
            b = min(t.nbytes, left)
            ranges.append((t.offset, b))
            left -= b
        return (kind, layer, ranges)

    def blk(layer: int, short: tuple[str, ...]) -> list[str]:
        return [f"blk.{layer}.{s}.weight" for s in short]

    out = [window(0, 0, blk(0, ATTN_PROLOGUE))]
    for layer in range(n_layer):
        out.append(window(1, layer, blk(layer, ATTN)))
        out.append(window(2, layer, blk(layer, FFN_PROLOGUE)))
        if layer + 1 < n_layer:
            out.append(window(0, layer + 1, blk(layer + 1, ATTN_PROLOGUE)))
        elif with_head:
            out.append(window(3, n_layer, list(HEAD)))
    return out


def grouped(log) -> list[tuple[int, int, list[tuple[int, int]]]]:
    out: list[tuple[int, int, list[tuple[int, int]]]] = []
    for kind, layer, off, nbytes in log:
        if not out or out[-1][:2] != (kind, layer):
            out.append((kind, layer, []))
        out[-1][2].append((off, nbytes))
    return out


@pytest.mark.parametrize("cap", [None, SMALL_CAP], ids=["half-l2", "small-cap"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_windows_name_the_next_weights_within_the_cap(tiny_model_file, no_prefetch_env, graphs: bool,  # noqa: F811
                                                      cap: int | None) -> None:
    """A step's log, eager and at a graph capture: the windows in launch order (each layer's
    attention prologue, attention, FFN prologue; the head when a lane wants logits), each naming its
    tensors in order from their first byte, never past a tensor's end, at most the cap in all; the
    small cap cuts windows short. A step without logit lanes asks for no head window; the switch off
    asks for nothing."""
    from ds4_app.engine.plan import StepPlan

    mf = tiny_model_file
    if not supported(mf):
        pytest.skip("this device cannot prefetch into L2 (the switch stays off)")
    if cap is not None:
        no_prefetch_env.setenv("DS4_GPU_L2_PREFETCH_BYTES", str(cap))
    eng = gpu_engine(mf)
    eng.use_graphs = graphs
    eng.use_l2_prefetch = True
    window_cap = eng.l2_prefetch_window_bytes
    assert cap is None or window_cap == cap
    spans = {t.offset: (name, t.nbytes) for name, t in mf.tensors.items()}
    tokens = prompt(mf, 95, 2)
    for pos, want_logits in enumerate((True, False)):  # under graphs: two buckets, each captured now
        captured = eng.graphs_captured
        eng.step(StepPlan.build([(0, int(tokens[pos]), pos, want_logits)], {0: [0]}, PAGES_PER_SEQ))
        assert eng.graphs_captured == captured + graphs
        got = grouped(eng.l2_prefetch_log())
        want = expected_windows(mf, window_cap, with_head=want_logits)
        assert got == want
        for _kind, _layer, ranges in got:
            assert 0 < sum(b for _, b in ranges) <= window_cap
            for off, nbytes in ranges:
                assert off in spans and 0 < nbytes <= spans[off][1], spans.get(off)
        if cap is not None:
            assert any(b < spans[off][1] for _, _, ranges in got for off, b in ranges), "the cap must cut"
    eng.use_l2_prefetch = False
    eng.step(StepPlan.build([(0, int(tokens[0]), 0, True)], {0: [0]}, PAGES_PER_SEQ))
    assert eng.l2_prefetch_log() == []
