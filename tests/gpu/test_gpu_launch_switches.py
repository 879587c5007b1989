"""Launch switches that change when or where work runs, never a result.

Marked ``gpu`` (conftest skips them without a CUDA/HIP build and a device). Hooks (``_testing``):

- ``gpu_set_pdl(on) -> bool``: programmatic dependent launch (ext/gpu/launch.cuh), process-wide
  (DS4_GPU_PDL=0), returning whether it is on now (only on CUDA devices of compute capability
  9.0+). With it on, a kernel's blocks may start while the previous kernel finishes and run up to
  their ``ds4_grid_wait``; a kernel that read or wrote before that wait would race with its
  predecessor.
- ``gpu_set_matvec_persistent(on)``: the direct matvec kernel's persistent grid (matvec.cu;
  DS4_GPU_MV_PERSIST=0): each block walks several row blocks.
- ``gpu_set_matvec_tall_stages(1 or 2)``: the tall variant's chunk stages (DS4_GPU_MV_TALL_STAGES=2).
- ``gpu_set_matvec_tall_min_k(k) -> k``: the fewest elements a row the tall variant takes
  (DS4_GPU_MV_TALL_MIN_K; default 2048, 0 any, -1 back to the default); narrower matrices take the
  direct kernel.
- ``gpu_set_attn_heads(n) -> n``: the split attention's heads a block (1, 2 or 4; -1 the rule, which
  returns 0).
- ``gpu_set_matvec_staged_min_rows(rows) -> rows``: the fewest rows a matrix needs to take the staged
  kernel at every width (-1 back to the rule, 512 rows or 256 for whole 16-column chunks, which returns
  0); at 64 most of tiny's products of two or more columns take it.

Two measurement settings here do change bits: ``gpu_set_attn_split_min(keys) -> keys``, the
attention's fewest keys a split (8..256 in steps of 8, -1 the default 64), and
``gpu_set_hc_site_streams(n) -> n``, the mHC site's streams a sums thread (1 or 2, -1 the default 2).
Decode and prompt steps take each alike, so the engine's bits must change with it, and its graphs
must follow it.

And one launch choice without a switch: F32/F16/BF16 matrices of fewer row blocks than SMs run one
row a warp (matvec.cuh's kDenseShort), e.g. the mHC projections [16384 -> 24]; their columns must
still equal single columns at every width and the CPU within the usual bound.

And one switch read once a process, so tested in a child process: DS4_GPU_ATTN_EARLY=0 puts the split
attention's step-input work (its keys' rows, the combine's inverse RoPE table) after the grid wait
(``gpu_attn_early() -> bool``: the switch as the attention's launches read it).

And where a step's inputs lie: at its lanes rounded up to 32, whatever the engine's max_rows, so engines
of different max_rows must give the same bits; and the host's phases of a step (GpuEngine.host_phases).

The engine's logits over decode, packed prompts and several lanes, eager and under graphs, with the
SIMT and the tensor-core products (whose kernels are launched without the PDL attribute, so the
chain mixes both kinds of edge), must be bit-identical with each switch on and off.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ds4_app.engine.plan import StepPlan
from tests.engine_cases import PAGES_PER_SEQ, Seq, prompt, run_fresh
from tests.gpu.test_gpu_fused import bits, gpu_engine, tiny_model_file  # noqa: F401 (fixture)
from tests.gpu.test_gpu_kernels import tame_raw

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing
pytestmark = pytest.mark.gpu


Q8_0, F16, BF16, F32 = 8, 1, 30, 0


@pytest.fixture
def restore_pdl():
    """Put the switches back to their defaults after a test."""
    yield
    T.gpu_set_pdl(True)
    T.gpu_set_matvec_persistent(True)
    T.gpu_set_matvec_tall_stages(1)
    T.gpu_set_matvec_mma(False)
    T.gpu_set_matvec_tall_min_k(-1)
    T.gpu_set_attn_heads(-1)
    T.gpu_set_attn_split_min(-1)
    T.gpu_set_matvec_staged_min_rows(-1)
    T.gpu_set_hc_site_streams(-1)


def set_persistent(on: bool) -> bool:
    T.gpu_set_matvec_persistent(on)
    return True


def set_tall_stages(on: bool) -> bool:
    T.gpu_set_matvec_tall_stages(2 if on else 1)
    return True


def set_tall_min_k(on: bool) -> bool:
    assert T.gpu_set_matvec_tall_min_k(4096 if on else 0) == (4096 if on else 0)
    return True


def set_staged_min_rows(on: bool) -> bool:
    """The staged kernel from 64 rows at every width against the rule (512 rows, 256 for 16 columns)."""
    assert T.gpu_set_matvec_staged_min_rows(64 if on else -1) == (64 if on else 0)
    return True


def set_attn_heads(on: bool) -> bool:
    """One head a block against the rule (two at one or two lanes, four beyond)."""
    assert T.gpu_set_attn_heads(1 if on else -1) == (1 if on else 0)
    return True


SWITCHES = {"pdl": lambda on: T.gpu_set_pdl(on), "persistent": set_persistent, "tall2": set_tall_stages,
            "tallk": set_tall_min_k, "attnheads": set_attn_heads, "stagedrows": set_staged_min_rows}


def cases(mf) -> list[list[Seq]]:
    return [
        [Seq(prompt(mf, 81, 40), slot=0, pages=[0, 1])],
        [Seq(prompt(mf, 82, 44), slot=1, pages=[2, 3], rows=1),
         Seq(prompt(mf, 83, 40), slot=3, pages=[4]),
         Seq(prompt(mf, 84, 41), slot=5, pages=[6, 7], start=1)],
        [Seq(prompt(mf, 85, 44), slot=2, pages=[8], rows=16)],
    ]


def test_the_switch_is_on_by_default_on_hopper(tiny_model_file, restore_pdl) -> None:  # noqa: F811
    eng = gpu_engine(tiny_model_file, max_slots=1, max_rows=1)
    cc = re.search(r"cc (\d+)\.", eng.device_name)
    on = T.gpu_set_pdl(True)
    if cc and int(cc.group(1)) >= 9:
        assert on, eng.device_name
    assert T.gpu_set_pdl(False) is False


@pytest.mark.parametrize("t", [Q8_0, F16], ids=["Q8_0", "F16"])
@pytest.mark.parametrize("tall", [False, True], ids=["direct", "tall"])
def test_persistent_grid_gives_the_same_bits(t: int, tall: bool, restore_pdl) -> None:
    """A matrix of far more row blocks than the device holds (several rounds a block), 1, 3 and 16
    columns: the persistent grid's outputs equal one block a row block's, bit for bit."""
    rng = np.random.default_rng(11)
    ne0, ne1 = 256, 70001
    raw = tame_raw(t, ne0 * ne1, rng)
    for ncols in (1, 3, 16):
        x = rng.standard_normal((ncols, ne0)).astype(np.float32)
        out = {}
        for on in (False, True):
            T.gpu_set_matvec_persistent(on)
            out[on] = T.gpu_matmul(t, raw, ne0, ne1, x, tall=tall, staged=False)
        assert np.isfinite(out[True]).all()
        assert np.array_equal(bits(out[False]), bits(out[True])), f"{ncols} columns"


@pytest.mark.parametrize("t", [Q8_0, F16], ids=["Q8_0", "F16"])
def test_tall_least_width_sends_narrow_rows_to_the_direct_kernel(t: int, restore_pdl) -> None:
    """q_b's shape (32768 rows of 1024) and the LM head's width (4096) with the tall variant asked for:
    the least width 0 / 2048 / 8192 (tall, direct, direct; tall, tall, direct) gives the same bits at 1,
    3 and 16 columns."""
    rng = np.random.default_rng(17)
    for ne0, ne1 in ((1024, 32768), (4096, 16400)):
        raw = tame_raw(t, ne0 * ne1, rng)
        x = rng.standard_normal((16, ne0)).astype(np.float32)
        out = {}
        for k in (0, 2048, 8192):
            assert T.gpu_set_matvec_tall_min_k(k) == k
            out[k] = [T.gpu_matmul(t, raw, ne0, ne1, x[:n], tall=True, staged=False) for n in (1, 3, 16)]
        for k in (2048, 8192):
            for a, b in zip(out[0], out[k]):
                assert np.isfinite(b).all()
                assert np.array_equal(bits(a), bits(b)), (ne0, k)


def test_tall_two_stages_give_the_same_bits(restore_pdl) -> None:
    """Q8_0 [4096 -> 20011] (tall: 8 rows a warp) at 1-4 columns (the two-stage shape) and 5 and 16
    (the usual one): the same bits with one and two chunk stages, and equal to single columns."""
    rng = np.random.default_rng(13)
    ne0, ne1 = 4096, 20011
    raw = tame_raw(Q8_0, ne0 * ne1, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)
    out = {}
    for stages in (1, 2):
        T.gpu_set_matvec_tall_stages(stages)
        out[stages] = [T.gpu_matmul(Q8_0, raw, ne0, ne1, x[:n], tall=True, staged=False) for n in (1, 2, 3, 4, 5, 16)]
    for a, b in zip(out[1], out[2]):
        assert np.isfinite(b).all()
        assert np.array_equal(bits(a), bits(b))
    for n, y in zip((1, 2, 3, 4, 5, 16), out[2]):
        assert np.array_equal(bits(y), bits(out[2][-1][:n]))


@pytest.mark.parametrize("t", [F16, BF16, F32], ids=["F16", "BF16", "F32"])
def test_few_row_matrices_keep_width_exactness(t: int) -> None:
    """The mHC projection's shape (24 rows of 16384: one row a warp, 24 blocks) and the output head's
    (4 rows): every width equals single columns bit for bit, and the CPU within 2e-3 of sum |w x|."""
    rng = np.random.default_rng(5)
    for ne0, ne1 in ((16384, 24), (16384, 4)):
        raw = tame_raw(t, ne0 * ne1, rng)
        x = rng.standard_normal((16, ne0)).astype(np.float32)
        single = np.concatenate([T.gpu_matmul(t, raw, ne0, ne1, x[c : c + 1]) for c in range(16)])
        for width in (2, 5, 8, 16):
            y = T.gpu_matmul(t, raw, ne0, ne1, x[:width])
            assert np.array_equal(bits(y), bits(single[:width])), (ne1, width)
        cpu = T.matmul(t, raw, ne0, ne1, x, 2)
        w = T.dequantize(t, raw, ne0 * ne1).reshape(ne1, ne0).astype(np.float64)
        bound = 2e-3 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
        assert (np.abs(single.astype(np.float64) - cpu) <= bound).all()


@pytest.mark.parametrize("switch", sorted(SWITCHES))
@pytest.mark.parametrize("mma", [False, True], ids=["simt", "tensor-cores"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_logits_are_the_same_with_the_switch_on_and_off(tiny_model_file, graphs: bool, mma: bool,  # noqa: F811
                                                               switch: str, restore_pdl) -> None:
    """One lane, three lanes in three slots, and a prompt fed 16 rows a step: the same bits with the
    switch on and off; under graphs the switch captures new graphs (bits 17 and 18 of the graph key)."""
    mf = tiny_model_file
    if mma and not T.gpu_set_matvec_mma(True):
        pytest.skip("no tensor-core kernels in this build")
    eng = gpu_engine(mf)
    eng.use_graphs = graphs
    out = {}
    captured = eng.graphs_captured
    for pdl in (False, True):
        effective = SWITCHES[switch](pdl)
        out[pdl] = []
        for seqs in cases(mf):
            out[pdl].append(run_fresh(eng, seqs))
        if graphs and effective:
            assert eng.graphs_captured > captured, "the PDL switch must capture new graphs"
            captured = eng.graphs_captured
    for case, (off, on) in enumerate(zip(out[False], out[True])):
        for k, (a, b) in enumerate(zip(off, on)):
            assert np.isfinite(a).all()
            assert np.array_equal(bits(a), bits(b)), f"case {case}, sequence {k}"


def logits_over_cases(eng, mf) -> dict[str, np.ndarray]:
    """The engine's logits over cases(), eager and under graphs, keyed graphs_case_sequence."""
    out = {}
    for graphs in (False, True):
        eng.use_graphs = graphs
        for c, seqs in enumerate(cases(mf)):
            for k, a in enumerate(run_fresh(eng, seqs)):
                out[f"{int(graphs)}_{c}_{k}"] = a
    return out


