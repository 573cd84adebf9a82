"""The tokenizers prepare.py can write data with: char (one token per character, the default) and tiktoken's
byte-level BPE (gpt2, r50k_base, cl100k_base, o200k_base, or any encoding a tiktoken plugin registers).
Both turn text into ids (`encode`, `encode_array` for long texts) and back (`decode`), and say which
characters they cannot encode (`unknown`); tokenizer_from_meta rebuilds one from meta.json."""

import difflib
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import tiktoken

from config import UserError

END_OF_TEXT = "<|endoftext|>"
# Where to cut a long text: just before a space, or just after a newline, between two non-space characters.
# The split patterns of tiktoken's own encodings (gpt2 to o200k) never match across such a point, so the
# pieces encode to the ids of the whole text (another encoding's may differ at a cut, and decode the same).
_CUT = re.compile(r"(?<=\S)(?= \S)|(?<=\S\n)(?=\S)")


def cut_point(text, end, window=1 << 13):
    """The last cut point at or before `end` (searching back up to `window`), else end."""
    starts = [m.start() for m in _CUT.finditer(text, max(0, end - window), end)]
    return starts[-1] if starts and starts[-1] > 0 else end


class CharTokenizer:
    """One token per character; the vocabulary is the text's sorted characters."""

    kind = "char"

    def __init__(self, chars):
        self.chars = list(chars)
        self.vocab_size = len(self.chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self._table = None

    @classmethod
    def from_texts(cls, texts):
        """The tokenizer for all the characters in texts, an iterable of strings, in one pass."""
        seen, known = np.zeros(0x110000, dtype=bool), b""  # a flag per code point; the ASCII ones seen
        for text in texts:
            if text.isascii():  # the fast path: delete the known characters, which usually leaves none
                seen[np.frombuffer(text.encode("ascii").translate(None, known), dtype=np.uint8)] = True
            else:
                seen[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)] = True
            known = np.flatnonzero(seen[:128]).astype(np.uint8).tobytes()
        return cls(chr(c) for c in np.flatnonzero(seen))

    def encode(self, text):
        return [self.stoi[ch] for ch in text]

    def encode_array(self, text, threads=1):
        """encode() as an array, at C speed: a table lookup per character. A character
        outside the vocabulary gets a wrong id, so check unknown() first."""
        if self._table is None:
            self._table = np.full(0x110000, self.vocab_size, dtype=np.uint32)  # every code point
            self._table[[ord(ch) for ch in self.chars]] = np.arange(self.vocab_size)
            # ASCII characters sort first, so their ids fit in a byte: bytes.translate can map them.
            self._ascii = self._table[:256].clip(max=255).astype(np.uint8).tobytes()
        if text.isascii():  # a constant-time check in CPython
            return np.frombuffer(text.encode("ascii").translate(self._ascii), dtype=np.uint8)
        return np.take(self._table, np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32))

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

    def unknown(self, text):
        """The characters of text this tokenizer has no token for, in order of first use."""
        return list(dict.fromkeys(ch for ch in text if ch not in self.stoi))

    def meta(self):
        return {"tokenizer": self.kind, "vocab": self.chars}


def load_encoding(name):
    """tiktoken's encoding `name`. The named ones download their files on first use and
    keep them in a cache; that download is the one thing that can fail here."""
    known = tiktoken.list_encoding_names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UserError(f"unknown tokenizer {name!r}{hint}; use char or a tiktoken encoding: {', '.join(known)}")
    try:
        return tiktoken.get_encoding(name)
    except (OSError, ValueError) as e:  # requests' errors are OSErrors; a bad download's hash a ValueError
        raise UserError(
            f"tiktoken encoding {name!r} needs a download of its files on first use, and it failed "
            f"({type(e).__name__}); connect once, or pre-seed the cache: on a machine that is online run "
            f"TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; tiktoken.get_encoding('{name}')\", "
            "copy DIR here and set TIKTOKEN_CACHE_DIR=DIR") from None


class TiktokenTokenizer:
    """Byte-level BPE from tiktoken. Every text has tokens, so nothing is unknown."""

    kind = "tiktoken"

    def __init__(self, name):
        self.name = name
        self.encoding = load_encoding(name)
        self.vocab_size = self.encoding.n_vocab
        special = self.encoding.special_tokens_set
        self.eot_token = self.encoding.encode_single_token(END_OF_TEXT) if END_OF_TEXT in special else None

    def encode(self, text):
        # Text that looks like a special token stays text: data cannot forge an end-of-text.
        return self.encoding.encode_ordinary(text)

    def encode_array(self, text, threads=1):
        """encode() as a uint32 array; `threads` pieces, cut where the ids do not change, are encoded at once
        (tiktoken releases the GIL). Not encode_ordinary_batch, whose lists of ints took prepare.py's BPE
        from 26 to 15 MB/s and 294 to 375 MiB (docs/results.md)."""
        encode = partial(self.encoding.encode_to_numpy, disallowed_special=())  # no Python list in between
        bounds = [0] + [cut_point(text, len(text) * k // threads) for k in range(1, threads)] + [len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
        if len(pieces) < 2:
            return encode(text)
        with ThreadPoolExecutor(len(pieces)) as pool:
            return np.concatenate(list(pool.map(encode, pieces)))

    def decode(self, ids):
        return self.encoding.decode([int(i) for i in ids])

    def unknown(self, text):
        return []

    def meta(self):
        return {"tokenizer": self.kind, "encoding": self.name}


def tokenizer_from_meta(meta):
    """Rebuilds the tokenizer that wrote a data set, from its meta.json contents."""
    if meta.get("tokenizer") == "char":
        return CharTokenizer(meta["vocab"])
    if meta.get("tokenizer") == "tiktoken":
        tokenizer = TiktokenTokenizer(meta["encoding"])
        if tokenizer.vocab_size != meta["vocab_size"]:
            raise UserError(f"tiktoken encoding {meta['encoding']!r} now has {tokenizer.vocab_size} tokens, but the "
                            f"data was prepared with {meta['vocab_size']}; prepare the data again")
        return tokenizer
    raise UserError(f"unknown tokenizer {meta.get('tokenizer')!r} in meta.json; prepare the data again")
