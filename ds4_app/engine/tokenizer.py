"""The DS4 tokenizer: byte-level BPE read from GGUF metadata, and a streaming detokenizer.

DS4 models ship a GPT-2 style byte-level BPE (`ds4_spec.md` §10): every token is a string over
the 256 "byte-level unicode" characters of GPT-2 (`bytes_to_unicode`), plus control tokens such
as ``<｜begin▁of▁sentence｜>`` whose text is literal. GGUF stores it under ``tokenizer.ggml.*``
(§11.2). This module turns that metadata into a `tokenizers.Tokenizer` (encode/decode in Rust),
and adds what the service needs around it:

- `TokenizerData`: the plain vocabulary as stored in a GGUF file, checked once when built;
- `build_synthetic_vocab`: a small, valid, deterministic vocabulary for the embedded test models,
  learned here from a short public-domain corpus so no download is ever needed;
- `StreamDecoder`: turns generated ids into text one token at a time without ever splitting a
  UTF-8 character, in O(1) per token.

Pre-tokenizer. GGUF declares ``tokenizer.ggml.pre = "joyai-llm"``. llama.cpp maps that name (and
``deepseek-v3``) to three split regexes applied in sequence, the same three that DeepSeek-V3's
HF ``tokenizer.json`` declares as a ``Sequence`` of ``Split(behavior="isolated")``: digits in runs
of at most 3; runs of CJK ideographs / Hiragana / Katakana; then the GPT-style rule (an ASCII
punctuation mark glued to following ASCII letters; letters/marks with an optional non-letter
prefix; optional space + punctuation/symbols with trailing newlines; whitespace ending in
newlines; whitespace not followed by non-space; other whitespace). We use exactly those regexes
followed by ``ByteLevel(add_prefix_space=False, use_regex=False)``. The approximation: DS4 itself
re-implements these rules by hand in C (`bpe_tokenize_text`) with its own trailing-whitespace
handling, so on rare inputs (unusual Unicode categories, whitespace at the very end of a text)
its pieces, and hence ids, may differ from ours. Decoding is unaffected: any id sequence decodes
to the same bytes.

Special tokens. Control (type 3) and user-defined (type 4) tokens, and every DS4 special token of
§10 present in the vocabulary, are registered as special added tokens, so their strings inside a
text encode to their single id (as the official encoder, which renders prompts as text, relies
on). A side effect users should know: a user message that contains such a string literally is
encoded as that control token, exactly as with DS4's own encoder.
"""

from __future__ import annotations

import codecs
import hashlib
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

# --- DS4 special tokens (ds4_spec.md §10). Ids other than BOS=0/EOS=1 are looked up by string. ---
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
DSML_TOKEN = "｜DSML｜"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
TASK_TOKENS: tuple[str, ...] = (
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
)
DS4_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    THINK_START_TOKEN,
    THINK_END_TOKEN,
    DSML_TOKEN,
    LATEST_REMINDER_TOKEN,
    *TASK_TOKENS,
)

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6
_SPECIAL_TYPES = frozenset({TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED})

# Pre-tokenizer names that mean the DS4 / DeepSeek-V3 split rules (llama.cpp treats them alike).
SUPPORTED_PRE = ("joyai-llm", "deepseek-v3")

_SPLIT_DIGITS = r"\p{N}{1,3}"
_SPLIT_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_SPLIT_MAIN = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
    r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    # Printable Latin-1 bytes map to themselves; the rest are shifted past 255 so that no token
    # string contains whitespace or control characters.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE: Mapping[int, str] = _bytes_to_unicode()
UNICODE_TO_BYTE: Mapping[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}