CASES_CHILD = """
import sys
import numpy as np
from ds4_app.engine.gguf_file import ModelFile
from tests.gpu.test_gpu_fused import gpu_engine
from tests.gpu.test_gpu_launch_switches import logits_over_cases
from ds4_app.engine import _native
mf = ModelFile.open(sys.argv[1])
np.savez(sys.argv[2], attn_early=np.array(_native._testing.gpu_attn_early()),
         **logits_over_cases(gpu_engine(mf), mf))
"""


def test_attention_step_input_work_after_the_grid_wait_gives_the_same_bits(tiny_model_file,  # noqa: F811
                                                                           tmp_path, restore_pdl) -> None:
    """The split and combine kernels locate their keys and build the inverse RoPE table before their
    grid wait unless DS4_GPU_ATTN_EARLY=0 (read once a process): a child process with the work after
    the wait gives the same logits, eager and under graphs, for one lane, three lanes and a prompt 16
    rows a step (tiny's CSA layers select their rows past 32 tokens, located after the wait either way).
    The child reports the switch as its kernels see it, so a child that ignored the variable fails."""
    env = dict(os.environ, DS4_GPU_ATTN_EARLY="0")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", CASES_CHILD, str(tiny_model_file.path), str(tmp_path / "out.npz")],
                   env=env, cwd=root, check=True, timeout=300)
    child = dict(np.load(tmp_path / "out.npz"))
    assert not child.pop("attn_early") and T.gpu_attn_early(), "the child must run the work after the wait"
    ours = logits_over_cases(gpu_engine(tiny_model_file), tiny_model_file)
    assert sorted(child) == sorted(ours) and len(ours) == 2 * 5
    for key, a in ours.items():
        assert np.isfinite(a).all()
        assert np.array_equal(bits(a), bits(child[key])), key


