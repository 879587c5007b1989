"""Synthetic model writer: byte determinism, type mixes, value statistics, streaming."""

import hashlib
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K

from ds4_app.engine import synth
from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine.presets import flash, tiny
from ds4_app.engine.synth import (DS4_Q4_TYPES, estimate_file_size, synthesize, tensor_role,
                                  tensor_types)
from ds4_app.engine.tensors import SUPPORTED_TYPES, tensor_specs

T = GGMLQuantizationType


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> ModelFile:
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    synthesize("tiny", path, seed=11)
    return ModelFile.open(path)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    synthesize("tiny", a, seed=1)
    synthesize("tiny", b, seed=1)
    synthesize("tiny", c, seed=2)
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)
    # the seed changes weights, not the layout: same header size, same tensor table
    ma, mc = ModelFile.open(a), ModelFile.open(c)
    assert [(t.name, t.offset, t.nbytes) for t in ma.tensors.values()] == \
           [(t.name, t.offset, t.nbytes) for t in mc.tensors.values()]
    assert not np.array_equal(ma.raw("blk.0.ffn_up_exps.weight"), mc.raw("blk.0.ffn_up_exps.weight"))
    assert not list(tmp_path.glob("*.partial"))


def test_tiny_exercises_every_supported_type(tiny_file):
    used = {T[name] for name in tiny_file.type_counts()}
    assert used == set(SUPPORTED_TYPES)
    t = tiny_file.tensors
    assert t["blk.0.ffn_gate_exps.weight"].type_name == "Q4_K"
    assert t["blk.0.ffn_down_exps.weight"].type_name == "MXFP4"
    assert t["blk.1.attn_compressor_kv.weight"].type_name == "BF16"
    assert t["output_hc_fn.weight"].type_name == "F32"


def test_flash_mix_is_ds4_q4():
    # spec §11.3's DS4 q4 column, checked per tensor name for a 4-layer Flash
    cfg = flash(4)
    types = tensor_types(cfg, DS4_Q4_TYPES)
    want = {
        "token_embd.weight": T.F16, "output.weight": T.Q8_0, "output_norm.weight": T.F32,
        "output_hc_fn.weight": T.F16, "output_hc_base.weight": T.F32, "output_hc_scale.weight": T.F32,
        "blk.0.hc_attn_fn.weight": T.F16, "blk.0.hc_ffn_scale.weight": T.F32, "blk.0.hc_attn_base.weight": T.F32,
        "blk.0.attn_norm.weight": T.F32, "blk.0.attn_q_a.weight": T.Q8_0, "blk.0.attn_q_a_norm.weight": T.F32,
        "blk.0.attn_q_b.weight": T.Q8_0, "blk.0.attn_kv.weight": T.Q8_0, "blk.0.attn_sinks.weight": T.F32,
        "blk.0.attn_output_a.weight": T.Q8_0, "blk.0.attn_output_b.weight": T.Q8_0,
        "blk.2.attn_compressor_kv.weight": T.F16, "blk.2.attn_compressor_ape.weight": T.F16,
        "blk.2.attn_compressor_norm.weight": T.F32, "blk.2.indexer.attn_q_b.weight": T.F16,
        "blk.2.indexer.proj.weight": T.F16, "blk.2.indexer_compressor_gate.weight": T.F16,
        "blk.2.indexer_compressor_ape.weight": T.F16, "blk.2.indexer_compressor_norm.weight": T.F32,
        "blk.0.ffn_gate_inp.weight": T.F16, "blk.0.ffn_gate_tid2eid.weight": T.I32,
        "blk.3.exp_probs_b.bias": T.F32, "blk.3.ffn_gate_exps.weight": T.Q4_K,
        "blk.3.ffn_down_exps.weight": T.Q4_K, "blk.3.ffn_up_shexp.weight": T.Q8_0,
    }
    for name, qt in want.items():
        assert types[name] == qt, name
    # ratio-128 layers have a compressor without an indexer, ratio-0 layers neither
    assert "blk.3.attn_compressor_ape.weight" in types and "blk.3.indexer.proj.weight" not in types
    assert not any(n.startswith("blk.0.attn_compressor") for n in types)
    assert "blk.2.ffn_gate_tid2eid.weight" in types and "blk.3.ffn_gate_tid2eid.weight" not in types


