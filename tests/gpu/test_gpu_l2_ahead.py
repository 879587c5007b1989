"""The weight kernels' L2 run-ahead (ext/gpu/matvec.cuh matvec_blocks' ``ahead``, the own grouped
kernel's ``l2_ask``): a speed choice that must not change a bit.

Marked ``gpu`` (conftest skips them without a CUDA/HIP build and a device). The hook
``_testing.gpu_set_matvec_l2_ahead(on, budget) -> budget in force`` (0: off) sets it process-wide:
``on`` 1 / 0 / -1 (back to DS4_GPU_MV_L2AHEAD or the default: on where the device can ask L2, CUDA
compute capability 9.0+), ``budget`` the bytes a launch's blocks in flight keep asked for together
(-1: DS4_GPU_MV_L2AHEAD_BYTES or three quarters of the L2).

Each kernel family runs with the run-ahead off, with a budget too small for one row block a block
(the launcher then asks for nothing), with a budget that covers some row blocks a block (the asks
roll ahead as the block walks its row blocks), and with an unbounded one (every block asks for all its
rows at once): every output must equal the run-ahead off bit for bit. The engine's logits under the
switch are covered by tests/gpu/test_gpu_launch_switches.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.gpu.test_gpu_fused import bits, routing
from tests.gpu.test_gpu_kernels import tame_raw

native = pytest.importorskip("ds4_app.engine._native")
T = native._testing
pytestmark = pytest.mark.gpu

Q8_0, Q4_K, F16 = 8, 12, 1
# (on, budget): off; too small a budget for one row block (no asks); a few row blocks a block (rolling
# asks); every row at once.
SETTINGS = [(0, -1), (1, 4096), (1, 96 << 20), (1, 1 << 40)]


@pytest.fixture
def restore_l2_ahead():
    yield
    T.gpu_set_matvec_l2_ahead(-1, -1)


def under_each(run):
    """run() under every setting; the outputs of each equal the first's (off) bit for bit."""
    outs = []
    for on, budget in SETTINGS:
        T.gpu_set_matvec_l2_ahead(on, budget)
        outs.append(run())
    for (on, budget), got in zip(SETTINGS[1:], outs[1:]):
        for a, b in zip(outs[0], got):
            assert np.isfinite(b).all()
            assert np.array_equal(bits(a), bits(b)), (on, budget)


def test_the_setter_reports_the_budget_in_force(restore_l2_ahead) -> None:
    assert T.gpu_set_matvec_l2_ahead(0, -1) == 0
    on = T.gpu_set_matvec_l2_ahead(1, 12345)
    assert on in (0, 12345)  # 0 where the device cannot ask L2
    if on:  # the default: on (three quarters of the L2) unless DS4_GPU_MV_L2AHEAD=0
        default = T.gpu_set_matvec_l2_ahead(-1, -1)
        assert default == 0 if os.environ.get("DS4_GPU_MV_L2AHEAD") == "0" else default > 0


@pytest.mark.parametrize("t", [Q8_0, F16], ids=["Q8_0", "F16"])
@pytest.mark.parametrize("tall", [False, True], ids=["direct", "tall"])
def test_dense_and_staged_products_keep_the_bits(t: int, tall: bool, restore_l2_ahead) -> None:
    """A matrix of far more row blocks than the device holds (the persistent grid: several row blocks a
    block) at 1 column (the direct kernel), 3 and 16 (the staged kernel), and the direct kernel at 16."""
    rng = np.random.default_rng(21)
    ne0, ne1 = 1024, 70001
    raw = tame_raw(t, ne0 * ne1, rng)
    x = rng.standard_normal((16, ne0)).astype(np.float32)

    def run():
        return [T.gpu_matmul(t, raw, ne0, ne1, x[:1], tall=tall),
                T.gpu_matmul(t, raw, ne0, ne1, x[:3], tall=tall),
                T.gpu_matmul(t, raw, ne0, ne1, x, tall=tall),
                T.gpu_matmul(t, raw, ne0, ne1, x, tall=tall, staged=False)]

    under_each(run)


def test_few_row_and_batched_products_keep_the_bits(restore_l2_ahead) -> None:
    """The mHC projection's shape (F16 [16384 -> 24], one row a warp, unit-by-unit loads) and the grouped
    output projection's batched launch (8 Q8_0 members)."""
    rng = np.random.default_rng(22)
    raw_h = tame_raw(F16, 16384 * 24, rng)
    x_h = rng.standard_normal((2, 16384)).astype(np.float32)
    raw_b = tame_raw(Q8_0, 512 * 8 * 1024, rng)
    x_b = rng.standard_normal((3, 8 * 512)).astype(np.float32)

    def run():
        return [T.gpu_matmul(F16, raw_h, 16384, 24, x_h[:1]), T.gpu_matmul(F16, raw_h, 16384, 24, x_h),
                T.gpu_matmul_batched(Q8_0, raw_b, 512, 8 * 1024, 8, x_b[:1]),
                T.gpu_matmul_batched(Q8_0, raw_b, 512, 8 * 1024, 8, x_b)]

    under_each(run)


def test_fused_products_keep_the_bits(restore_l2_ahead) -> None:
    """matvec_multi over products of three heights and two types in one grid, 1 and 5 columns."""
    rng = np.random.default_rng(23)
    ne0 = 2048
    products = [(Q8_0, tame_raw(Q8_0, ne0 * r, rng), r) for r in (1024, 512)] + [(F16, tame_raw(F16, ne0 * 256, rng), 256)]
    x = rng.standard_normal((5, ne0)).astype(np.float32)

    def run():
        return T.gpu_matmul_multi(products, ne0, x[:1])[0] + T.gpu_matmul_multi(products, ne0, x)[0]

    under_each(run)


@pytest.mark.parametrize("ne0, ne1, n_expert", [(2048, 203, 4), (4096, 2048, 6), (2048, 4096, 3)],
                         ids=["ks2-partial", "gate-up", "down"])
def test_grouped_products_keep_the_bits(ne0: int, ne1: int, n_expert: int, restore_l2_ahead) -> None:
    """The own grouped kernel (a single stack and the gate/up pair), one lane and seven lanes routing
    twice to some experts, parts of 8 and of 1."""
    rng = np.random.default_rng(24)
    raw_g, raw_u = tame_raw(Q4_K, ne0 * ne1 * n_expert, rng), tame_raw(Q4_K, ne0 * ne1 * n_expert, rng)
    cases = []
    for n_lanes, per_lane, repeats in ((1, 3, False), (7, 3, True)):
        x = rng.standard_normal((n_lanes, ne0)).astype(np.float32)
        pe, xr = routing(n_lanes, min(per_lane, n_expert), n_expert, rng, repeats)
        cases.append((x, pe, xr))

    def run():
        out = []
        for x, pe, xr in cases:
            for max_part in (8, 1):
                out.append(T.gpu_matmul_grouped(Q4_K, raw_g, ne0, ne1, n_expert, x, pe, xr, max_part))
                g, u, _ = T.gpu_matmul_grouped_pair(Q4_K, raw_g, raw_u, ne0, ne1, n_expert, x, pe, xr, max_part)
                out += [g, u]
        return out

    under_each(run)
