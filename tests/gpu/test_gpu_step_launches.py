"""Fewer launches on a step's critical path, the same bits.

Producer-built planes (ext/gpu/matvec_fused.h planes_fused): the engine's mHC pre, q_lat's RMSNorm,
the attention's combine, the SwiGLUs and hc_head write the integer products' planes of their output beside it, and the
products of that output read them instead of launching the prep kernel. The producers build each
unit's record with the prep kernel's own code (xplanes.cuh unit_planes_part).

Step branches (GpuEngine.use_branches): each layer's KV side and its shared expert run on a second
stream beside the q path and the routed experts; the same kernels on the same values.

Marked ``gpu``. Hooks (``_testing``): ``gpu_set_planes_fused(on) -> bool`` (process-wide) and
``gpu_planes_prep_launches()`` (the prep kernel's launches so far). The logits must be the same bits
under every setting, eager and under graphs (both switches are part of the graph key), for packed
prompts and for decode steps; and the planes must save the prep launches they claim to.
"""

from __future__ import annotations

import numpy as np
import pytest

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing
pytestmark = pytest.mark.gpu


@pytest.fixture
def planes_switch():
    """Set the switch inside a test; back on (the default) after it, the tensor-core thresholds too."""
    yield T.gpu_set_planes_fused
    T.gpu_set_planes_fused(True)
    T.gpu_set_matvec_imma_grouped(-1)


@pytest.fixture(scope="module")
def tiny_gpu(tmp_path_factory):
    """The tiny preset with Q4_K routed experts (gate, up and down: DS4 GGUFs' types) on the GPU; Q8_0
    attention, shared expert and LM head."""
    from ds4_app.engine.presets import tiny
    from ds4_app.engine.synth import synthesize
    from ds4_app.engine.gguf_file import ModelFile
    from tests.gpu.test_gpu_engine import gpu_engine

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    synthesize(tiny(), path, seed=5, types={"exps_down": "Q4_K"})
    mf = ModelFile.open(path)
    return mf, gpu_engine(mf, max_slots=2, max_rows=80)


def cases(mf):
    """Two prompts packed 7 and 5 rows a step; two sequences one row a step (decode); two prompts
    packed 40 and 30 rows a step (140 pairs: with the grouped tensor-core threshold at 1 the gate/up
    pair declines, and the routed SwiGLU writes the down product's planes)."""
    from tests.engine_cases import Seq, prompt

    return {"packed": [Seq(prompt(mf, 3, 30), slot=0, pages=[1, 2], rows=7),
                       Seq(prompt(mf, 4, 21), slot=1, pages=[3, 5], rows=5)],
            "decode": [Seq(prompt(mf, 6, 9), slot=0, pages=[1, 2], rows=1),
                       Seq(prompt(mf, 7, 6), slot=1, pages=[3, 5], rows=1)],
            "wide": [Seq(prompt(mf, 8, 90), slot=0, pages=[1, 3], rows=40),
                     Seq(prompt(mf, 9, 70), slot=1, pages=[4, 6], rows=30)]}


def run_under(gpu, seqs, graphs: bool, planes: bool, branches: bool):
    """The sequences' logits from fresh slots under one setting, and the prep launches they made."""
    from tests.engine_cases import run

    gpu.use_graphs = graphs
    T.gpu_set_planes_fused(planes)
    gpu.use_branches = branches
    gpu.reset_slot(0)
    gpu.reset_slot(1)
    before = T.gpu_planes_prep_launches()
    logits = run(gpu, seqs)
    return logits, T.gpu_planes_prep_launches() - before


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))


def test_switches_read_back(planes_switch, tiny_gpu) -> None:
    _, gpu = tiny_gpu
    assert planes_switch(False) is False
    assert planes_switch(True) is True
    gpu.use_branches = False
    assert gpu.use_branches is False
    gpu.use_branches = True
    assert gpu.use_branches is True


@pytest.mark.parametrize("name", ["packed", "decode", "wide"])
def test_producer_planes_and_branches_keep_the_bits(planes_switch, tiny_gpu, name) -> None:
    """Every setting's logits equal the reference's (no producer planes, no branches, eager). Eager,
    the producer planes save at least 6 prep launches a layer and one for the head each step: u's
    products in both sites (three preps), q_lat's, the attention output's (wo_a's members), the
    shared SwiGLU's output's, and head_in's."""
    mf, gpu = tiny_gpu
    seqs = cases(mf)[name]
    T.gpu_set_matvec_imma_grouped(1 if name == "wide" else -1)
    steps = max(-(-len(s.tokens) // s.rows) for s in seqs)
    ref, ref_preps = run_under(gpu, seqs, graphs=False, planes=False, branches=False)
    for graphs in (False, True):
        for planes, branches in ((False, False), (True, False), (True, True), (False, True)):
            logits, preps = run_under(gpu, seqs, graphs, planes, branches)
            assert same(logits, ref), (graphs, planes, branches)
            if not graphs and planes:
                assert ref_preps - preps >= steps * (6 * mf.config.n_layer + 1)
                assert preps > 0  # wo_b's input still has its planes prepped
            if not graphs and not planes:
                assert preps == ref_preps