def test_flash_shapes_follow_the_spec_table():
    specs = {s.name: s.ne for s in tensor_specs(flash(4))}
    assert specs["token_embd.weight"] == (4096, 129280)
    assert specs["output_hc_fn.weight"] == (16384, 4)
    assert specs["blk.0.hc_attn_fn.weight"] == (16384, 24)
    assert specs["blk.0.hc_attn_scale.weight"] == (3,) and specs["blk.0.hc_attn_base.weight"] == (24,)
    assert specs["blk.0.attn_q_b.weight"] == (1024, 32768)
    assert specs["blk.0.attn_output_a.weight"] == (4096, 8192)
    assert specs["blk.0.attn_output_b.weight"] == (8192, 4096)
    assert specs["blk.2.attn_compressor_kv.weight"] == (4096, 1024)
    assert specs["blk.2.attn_compressor_ape.weight"] == (1024, 4)
    assert specs["blk.3.attn_compressor_ape.weight"] == (512, 128)
    assert specs["blk.2.indexer.attn_q_b.weight"] == (1024, 8192)
    assert specs["blk.2.indexer.proj.weight"] == (4096, 64)
    assert specs["blk.2.indexer_compressor_kv.weight"] == (4096, 256)
    assert specs["blk.2.indexer_compressor_ape.weight"] == (256, 4)
    assert specs["blk.2.indexer_compressor_norm.weight"] == (128,)
    assert specs["blk.0.ffn_gate_tid2eid.weight"] == (6, 129280)
    assert specs["blk.3.ffn_gate_exps.weight"] == (4096, 2048, 256)
    assert specs["blk.3.ffn_down_exps.weight"] == (2048, 4096, 256)
    assert specs["blk.3.ffn_down_shexp.weight"] == (2048, 4096)


def test_flash_l4_size_estimate():
    size = estimate_file_size("flash-l4")
    # 4 layers of Q4_K experts (3.62 GB each) + F16 embedding + Q8_0 head + attention
    assert 16.0e9 < size < 17.5e9


def test_matrix_statistics(tiny_file):
    # mean 0, std 1/sqrt(fan_in), whatever the storage type
    seen = set()
    for spec in tiny_file.specs:
        if spec.kind != "matrix":
            continue
        info = tiny_file.tensors[spec.name]
        w = tiny_file.tensor_f32(spec.name)
        target = 1.0 / math.sqrt(spec.ne[0])
        tol = 0.05 if w.size >= 32768 else 0.12
        assert abs(float(w.std()) / target - 1) < tol, (spec.name, info.type_name, w.std(), target)
        assert abs(float(w.mean())) < 0.05 * target, (spec.name, info.type_name)
        seen.add(info.type_name)
    assert seen == {"F16", "F32", "BF16", "Q8_0", "Q4_K", "MXFP4"}


def test_q4_k_blocks_have_varied_scales_and_distinct_mins(tiny_file):
    raw = tiny_file.raw("blk.0.ffn_gate_exps.weight").reshape(-1, 144)
    sc, m = Q4_K.get_scale_min(raw[:, 4:16].copy())
    assert sc.min() >= 8 and sc.max() <= 31 and len(np.unique(sc)) > 16
    assert (m != sc).mean() > 0.7 and np.abs(m.astype(int) - sc.astype(int)).max() <= 3
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    assert d.std() > 0.1 * d.mean()
    np.testing.assert_allclose(dmin, 7.5 * d, rtol=2e-3)


def test_mxfp4_exponents_vary(tiny_file):
    e = tiny_file.raw("blk.0.ffn_down_exps.weight").reshape(-1, 17)[:, 0]
    assert len(np.unique(e)) == 2


def test_vector_statistics(tiny_file):
    cfg = tiny_file.config
    for i in range(cfg.n_layer):
        for name in ("attn_norm", "ffn_norm", "attn_q_a_norm", "attn_kv_a_norm"):
            w = tiny_file.tensor_f32(f"blk.{i}.{name}.weight")
            assert w.min() >= 0.9 and w.max() <= 1.1 and w.std() > 0.02
        for site in ("attn", "ffn"):
            s = tiny_file.tensor_f32(f"blk.{i}.hc_{site}_scale.weight")
            assert s.shape == (3,) and s.min() >= 0.05 and s.max() <= 0.15
            b = tiny_file.tensor_f32(f"blk.{i}.hc_{site}_base.weight")
            assert np.abs(b).max() < 0.5 and b.std() > 0
            fn = tiny_file.tensor_f32(f"blk.{i}.hc_{site}_fn.weight")
            assert abs(fn.std() * math.sqrt(cfg.hc_dim) - 1) < 0.05
    sinks = np.concatenate([tiny_file.tensor_f32(f"blk.{i}.attn_sinks.weight") for i in range(cfg.n_layer)])
    assert 0.2 < sinks.std() < 3
    bias = tiny_file.tensor_f32("blk.1.exp_probs_b.bias")
    assert np.abs(bias).max() < 0.5 and bias.std() > 0


