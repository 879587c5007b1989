"""Producer-built planes (ext/gpu/matvec_fused.h planes_fused): the engine's mHC pre, q_lat's
RMSNorm, the shared expert's SwiGLU and hc_head write the integer products' planes of their output
beside it, and the products of that output read them instead of launching the prep kernel.

Marked ``gpu``. Hooks (``_testing``): ``gpu_set_planes_fused(on) -> bool`` (process-wide) and
``gpu_planes_prep_launches()`` (the prep kernel's launches so far). The producers build each unit's
record with the prep kernel's own code (xplanes.cuh unit_planes_part), so the logits must be the
same bits with the switch on and off, eager and under graphs, for decode steps and packed prompts;
and the switch must save the prep launches it claims to.
"""

from __future__ import annotations

import numpy as np
import pytest

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing
pytestmark = pytest.mark.gpu


@pytest.fixture
def planes_switch():
    """Set the switch inside a test; back on (the default) after it."""
    yield T.gpu_set_planes_fused
    T.gpu_set_planes_fused(True)


def test_switch_reads_back(planes_switch) -> None:
    assert planes_switch(False) is False
    assert planes_switch(True) is True


def test_engine_logits_equal_with_producer_planes(planes_switch, tmp_path) -> None:
    """The tiny preset (Q8_0 attention, shared expert and LM head; Q4_K routed gate/up): two prompts
    packed 7 and 5 rows a step, and two sequences one row a step (decode), the same logits with the
    producers' planes and with the prep kernel's, eager and under graphs (the switch is part of the
    graph key). Eager, each step with the switch on launches at least 5 preps a layer and one for the
    head fewer: u's products in both sites (three preps), q_lat's and the shared SwiGLU's output's,
    and head_in's."""
    from ds4_app.engine.presets import tiny
    from ds4_app.engine.synth import synthesize
    from ds4_app.engine.gguf_file import ModelFile
    from tests.engine_cases import Seq, prompt, run
    from tests.gpu.test_gpu_engine import gpu_engine

    path = tmp_path / "tiny.gguf"
    synthesize(tiny(), path, seed=5)
    mf = ModelFile.open(path)
    gpu = gpu_engine(mf, max_slots=2, max_rows=16)
    cases = {"packed": [Seq(prompt(mf, 3, 30), slot=0, pages=[1, 2], rows=7),
                        Seq(prompt(mf, 4, 21), slot=1, pages=[3, 5], rows=5)],
             "decode": [Seq(prompt(mf, 6, 9), slot=0, pages=[1, 2], rows=1),
                        Seq(prompt(mf, 7, 6), slot=1, pages=[3, 5], rows=1)]}
    for name, seqs in cases.items():
        steps = max(-(-len(s.tokens) // s.rows) for s in seqs)
        out, preps = {}, {}
        for graphs in (False, True):
            gpu.use_graphs = graphs
            for on in (False, True):
                planes_switch(on)
                gpu.reset_slot(0)
                gpu.reset_slot(1)
                before = T.gpu_planes_prep_launches()
                out[graphs, on] = run(gpu, seqs)
                preps[graphs, on] = T.gpu_planes_prep_launches() - before
        for key, logits in out.items():
            for a, b in zip(logits, out[False, False]):
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (name, key)
        assert preps[False, False] - preps[False, True] >= steps * (5 * mf.config.n_layer + 1), name
        assert preps[False, True] > 0, name  # wo_a's and wo_b's inputs still have theirs prepped