def test_inputs_packed_at_the_step_stride_keep_the_bits(tiny_model_file) -> None:  # noqa: F811
    """A step's input arrays sit at its lanes rounded up to 32, not at max_rows (engine_gpu.cu
    input_stride), so the graph of a bucket bakes in views of its own stride. An engine of max_rows 96
    (strides 32 and 64, below its 96) gives the logits of one of max_rows 16 (every stride 16) bit for
    bit, eager and under graphs: over cases(), and a 44-token prompt fed 40 rows a step there and 16 a
    step here (a prompt's split never changes its bits)."""
    mf = tiny_model_file
    small, wide = gpu_engine(mf, max_rows=16), gpu_engine(mf, max_rows=96)
    ours, theirs = logits_over_cases(wide, mf), logits_over_cases(small, mf)
    assert sorted(ours) == sorted(theirs) and len(ours) == 2 * 5
    for key, a in ours.items():
        assert np.isfinite(a).all()
        assert np.array_equal(bits(a), bits(theirs[key])), key
    seq = Seq(prompt(mf, 86, 44), slot=4, pages=[9, 10], rows=40)
    for graphs in (False, True):
        wide.use_graphs = small.use_graphs = graphs
        a = run_fresh(wide, [seq])[0]
        b = run_fresh(small, [dataclasses.replace(seq, rows=16)])[0]
        assert np.isfinite(a).all()
        assert np.array_equal(bits(a), bits(b)), f"graphs={graphs}"


