"""Chat-format tests: exact DS4 prompt strings, encoding, and reply parsing."""

from __future__ import annotations

import pytest

from ds4_app.engine.chat import (
    THINK_MAX_PREFIX,
    Delta,
    Message,
    ReplyParser,
    encode_chat,
    render_chat,
)
from ds4_app.engine.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
    Tokenizer,
    build_synthetic_vocab,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_data(build_synthetic_vocab(2048))


def test_constants_are_the_ds4_strings() -> None:
    assert (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN) == (BOS, EOS, U, A)
    assert (THINK_START_TOKEN, THINK_END_TOKEN) == ("<think>", "</think>")
    assert THINK_MAX_PREFIX is None


def test_render_system_user_chat_mode() -> None:
    msgs = [Message("system", "You are helpful."), Message("user", "Hi!")]
    assert render_chat(msgs, thinking=False) == f"{BOS}You are helpful.{U}Hi!{A}</think>"


def test_render_thinking_mode() -> None:
    msgs = [Message("system", "Be brief."), Message("user", "2+2?")]
    assert render_chat(msgs, thinking=True) == f"{BOS}Be brief.{U}2+2?{A}<think>"
    assert render_chat(msgs, thinking=True, add_bos=False) == f"Be brief.{U}2+2?{A}<think>"


def test_render_multi_turn_drops_history_reasoning() -> None:
    msgs = [
        Message("system", "S"),
        Message("user", "q1"),
        Message("assistant", "a1", reasoning="secret thoughts"),
        Message("user", "q2"),
    ]
    assert render_chat(msgs, thinking=True) == (
        f"{BOS}S{U}q1{A}</think>a1{EOS}{U}q2{A}<think>"
    )
    assert render_chat(msgs, thinking=False) == (
        f"{BOS}S{U}q1{A}</think>a1{EOS}{U}q2{A}</think>"
    )


def test_render_assistant_after_last_user_keeps_reasoning_in_thinking_mode() -> None:
    msgs = [Message("user", "q"), Message("assistant", "answer", reasoning="because")]
    assert render_chat(msgs, thinking=True) == f"{BOS}{U}q{A}<think>because</think>answer{EOS}"
    assert render_chat(msgs, thinking=False) == f"{BOS}{U}q{A}</think>answer{EOS}"


def test_render_consecutive_user_turns_share_one_header() -> None:
    msgs = [Message("user", "part 1"), Message("user", "part 2")]
    assert render_chat(msgs, thinking=False) == f"{BOS}{U}part 1{U}part 2{A}</think>"


def test_message_validation() -> None:
    with pytest.raises(ValueError, match="role"):
        Message("tool", "x")
    with pytest.raises(ValueError, match="reasoning"):
        Message("user", "x", reasoning="y")


def test_encode_chat(tok: Tokenizer) -> None:
    msgs = [Message("system", "Sys"), Message("user", "Hello there")]
    ids = encode_chat(msgs, tok, thinking=True)
    assert ids[0] == tok.bos_id
    assert ids[1:] == tok.encode(render_chat(msgs, thinking=True, add_bos=False))
    assert ids[-2:] == [tok.token_id(A), tok.token_id("<think>")]
    assert tok.token_id(U) in ids
    assert tok.decode(ids) == render_chat(msgs, thinking=True)
    assert encode_chat(msgs, tok, thinking=False, add_bos=False)[0] != tok.bos_id


def _run(parser: ReplyParser, ids: list[int]) -> list[Delta]:
    out: list[Delta] = []
    for i in ids:
        out += parser.feed(i)
    out += parser.finish()
    return out


def _text(deltas: list[Delta], kind: str) -> str:
    return "".join(d.text for d in deltas if d.kind == kind)


def _assert_clean(deltas: list[Delta]) -> None:
    for d in deltas:
        assert d.text
        for s in ("<think>", "</think>", EOS, BOS, U, A, "\ufffd"):
            assert s not in d.text


def test_reply_parser_thinking_mode(tok: Tokenizer) -> None:
    reasoning = "Let me think… 日本語 😀 about it."
    content = "The answer is 42 🎉."
    ids = tok.encode(reasoning) + [tok.token_id("</think>")] + tok.encode(content) + [tok.eos_id]
    parser = ReplyParser(tok, thinking=True)
    assert parser.in_reasoning
    deltas = _run(parser, ids)
    assert _text(deltas, "reasoning") == reasoning
    assert _text(deltas, "content") == content
    assert parser.reasoning == reasoning and parser.content == content
    # Reasoning strictly precedes content.
    kinds = [d.kind for d in deltas]
    assert kinds == sorted(kinds, key=lambda k: k == "content")
    _assert_clean(deltas)
    assert parser.finished
    assert parser.feed(tok.encode("late")[0]) == []


def test_reply_parser_thinking_mode_ignores_repeated_think_open(tok: Tokenizer) -> None:
    think, end = tok.token_id("<think>"), tok.token_id("</think>")
    ids = [think] + tok.encode("hmm") + [end] + tok.encode("ok")
    deltas = _run(ReplyParser(tok, thinking=True), ids)
    assert _text(deltas, "reasoning") == "hmm"
    assert _text(deltas, "content") == "ok"
    _assert_clean(deltas)


def test_reply_parser_chat_mode(tok: Tokenizer) -> None:
    ids = tok.encode("Hello, 世界!") + [tok.eos_id] + tok.encode("after eos")
    parser = ReplyParser(tok, thinking=False)
    deltas = _run(parser, ids)
    assert _text(deltas, "content") == "Hello, 世界!"
    assert _text(deltas, "reasoning") == ""
    _assert_clean(deltas)


def test_reply_parser_chat_mode_stray_think_goes_to_reasoning(tok: Tokenizer) -> None:
    ids = (
        tok.encode("a ")
        + [tok.token_id("<think>")]
        + tok.encode("hidden")
        + [tok.token_id("</think>")]
        + tok.encode("b")
        + [tok.token_id(A), tok.eos_id]
    )
    deltas = _run(ReplyParser(tok, thinking=False), ids)
    assert _text(deltas, "content") == "a b"
    assert _text(deltas, "reasoning") == "hidden"
    _assert_clean(deltas)


def test_reply_parser_streams_incrementally(tok: Tokenizer) -> None:
    parser = ReplyParser(tok, thinking=False)
    ids = tok.encode("😀")
    assert len(ids) > 1
    for i in ids[:-1]:
        assert parser.feed(i) == []
    assert parser.feed(ids[-1]) == [Delta("content", "😀")]
    # Other special tokens (tool-call markup) stay in the text.
    assert parser.feed(tok.token_id("｜DSML｜")) == [Delta("content", "｜DSML｜")]