def test_tid2eid_gives_distinct_valid_experts(tiny_file):
    cfg = tiny_file.config
    t = tiny_file.tensor_f32("blk.0.ffn_gate_tid2eid.weight")
    assert t.dtype == np.int32 and t.shape == (cfg.n_vocab, cfg.n_expert_used)
    assert t.min() >= 0 and t.max() < cfg.n_expert
    s = np.sort(t, axis=1)
    assert (np.diff(s, axis=1) > 0).all()
    # every expert is used by some tokens, roughly evenly
    counts = np.bincount(t.ravel(), minlength=cfg.n_expert)
    assert counts.min() > 0.7 * counts.mean()


def test_type_overrides(tmp_path):
    cfg = tiny()
    types = tensor_types(cfg, synth.TINY_TYPES, {"exps_down": "Q8_0", "blk.2.*_shexp.weight": "BF16"})
    assert types["blk.0.ffn_down_exps.weight"] == T.Q8_0
    assert types["blk.2.ffn_up_shexp.weight"] == T.BF16 and types["blk.1.ffn_up_shexp.weight"] == T.Q8_0
    with pytest.raises(ValueError, match="must be F32"):
        tensor_types(cfg, synth.TINY_TYPES, {"blk.0.attn_norm.weight": "F16"})
    with pytest.raises(ValueError, match="unsupported type Q5_0"):
        tensor_types(cfg, synth.TINY_TYPES, {"exps_down": "Q5_0"})
    with pytest.raises(ValueError, match="neither a role"):
        tensor_types(cfg, synth.TINY_TYPES, {"experts": "Q8_0"})
    path = tmp_path / "o.gguf"
    synthesize("tiny", path, seed=3, types={"exps_down": "Q8_0", "embd": "Q4_K"})
    mf = ModelFile.open(path)
    assert mf.tensors["blk.3.ffn_down_exps.weight"].type_name == "Q8_0"
    emb = mf.tensor_f32("token_embd.weight")
    assert mf.tensors["token_embd.weight"].type_name == "Q4_K" and abs(emb.std() * 16 - 1) < 0.05


def test_every_tensor_has_a_role():
    for cfg in (tiny(), flash(4)):
        roles = {tensor_role(s) for s in tensor_specs(cfg)}
        assert roles <= set(synth.ROLES)


def test_qat_flag(tmp_path):
    path = tmp_path / "q.gguf"
    synthesize("tiny", path, seed=0, qat_numerics=True)
    mf = ModelFile.open(path)
    assert mf.config.qat_numerics and mf.metadata["ds4app.qat_numerics"] is True


def test_streams_in_chunks(tmp_path, monkeypatch):
    # with a tiny chunk every big tensor is written in many pieces; the file must still be whole
    monkeypatch.setattr(synth, "CHUNK_BYTES", 4096)
    calls = []
    path = tmp_path / "s.gguf"
    synthesize("tiny", path, seed=5, progress=lambda done, total: calls.append((done, total)))
    total = calls[-1][1]
    assert calls[-1][0] == total == ModelFile.open(path).weight_bytes
    assert len(calls) > 1000 and all(a[0] < b[0] for a, b in zip(calls, calls[1:]))
    pieces = list(synth._chunks(next(s for s in tensor_specs(tiny()) if s.name == "blk.0.ffn_up_exps.weight"),
                                T.Q4_K, 5, 8))
    assert len(pieces) > 1 and all(p.nbytes <= 4096 for p in pieces)


def test_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        synthesize("huge", tmp_path / "x.gguf", seed=0)
    with pytest.raises(ValueError, match="does not exist"):
        synthesize("tiny", tmp_path / "missing" / "x.gguf", seed=0)
    from ds4_app.engine.tokenizer import build_synthetic_vocab

    with pytest.raises(ValueError, match="tokenizer has 600 tokens"):
        synthesize("tiny", tmp_path / "x.gguf", seed=0, tokenizer=build_synthetic_vocab(600))


def test_activations_stay_finite_and_varied_through_the_reference(tiny_file):
    # the whole model (mHC, three attention kinds, MoE) on random tokens: finite logits with a
    # spread near 1 that differ from position to position
    ref_mod = pytest.importorskip("ds4_app.engine.reference.model")
    ref = ref_mod.Reference(tiny_file.config, tiny_file.weights_f32())
    tokens = np.random.default_rng(0).integers(0, tiny_file.config.n_vocab, 40).tolist()
    logits = np.asarray(ref.forward_prompt(tokens))
    assert logits.shape == (40, tiny_file.config.n_vocab)
    assert np.isfinite(logits).all()
    spread = logits.std(axis=-1)
    assert (spread > 0.3).all() and (spread < 5).all()
    assert len(set(logits.argmax(-1).tolist())) > 20
