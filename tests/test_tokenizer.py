"""Tokenizer tests: synthetic vocabulary, GGUF metadata round trip, encode/decode, streaming."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4_app.engine.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    BYTE_TO_UNICODE,
    DS4_SPECIAL_TOKENS,
    EOS_TOKEN,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNUSED,
    USER_TOKEN,
    Tokenizer,
    TokenizerData,
    _CORPUS,
    _learn_merges,
    _make_pre_tokenizer,
    build_synthetic_vocab,
)

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Punctuation: (a), [b], {c}; 'quotes' \"double\" -- dash... ?!",
    "digits 0 7 42 123 4567 1234567890 3.14159 1,000,000",
    "line one\nline two\r\n\n\tindented\n",
    "emoji 😀🎉👍🏽 and flags 🇫🇷",
    "中文文本：你好，世界！日本語のテキスト、カタカナ。한국어",
    "café naïve façade Ωμέγα Привет",
    "def f(x):\n    return x ** 2  # square\n",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_data(build_synthetic_vocab(2048))


def test_synthetic_vocab_is_deterministic_and_exact_size() -> None:
    a = build_synthetic_vocab(4096)
    b = build_synthetic_vocab(4096)
    assert a == b
    for n in (512, 777, 4096, 129280):
        data = build_synthetic_vocab(n)
        assert len(data.tokens) == n == len(data.token_types)
        assert len(set(data.tokens)) == n


def test_synthetic_vocab_seed_changes_tie_breaking_only() -> None:
    a = build_synthetic_vocab(2048, seed=0)
    b = build_synthetic_vocab(2048, seed=1)
    assert a != b
    assert a.tokens[: len(DS4_SPECIAL_TOKENS) + 256] == b.tokens[: len(DS4_SPECIAL_TOKENS) + 256]
    text = "Shall I compare thee to a summer's day? 42"
    tb = Tokenizer.from_data(b)
    assert tb.decode(tb.encode(text)) == text


def test_learned_merges_match_naive_bpe() -> None:
    """The incremental trainer equals textbook BPE: recount every pair, take the most frequent,
    break ties by the smallest (left, right)."""
    counts: dict[str, int] = {}
    for piece, _ in _make_pre_tokenizer().pre_tokenize_str(_CORPUS):
        counts[piece] = counts.get(piece, 0) + 1
    words = {tuple(p): c for p, c in counts.items()}
    expected = []
    for _ in range(150):
        pairs: dict[tuple[str, str], int] = {}
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] = pairs.get(pair, 0) + c
        best = min(pairs, key=lambda p: (-pairs[p], p))
        expected.append(best)
        merged_words: dict[tuple[str, ...], int] = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if w[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged_words[tuple(out)] = merged_words.get(tuple(out), 0) + c
        words = merged_words
    assert _learn_merges(0, 150) == expected


def test_synthetic_vocab_rejects_tiny_sizes() -> None:
    with pytest.raises(ValueError):
        build_synthetic_vocab(300)


def test_synthetic_vocab_layout() -> None:
    data = build_synthetic_vocab(129280)
    assert data.tokens[0] == BOS_TOKEN and data.bos_id == 0
    assert data.tokens[1] == EOS_TOKEN and data.eos_id == 1
    n_special = len(DS4_SPECIAL_TOKENS)
    assert data.tokens[:n_special] == DS4_SPECIAL_TOKENS
    assert set(data.token_types[:n_special]) == {TOKEN_TYPE_CONTROL}
    assert data.tokens[n_special : n_special + 256] == tuple(BYTE_TO_UNICODE[b] for b in range(256))
    # A real set of learned merges (a few hundred at least), every one well formed: its parts and
    # its result are tokens, and each part exists before the merge that uses it.
    assert len(data.merges) > 1000
    index = {t: i for i, t in enumerate(data.tokens)}
    for m in data.merges:
        left, right = m.split(" ")
        assert left in index and right in index and left + right in index
        assert data.token_types[index[left + right]] == TOKEN_TYPE_NORMAL
    assert data.tokens[-1].startswith("<｜place▁holder▁no▁")
    assert data.token_types[-1] == TOKEN_TYPE_UNUSED
    n_real = data.token_types.count(TOKEN_TYPE_NORMAL) + n_special
    assert set(data.token_types[n_real:]) == {TOKEN_TYPE_UNUSED}


def test_merges_are_used(tok: Tokenizer) -> None:
    text = "And the men and women of the world"
    ids = tok.encode(text)
    # Byte-only encoding would give one token per byte.
    assert len(ids) < len(text.encode()) / 2


def test_specials_by_string(tok: Tokenizer) -> None:
    assert tok.bos_id == 0 and tok.eos_id == 1
    assert tok.token_id(BOS_TOKEN) == 0
    assert tok.token_id(EOS_TOKEN) == 1
    ids = {tok.token_id(s) for s in DS4_SPECIAL_TOKENS}
    assert len(ids) == len(DS4_SPECIAL_TOKENS)
    assert ids <= tok.special_ids
    for s in DS4_SPECIAL_TOKENS:
        assert tok.token_text(tok.token_id(s)) == s
    with pytest.raises(KeyError, match="not in this model's vocabulary"):
        tok.token_id("<｜no such token｜>")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_round_trip_any_text(text: str) -> None:
    tok = _shared_tokenizer()
    assert tok.decode(tok.encode(text)) == text


_SHARED: list[Tokenizer] = []


def _shared_tokenizer() -> Tokenizer:
    if not _SHARED:
        _SHARED.append(Tokenizer.from_data(build_synthetic_vocab(1024)))
    return _SHARED[0]


def test_special_strings_in_text_are_single_ids(tok: Tokenizer) -> None:
    text = (
        f"{BOS_TOKEN}sys{USER_TOKEN}hi there{ASSISTANT_TOKEN}"
        f"{THINK_START_TOKEN}hmm{THINK_END_TOKEN}ok{EOS_TOKEN}"
    )
    ids = tok.encode(text)
    for s in (BOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, THINK_START_TOKEN, THINK_END_TOKEN):
        assert ids.count(tok.token_id(s)) == 1
    assert ids.count(tok.eos_id) == 1
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text
    # Without the special tokens, the same characters would need many byte-level tokens.
    assert len(tok.encode("<think>")) == 1
    assert len(tok.encode("<thin>")) > 1


def test_encode_adds_no_bos(tok: Tokenizer) -> None:
    assert tok.bos_id not in tok.encode("hello")


def test_pre_tokenizer_rules() -> None:
    text = "1234567 日本語テキストabc"
    pieces = [p for p, _ in _make_pre_tokenizer().pre_tokenize_str(text)]
    # Digits in runs of at most three; the CJK/kana run is its own piece (byte-level form).
    assert pieces[:3] == ["123", "456", "7"]
    assert "".join(pieces) == "".join(BYTE_TO_UNICODE[b] for b in text.encode())
    cjk = "".join(BYTE_TO_UNICODE[b] for b in "日本語テキスト".encode())
    assert cjk in pieces
    pieces = [p for p, _ in _make_pre_tokenizer().pre_tokenize_str("Hello, world.\n\nNext")]
    assert pieces == ["Hello", ",", "Ġworld", ".ĊĊ", "Next"]


def test_metadata_round_trip() -> None:
    data = build_synthetic_vocab(1000)
    items = data.metadata_items()
    kinds = {k: kind for k, _, kind in items}
    assert kinds["tokenizer.ggml.tokens"] == "string_array"
    assert kinds["tokenizer.ggml.token_type"] == "int32_array"
    assert kinds["tokenizer.ggml.eos_token_id"] == "uint32"
    kv = {k: v for k, v, _ in items}
    assert kv["tokenizer.ggml.eot_token_id"] == data.eos_id
    assert kv["tokenizer.ggml.add_bos_token"] is True
    assert TokenizerData.from_metadata(kv) == data
    tok = Tokenizer.from_metadata(kv)
    assert tok.decode(tok.encode("round trip")) == "round trip"


def _kv() -> dict:
    return {k: v for k, v, _ in build_synthetic_vocab(600).metadata_items()}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda kv: kv.update({"tokenizer.ggml.model": "llama"}), "gpt2"),
        (
            lambda kv: kv.update(
                {"tokenizer.ggml.token_type": kv["tokenizer.ggml.token_type"][:-1]}
            ),
            "token types",
        ),
        (lambda kv: kv.pop("tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
        (lambda kv: kv.update({"tokenizer.ggml.eos_token_id": 600}), "eos id"),
        (lambda kv: kv.update({"tokenizer.ggml.pre": "llama3"}), "pre-tokenizer"),
        (lambda kv: kv.update({"tokenizer.ggml.merges": ["Ġt he", "nospace"]}), "malformed"),
        (lambda kv: kv.update({"tokenizer.ggml.tokens": "not a list"}), "list of strings"),
    ],
)
def test_bad_metadata(change, message: str) -> None:
    kv = _kv()
    change(kv)
    with pytest.raises(ValueError, match=message):
        TokenizerData.from_metadata(kv)


def test_merge_outside_vocab_is_value_error() -> None:
    kv = _kv()
    kv["tokenizer.ggml.merges"] = list(kv["tokenizer.ggml.merges"]) + ["zzqq xxyy"]
    with pytest.raises(ValueError, match="merges"):
        Tokenizer.from_metadata(kv)


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_matches_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stream_decoder_holds_back_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji is split over byte tokens in this small vocabulary
    pieces = _stream(tok, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1)
    assert pieces[-2] == "😀" and pieces[-1] == ""
    text = "a日本語😀b"
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    for p in pieces:
        p.encode("utf-8")  # every piece is complete, valid text
        assert "\ufffd" not in p


def test_stream_decoder_specials_and_truncation(tok: Tokenizer) -> None:
    dec = tok.stream_decoder()
    assert dec.push(tok.token_id(USER_TOKEN)) == USER_TOKEN
    ids = tok.encode("😀")
    for i in ids[:-1]:
        assert dec.push(i) == ""
    # A cut-off character becomes U+FFFD when the sequence ends, not a crash or silent loss.
    assert dec.flush().startswith("\ufffd")
    assert dec.flush() == ""
    assert dec.push(tok.encode("x")[0]) == "x"


def test_bad_ids(tok: Tokenizer) -> None:
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError):
        tok.token_text(-1)


def test_full_size_vocab_builds() -> None:
    tok = Tokenizer.from_data(build_synthetic_vocab(129280))
    assert tok.vocab_size == 129280
    text = "Tomorrow, and tomorrow, and tomorrow 😀"
    assert tok.decode(tok.encode(text)) == text
    last = tok.vocab_size - 1
    assert "".join(_stream(tok, [last])) == tok.token_text(last) == tok.decode([last])