def test_host_phases_add_up_within_the_step(tiny_model_file) -> None:  # noqa: F811
    """GpuEngine.host_phases: the host's five phases of the last step in order, none negative, the
    wait positive (the stream had work), together within the step's wall time; none before a step."""
    eng = gpu_engine(tiny_model_file, max_slots=1, max_rows=4)
    assert eng.host_phases() == {}
    for graphs in (False, True):
        eng.use_graphs = graphs
        eng.reset_slot(0)
        for k in range(3):
            plan = StepPlan.build([(0, 7 + k, k, True)], {0: [0]}, PAGES_PER_SEQ)
            t0 = time.perf_counter()
            eng.step_argmax(plan)
            wall_us = (time.perf_counter() - t0) * 1e6
            phases = eng.host_phases()
            assert list(phases) == ["prepare", "upload", "launch", "download", "wait"]
            assert min(phases.values()) >= 0 and phases["wait"] > 0
            assert sum(phases.values()) <= wall_us


# The measurement settings that change bits: (the setter's hook, its default's value, the other value tried).
BIT_SETTINGS = {"splitmin": ("gpu_set_attn_split_min", 64, 8), "hcstreams": ("gpu_set_hc_site_streams", 2, 1)}


@pytest.mark.parametrize("name", list(BIT_SETTINGS))
def test_engine_bit_setting_changes_bits_and_the_graph_key(name, tiny_model_file, restore_pdl) -> None:  # noqa: F811
    """A setting that changes the arithmetic alike in decode and prompt steps: the attention's fewest
    keys a split (tiny's lanes have up to ~45 keys a layer: one split at the default 64, up to six at 8)
    and the mHC site's streams a sums thread. The logits must differ between the default and the other
    value (a setting that silently did nothing fails), and under each setting graphs must give eager's
    bits (a graph captured under the other setting would not)."""
    hook, default, other = BIT_SETTINGS[name]
    setter = getattr(T, hook)
    mf = tiny_model_file
    eng = gpu_engine(mf)
    out = {}
    for value in (-1, other, -1):
        assert setter(value) == (default if value < 0 else value)
        for graphs in (False, True):
            eng.use_graphs = graphs
            got = []
            for seqs in cases(mf):
                got.append(run_fresh(eng, seqs))
            out.setdefault((value, graphs), got)
            for case, (a, b) in enumerate(zip(out[(value, graphs)], got)):
                for k, (x, y) in enumerate(zip(a, b)):
                    assert np.array_equal(bits(x), bits(y)), f"{name} {value}, graphs {graphs}: case {case}, {k}"
        for case, (a, b) in enumerate(zip(out[(value, False)], out[(value, True)])):
            for k, (x, y) in enumerate(zip(a, b)):
                assert np.isfinite(x).all()
                assert np.array_equal(bits(x), bits(y)), f"{name} {value}: graphs against eager, case {case}, {k}"
    changed = [not np.array_equal(bits(x), bits(y))
               for a, b in zip(out[(-1, False)], out[(other, False)]) for x, y in zip(a, b)]
    assert any(changed), f"{name} {other} gave the default's bits"