def _make_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The DS4 "joyai-llm" split rules followed by the byte-level mapping (see module doc)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_DIGITS), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(_SPLIT_CJK), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(_SPLIT_MAIN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


@dataclass(frozen=True, slots=True)
class TokenizerData:
    """A byte-level BPE vocabulary exactly as GGUF stores it (`tokenizer.ggml.*`).

    ``tokens[i]`` is token i in GPT-2 byte-level unicode form (control tokens are literal text);
    ``merges`` are "left right" strings in priority order; ``token_types`` are GGUF token types
    (1 normal, 3 control, 4 user-defined, 5 unused). Checked once here, then passed around.
    """

    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    token_types: tuple[int, ...]
    bos_id: int
    eos_id: int
    pre: str = "joyai-llm"

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0:
            raise ValueError("tokenizer has no tokens")
        if len(self.token_types) != n:
            raise ValueError(
                f"tokenizer has {n} tokens but {len(self.token_types)} token types; "
                "the model file's tokenizer metadata is inconsistent"
            )
        for name, tid in (("bos", self.bos_id), ("eos", self.eos_id)):
            if not 0 <= tid < n:
                raise ValueError(
                    f"tokenizer {name} id {tid} is outside the vocabulary of {n} tokens"
                )
        if self.pre not in SUPPORTED_PRE:
            raise ValueError(
                f"unsupported pre-tokenizer {self.pre!r}; this app implements the DS4 rules "
                f"({', '.join(SUPPORTED_PRE)})"
            )
        for i, merge in enumerate(self.merges):
            # Byte-level tokens never contain a literal space (it is mapped to "Ġ"), so a merge is
            # valid only if it has exactly one.
            if merge.count(" ") != 1 or merge.startswith(" ") or merge.endswith(" "):
                raise ValueError(
                    f"tokenizer merge {i} is malformed: {merge!r} (expected 'left right')"
                )

    @classmethod
    def from_metadata(cls, kv: Mapping[str, Any]) -> TokenizerData:
        """Read the tokenizer from GGUF key/values (plain Python values); `ValueError` if not."""

        def need(key: str) -> Any:
            if key not in kv:
                raise ValueError(f"model file has no {key}; it does not carry a DS4 tokenizer")
            return kv[key]

        model = need("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"tokenizer.ggml.model is {model!r}; DS4 needs a byte-level BPE ('gpt2')"
            )
        pre = need("tokenizer.ggml.pre")
        if not isinstance(pre, str):
            raise ValueError(f"tokenizer.ggml.pre must be a string, got {type(pre).__name__}")
        tokens = _str_tuple(need("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens")
        merges = _str_tuple(need("tokenizer.ggml.merges"), "tokenizer.ggml.merges")
        types = _int_tuple(need("tokenizer.ggml.token_type"), "tokenizer.ggml.token_type")
        bos = _int_value(need("tokenizer.ggml.bos_token_id"), "tokenizer.ggml.bos_token_id")
        eos = _int_value(need("tokenizer.ggml.eos_token_id"), "tokenizer.ggml.eos_token_id")
        return cls(tokens=tokens, merges=merges, token_types=types, bos_id=bos, eos_id=eos, pre=pre)

    def metadata_items(self) -> list[tuple[str, Any, str]]:
        """(key, value, kind) for a GGUF writer: the keys `from_metadata` reads, plus eot/add_bos.

        kind is one of "string", "uint32", "bool", "string_array", "int32_array".
        """
        return [
            ("tokenizer.ggml.model", "gpt2", "string"),
            ("tokenizer.ggml.pre", self.pre, "string"),
            ("tokenizer.ggml.tokens", list(self.tokens), "string_array"),
            ("tokenizer.ggml.merges", list(self.merges), "string_array"),
            ("tokenizer.ggml.token_type", list(self.token_types), "int32_array"),
            ("tokenizer.ggml.bos_token_id", self.bos_id, "uint32"),
            ("tokenizer.ggml.eos_token_id", self.eos_id, "uint32"),
            ("tokenizer.ggml.eot_token_id", self.eos_id, "uint32"),
            ("tokenizer.ggml.add_bos_token", True, "bool"),
        ]


def _str_tuple(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{key} must be a list of strings, got {type(value).__name__}")
    out = tuple(value)
    for item in out:
        if not isinstance(item, str):
            raise ValueError(f"{key} must be a list of strings, found {type(item).__name__}")
    return out


def _int_tuple(value: Any, key: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{key} must be a list of integers, got {type(value).__name__}")
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a list of integers") from None


def _int_value(value: Any, key: str) -> int:
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be an integer, got {value!r}") from None


# --- Synthetic vocabulary -------------------------------------------------------------------

# Public-domain text (Shakespeare: Sonnets 18 and 116, Hamlet III.1, As You Like It II.7, Macbeth
# V.5, Julius Caesar III.2, The Tempest IV.1; Genesis 1:1-5 (KJV); Lincoln's Gettysburg Address;
# the Declaration of Independence) and lines written for this module with numbers, markup, code
# and a little Chinese and Japanese, so the learned merges cover the shapes chat text has.
# Changing it changes every synthetic vocabulary: treat it as frozen.
_CORPUS = """\
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall Death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.

To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep: perchance to dream: ay, there's the rub;
For in that sleep of death what dreams may come
When we have shuffled off this mortal coil,
Must give us pause.

All the world's a stage,
And all the men and women merely players;
They have their exits and their entrances,
And one man in his time plays many parts,
His acts being seven ages.

Tomorrow, and tomorrow, and tomorrow,
Creeps in this petty pace from day to day,
To the last syllable of recorded time;
And all our yesterdays have lighted fools
The way to dusty death. Out, out, brief candle!
Life's but a walking shadow, a poor player,
That struts and frets his hour upon the stage,
And then is heard no more. It is a tale
Told by an idiot, full of sound and fury,
Signifying nothing.

Let me not to the marriage of true minds
Admit impediments. Love is not love
Which alters when it alteration finds,
Or bends with the remover to remove.
O no! it is an ever-fixed mark
That looks on tempests and is never shaken;
It is the star to every wand'ring bark,
Whose worth's unknown, although his height be taken.
Love's not Time's fool, though rosy lips and cheeks
Within his bending sickle's compass come;
Love alters not with his brief hours and weeks,
But bears it out even to the edge of doom.
If this be error and upon me prov'd,
I never writ, nor no man ever lov'd.

Friends, Romans, countrymen, lend me your ears;
I come to bury Caesar, not to praise him.
The evil that men do lives after them;
The good is oft interred with their bones;
So let it be with Caesar.

Our revels now are ended. These our actors,
As I foretold you, were all spirits and
Are melted into air, into thin air:
And, like the baseless fabric of this vision,
The cloud-capp'd towers, the gorgeous palaces,
The solemn temples, the great globe itself,
Yea, all which it inherit, shall dissolve
And, like this insubstantial pageant faded,
Leave not a rack behind. We are such stuff
As dreams are made on, and our little life
Is rounded with a sleep.

In the beginning God created the heaven and the earth. And the earth was without form, and
void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face of
the waters. And God said, Let there be light: and there was light. And God saw the light, that
it was good: and God divided the light from the darkness. And God called the light Day, and the
darkness he called Night. And the evening and the morning were the first day.

Four score and seven years ago our fathers brought forth on this continent, a new nation,
conceived in Liberty, and dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. We
have come to dedicate a portion of that field, as a final resting place for those who here gave
their lives that that nation might live. It is altogether fitting and proper that we should do
this.

But, in a larger sense, we can not dedicate, we can not consecrate, we can not hallow this
ground. The brave men, living and dead, who struggled here, have consecrated it, far above our
poor power to add or detract. The world will little note, nor long remember what we say here,
but it can never forget what they did here. It is for us the living, rather, to be dedicated
here to the unfinished work which they who fought here have thus far so nobly advanced. It is
rather for us to be here dedicated to the great task remaining before us: that from these
honored dead we take increased devotion to that cause for which they gave the last full measure
of devotion; that we here highly resolve that these dead shall not have died in vain; that this
nation, under God, shall have a new birth of freedom; and that government of the people, by the
people, for the people, shall not perish from the earth.

We hold these truths to be self-evident, that all men are created equal, that they are endowed
by their Creator with certain unalienable Rights, that among these are Life, Liberty and the
pursuit of Happiness.

The assistant reads the question, thinks about it, and then writes a clear answer.
It can count: 1, 2, 3, 10, 42, 100, 128, 256, 512, 1024, 2048, 4096 and 65536.
Dates such as 2024-05-01 and times such as 12:30 appear in the text; so does 3.14159.
Here is a short list:
- the first item
- the second item
- the third item

```python
def add(a, b):
    return a + b


for i in range(10):
    print(i, add(i, i))
```

**Note:** "Hello, world!" is the classic first program. What is your question?

User: Can you explain what a tokenizer does?
Assistant: Sure. A tokenizer splits text into small pieces called tokens, and maps each piece
to a number. The model reads and writes those numbers; the tokenizer turns them back into text.

| name  | value | unit |
|-------|-------|------|
| speed | 27.5  | km/h |
| total | 1,250 | USD  |

{"role": "user", "content": "What time is it?", "max_tokens": 64, "stream": true}

你好！我是一个助手。今天天气很好，我们去公园散步吧。
こんにちは、世界。ありがとうございます。
"""


def _learn_merges(seed: int, max_merges: int, min_count: int = 1) -> list[tuple[str, str]]:
    """Byte-level BPE merges learned from `_CORPUS`, deterministically.

    Standard BPE training on pre-tokenized pieces with incremental pair counts, run until every
    piece is a single token (about 1300 merges with ``min_count`` 1). Ties between
    equally frequent pairs are broken explicitly: lexicographically by (left, right) for seed 0,
    else by a keyed hash of the pair, so other seeds give different but equally valid merges.
    """
    pieces: dict[str, int] = {}
    for piece, _ in _make_pre_tokenizer().pre_tokenize_str(_CORPUS):
        pieces[piece] = pieces.get(piece, 0) + 1
    words = [list(p) for p in sorted(pieces)]
    freqs = [pieces[p] for p in sorted(pieces)]

    key_bytes = seed.to_bytes(8, "little", signed=True)

    def tie_key(pair: tuple[str, str]) -> tuple[Any, ...]:
        if seed == 0:
            return pair
        h = hashlib.blake2b(f"{pair[0]} {pair[1]}".encode(), digest_size=8, key=key_bytes).digest()
        return (h, pair)

    counts: dict[tuple[str, str], int] = {}
    where: dict[tuple[str, str], set[int]] = {}
    for wi, (w, f) in enumerate(zip(words, freqs)):
        for pair in zip(w, w[1:]):
            counts[pair] = counts.get(pair, 0) + f
            where.setdefault(pair, set()).add(wi)
    # Max-heap with lazy invalidation: an entry is live only if its count is still current.
    heap = [(-c, tie_key(p), p) for p, c in counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[str, str]] = []
    while heap and len(merges) < max_merges:
        neg, _, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -neg:
            continue
        if -neg < min_count:
            break
        merges.append(pair)
        a, b = pair
        merged = a + b
        touched: set[tuple[str, str]] = set()
        for wi in sorted(where.pop(pair, ())):
            w, f = words[wi], freqs[wi]
            for old in zip(w, w[1:]):
                counts[old] -= f
                touched.add(old)
            out: list[str] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[wi] = out
            for new in zip(out, out[1:]):
                counts[new] = counts.get(new, 0) + f
                where.setdefault(new, set()).add(wi)
                touched.add(new)
        counts.pop(pair, None)
        for p in touched:
            c = counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, tie_key(p), p))
            else:
                counts.pop(p, None)
    return merges


_MAX_SYNTHETIC_MERGES = 4096


def build_synthetic_vocab(n_vocab: int, seed: int = 0) -> TokenizerData:
    """A valid byte-level BPE vocabulary of exactly ``n_vocab`` tokens, the same on every machine.

    Layout: 0 BOS, 1 EOS, then the other DS4 special tokens of §10 (control), the 256 byte tokens,
    the tokens of the merges learned from a small embedded English corpus (a prefix of the merge
    list, as many as fit), then unused ``<｜place▁holder▁no▁N｜>`` tokens up to ``n_vocab``
    (as the real 129280-row vocabulary pads its tail). ``seed`` only changes tie-breaking.
    """
    n_fixed = len(DS4_SPECIAL_TOKENS) + 256
    if n_vocab < 512:
        raise ValueError(f"synthetic vocabulary needs n_vocab >= 512, got {n_vocab}")
    tokens: list[str] = list(DS4_SPECIAL_TOKENS)
    types: list[int] = [TOKEN_TYPE_CONTROL] * len(DS4_SPECIAL_TOKENS)
    tokens += [BYTE_TO_UNICODE[b] for b in range(256)]
    types += [TOKEN_TYPE_NORMAL] * 256
    assert len(tokens) == n_fixed

    present = set(tokens)
    merges: list[str] = []
    for a, b in _learn_merges(seed, _MAX_SYNTHETIC_MERGES):
        merged = a + b
        if merged not in present:
            # Stop at the first merge that does not fit, so the kept merges stay a prefix of the
            # learned list and every merge's parts are in the vocabulary.
            if len(tokens) == n_vocab:
                break
            tokens.append(merged)
            types.append(TOKEN_TYPE_NORMAL)
            present.add(merged)
        merges.append(f"{a} {b}")
    n_pad = n_vocab - len(tokens)
    tokens += [f"<｜place▁holder▁no▁{i}｜>" for i in range(n_pad)]
    types += [TOKEN_TYPE_UNUSED] * n_pad
    return TokenizerData(
        tokens=tuple(tokens), merges=tuple(merges), token_types=tuple(types), bos_id=0, eos_id=1
    )


# --- Tokenizer ------------------------------------------------------------------------------


class Tokenizer:
    """Encode and decode DS4 text with a `tokenizers` byte-level BPE built from `TokenizerData`.

    Thread-safe for concurrent encode/decode. No BOS is added by `encode`; the chat layer adds it.
    """

    __slots__ = ("_data", "_hf", "_token_to_id", "_special_ids", "_byte_cache")

    def __init__(self, data: TokenizerData) -> None:
        self._data = data
        vocab: dict[str, int] = {}
        for i, tok in enumerate(data.tokens):
            # A vocabulary with a repeated string keeps its first id for encoding; decoding of
            # every id still works through the token list.
            vocab.setdefault(tok, i)
        self._token_to_id = vocab
        merges = [tuple(m.split(" ")) for m in data.merges]
        try:
            model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        except Exception as exc:  # tokenizers raises a plain Exception for bad merges
            raise ValueError(f"tokenizer merges do not fit the vocabulary: {exc}") from None
        hf = _HFTokenizer(model)
        hf.pre_tokenizer = _make_pre_tokenizer()
        hf.decoder = decoders.ByteLevel()
        special: set[int] = {
            i for i, t in enumerate(data.token_types) if t in _SPECIAL_TYPES
        }
        for s in DS4_SPECIAL_TOKENS:
            if s in vocab:
                special.add(vocab[s])
        special.update((data.bos_id, data.eos_id))
        hf.add_special_tokens(
            [AddedToken(data.tokens[i], special=True, normalized=False) for i in sorted(special)]
        )
        self._hf = hf
        self._special_ids = frozenset(special)
        self._byte_cache: dict[int, bytes] = {}

    @classmethod
    def from_data(cls, data: TokenizerData) -> Tokenizer:
        """Build a tokenizer from a checked vocabulary."""
        return cls(data)

    @classmethod
    def from_metadata(cls, kv: Mapping[str, Any]) -> Tokenizer:
        """Build a tokenizer from GGUF key/values; `ValueError` if they do not describe one."""
        return cls(TokenizerData.from_metadata(kv))

    @property
    def data(self) -> TokenizerData:
        """The vocabulary this tokenizer was built from (for writing it back to a GGUF file)."""
        return self._data

    @property
    def bos_id(self) -> int:
        """Id of ``<｜begin▁of▁sentence｜>`` (or whatever the file declares as BOS)."""
        return self._data.bos_id

    @property
    def eos_id(self) -> int:
        """Id of ``<｜end▁of▁sentence｜>``: generation stops here."""
        return self._data.eos_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids (embedding rows)."""
        return len(self._data.tokens)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids matched by string in text and decoded literally (control and DS4 special tokens)."""
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings map to their single id; no BOS added."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens appear as their strings; bad UTF-8 becomes U+FFFD."""
        ids = list(ids)
        for i in ids:
            self._check_id(i)
        return self._hf.decode(ids, skip_special_tokens=False)

    def token_id(self, s: str) -> int:
        """Id of the token whose (byte-level) string is ``s``; `KeyError` if there is none."""
        try:
            return self._token_to_id[s]
        except KeyError:
            raise KeyError(f"token {s!r} is not in this model's vocabulary") from None

    def token_text(self, token_id: int) -> str:
        """The token's string as stored (byte-level form for ordinary tokens)."""
        self._check_id(token_id)
        return self._data.tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a special token's UTF-8 text)."""
        b = self._byte_cache.get(token_id)
        if b is None:
            self._check_id(token_id)
            tok = self._data.tokens[token_id]
            if token_id in self._special_ids:
                b = tok.encode("utf-8")
            else:
                try:
                    b = bytes(UNICODE_TO_BYTE[c] for c in tok)
                except KeyError:
                    # Not a byte-level string (e.g. an unused placeholder): its text is literal.
                    b = tok.encode("utf-8")
            self._byte_cache[token_id] = b
        return b

    def stream_decoder(self) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence."""
        return StreamDecoder(self)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._data.tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")


class StreamDecoder:
    """Turns generated ids into text one at a time, never splitting a UTF-8 character.

    Each `push` maps the token to its bytes (cached per id) and feeds them to an incremental
    UTF-8 decoder that holds back an incomplete character until its last byte arrives, so the
    work per token is constant however long the reply. Special tokens yield their string; bytes
    left incomplete before one (which valid output never produces) become U+FFFD.
    """

    __slots__ = ("_tokenizer", "_utf8")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        tok = self._tokenizer
        if token_id in tok.special_ids:
            head = self._utf8.decode(b"", final=True)
            self._utf8.reset()
            return head + tok.token_text(token_id)
        return self._utf8.decode(tok.token_bytes(token_id))

    def flush(self) -> str:
        """End of sequence: return any held-back bytes (U+FFFD for an incomplete character)."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
