"""export_slot_state on a model without CSA layers (index_head_dim 0): the f16 row lists still
convert (the indexer rows are [0, 0] per layer), and the compressed rows of an HCA layer are there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine.memory import plan_memory
from ds4_app.engine.plan import StepPlan
from ds4_app.engine.presets import tiny
from ds4_app.engine.synth import synthesize

native = pytest.importorskip("ds4_app.engine._native")


def test_export_without_a_csa_layer(tmp_path: Path) -> None:
    cfg = dataclasses.replace(tiny(), n_layer=2, compress_ratios=(0, 128), index_n_heads=0, index_head_dim=0,
                              index_topk=0, swiglu_clamp_exp=(10.0,) * 2, swiglu_clamp_shexp=(10.0,) * 2)
    path = tmp_path / "no-csa.gguf"
    synthesize(cfg, path, seed=1)
    mf = ModelFile.open(path)
    tensors = [(t.name, t.ggml_type, t.ne, t.offset) for t in mf.tensors.values()]
    n_pages = plan_memory(mf.config, max_slots=1, max_ctx=512).n_pages
    eng = native.Engine(mf.config, str(mf.path), tensors, max_slots=1, max_ctx=512, n_pages=n_pages, max_rows=16,
                        n_threads=1)
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, 130)
    for k, tok in enumerate(tokens):
        eng.step(StepPlan.build([(0, int(tok), k, True)], {0: [0, 1]}, 4))
    d = native._testing.export_slot_state(eng, 0, [0, 1], len(tokens))
    assert [k.shape for k in d["idx_keys"]] == [(0, 0), (0, 0)]
    assert [c.shape for c in d["comp"]] == [(0, cfg.head_dim), (1, cfg.head_dim)]
    assert np.isfinite(d["comp"][1]).all() and np.abs(d["comp"][1]).max() > 0
    assert [r.shape for r in d["ring"]] == [(128, cfg.head_dim)] * 2
    assert d["idx_kv_state"] == [None, None] and d["kv_state"][0] is None and d["kv_state"][1].shape == (128, cfg.head_dim)
