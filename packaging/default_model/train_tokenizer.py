"""Train the default model's byte-level BPE and tokenize the corpus with the runtime tokenizer.

The BPE is learned by ``tokenizers`` with exactly the pre-tokenizer our runtime ``Tokenizer``
applies (``ds4_app.engine.tokenizer._make_pre_tokenizer``: the DS4 "joyai-llm" split rules, then
the GPT-2 byte-level map), on the raw text of the training split only. Ids: 0 BOS, 1 EOS, then
the other DS4 special tokens of spec §10 in ``DS4_SPECIAL_TOKENS`` order (GGUF type control),
then the 256 byte symbols and the merges.

The documents are then encoded with ``Tokenizer.from_data`` (what the app runs) and, as a check,
with the trained ``tokenizers`` object: every document must give the same ids both ways and decode
back to its exact text, or the script fails.

Writes ``tokenizer.json`` (the TokenizerData fields) and ``tokens.npz`` (``train_ids``,
``train_offsets``, ``held_ids``, ``held_offsets``; document i is ids[offsets[i]:offsets[i+1]])
into the work folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from ds4_app.engine.tokenizer import (  # noqa: E402
    DS4_SPECIAL_TOKENS,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    Tokenizer,
    TokenizerData,
    _make_pre_tokenizer,
)

DEFAULT_WORK = REPO / ".ds4_default_work"
VOCAB_SIZE = 6144


def train_bpe(texts: list[str], vocab_size: int = VOCAB_SIZE) -> HFTokenizer:
    """A byte-level BPE over ``texts`` with the DS4 specials as ids 0.. (BOS 0, EOS 1)."""
    hf = HFTokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = _make_pre_tokenizer()
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(DS4_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return hf


def to_tokenizer_data(hf: HFTokenizer) -> TokenizerData:
    """The trained BPE as GGUF tokenizer metadata (tokens by id, merges in priority order)."""
    model = json.loads(hf.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for s, i in vocab.items():
        tokens[i] = s
    if any(t == "" for t in tokens):
        raise SystemExit("trained vocabulary has holes in its ids")
    for i, s in enumerate(DS4_SPECIAL_TOKENS):
        if tokens[i] != s:
            raise SystemExit(f"special token {s!r} is not id {i}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TOKEN_TYPE_CONTROL if i < len(DS4_SPECIAL_TOKENS) else TOKEN_TYPE_NORMAL for i in range(len(tokens))]
    return TokenizerData(tokens=tuple(tokens), merges=tuple(merges), token_types=tuple(types), bos_id=0, eos_id=1)


def encode_docs(tok: Tokenizer, hf: HFTokenizer, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Runtime ids of every document (concatenated) and the document offsets; checks the trainer agrees."""
    hf.add_special_tokens(list(DS4_SPECIAL_TOKENS))
    ids: list[int] = []
    offsets = [0]
    for i, doc in enumerate(docs):
        got = tok.encode(doc)
        ref = hf.encode(doc, add_special_tokens=False).ids
        if got != ref:
            raise SystemExit(f"document {i}: runtime Tokenizer and the trained BPE disagree")
        if tok.decode(got) != doc:
            raise SystemExit(f"document {i}: runtime Tokenizer does not round-trip the text")
        ids += got
        offsets.append(len(ids))
    return np.asarray(ids, dtype=np.uint16), np.asarray(offsets, dtype=np.int64)


def main(argv: list[str] | None = None) -> int:
    """Train the BPE on corpus.json, write tokenizer.json and tokens.npz."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args(argv)
    corpus = json.loads((args.work / "corpus.json").read_text())
    t0 = time.time()
    hf = train_bpe(corpus["train_plain_text"], args.vocab_size)
    data = to_tokenizer_data(hf)
    tok = Tokenizer.from_data(data)
    train_ids, train_off = encode_docs(tok, hf, corpus["train"])
    held_ids, held_off = encode_docs(tok, hf, corpus["held_out"])
    (args.work / "tokenizer.json").write_text(json.dumps({
        "tokens": data.tokens, "merges": data.merges, "token_types": data.token_types,
        "bos_id": data.bos_id, "eos_id": data.eos_id, "pre": data.pre}, ensure_ascii=False))
    np.savez(args.work / "tokens.npz", train_ids=train_ids, train_offsets=train_off,
             held_ids=held_ids, held_offsets=held_off, n_vocab=np.int64(len(data.tokens)))
    n_chars = sum(map(len, corpus["train"]))
    print(json.dumps({"vocab": len(data.tokens), "merges": len(data.merges), "train_tokens": int(train_ids.size),
                      "held_out_tokens": int(held_ids.size), "chars_per_token": round(n_chars / train_ids.size, 3),
                      "seconds": round(time.time() - t0, 1)}, indent=1))
    return 0


def load_tokenizer_data(work: Path) -> TokenizerData:
    """The TokenizerData written by ``main``."""
    d = json.loads((work / "tokenizer.json").read_text())
    return TokenizerData(tokens=tuple(d["tokens"]), merges=tuple(d["merges"]), token_types=tuple(d["token_types"]),
                         bos_id=d["bos_id"], eos_id=d["eos_id"], pre=d["pre"])


if __name__ == "__main__":
    raise SystemExit(main())
