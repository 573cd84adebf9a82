"""Turns a text file into token files that train.py reads.

    python prepare.py --input notes.txt          # -> data/notes_char/
    python prepare.py                            # Tiny Shakespeare, downloaded

Writes DIR/train.bin and DIR/val.bin (token ids, numpy uint16, or uint32 for
vocabularies past 65,536) and DIR/meta.json, which holds all that is needed to
rebuild the tokenizer and read the bins. The first (1 - val_fraction) of the
text is for training, the rest for validation.
"""

import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from config import UserError, cli, load_config, option

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
META_FORMAT = 1


@dataclass
class PrepareConfig:
    input: str = option("", "text file to prepare (UTF-8); empty: download Tiny Shakespeare")
    out_dir: str = option("", "where to write the bins and meta.json; empty: data/<input stem>_char")
    val_fraction: float = option(0.1, "fraction of the text, taken from its end, kept for validation")
    url: str = option(SHAKESPEARE_URL, "where to fetch Tiny Shakespeare from when no --input is given")


# --- Tokenizers ------------------------------------------------------------------


class CharTokenizer:
    """One token per character; the vocabulary is the text's sorted characters."""

    kind = "char"

    def __init__(self, chars):
        self.chars = list(chars)
        self.vocab_size = len(self.chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    def encode(self, text):
        return [self.stoi[ch] for ch in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

    def unknown(self, text):
        """The characters of text this tokenizer has no token for, in order of first use."""
        return list(dict.fromkeys(ch for ch in text if ch not in self.stoi))

    def meta(self):
        return {"tokenizer": self.kind, "vocab": self.chars}


def tokenizer_from_meta(meta):
    """Rebuilds the tokenizer that wrote a data set, from its meta.json contents."""
    if meta.get("tokenizer") == "char":
        return CharTokenizer(meta["vocab"])
    raise UserError(f"unknown tokenizer {meta.get('tokenizer')!r} in meta.json; prepare the data again")


# --- Reading prepared data -------------------------------------------------------


def read_meta(data_dir):
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UserError(f"{path} not found; run: python prepare.py --input FILE --out_dir {data_dir}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path} is not valid JSON; run prepare.py again") from None
    if meta.get("format", 0) > META_FORMAT:
        raise UserError(f"{path} is format {meta['format']}, newer than this code ({META_FORMAT}); update the code")
    return meta


def open_split(data_dir, split, meta):
    """The tokens of one split as a read-only memmap, checked against meta.json."""
    path = Path(data_dir) / f"{split}.bin"
    if not path.is_file():
        raise UserError(f"{path} not found; run prepare.py again for {data_dir}")
    dtype = np.dtype(meta["dtype"])
    expected = meta[f"{split}_tokens"]
    if path.stat().st_size != expected * dtype.itemsize:
        raise UserError(
            f"{path} holds {path.stat().st_size} bytes but meta.json says {expected} {dtype.name} tokens; "
            "run prepare.py again")
    return np.memmap(path, dtype=dtype, mode="r")


# --- Writing -----------------------------------------------------------------------


def read_text(path):
    """The text of a UTF-8 file, or a UserError saying what is wrong with it."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"input file {path} not found")
    if path.is_dir():
        raise UserError(f"input {path} is a directory; pass a text file")
    data = path.read_bytes()
    if not data:
        raise UserError(f"input file {path} is empty; pass a file with some text in it")
    if b"\x00" in data:
        raise UserError(f"input file {path} looks binary (NUL byte at offset {data.index(0)}); pass a text file")
    try:
        return data.decode("utf-8"), hashlib.sha256(data).hexdigest()
    except UnicodeDecodeError as e:
        raise UserError(
            f"input file {path} is not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
            "convert it, e.g. iconv -f latin1 -t utf-8") from None


def write_atomic(path, data):
    """Writes bytes to path so that a crash leaves the old file or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def download_shakespeare(url, dest):
    """Fetches Tiny Shakespeare into dest unless it is already there; checks its sha256."""
    dest = Path(dest)
    if dest.is_file():
        return dest
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(
            f"could not download Tiny Shakespeare from {url} ({reason}); "
            "if you are offline, pass a text file of your own: python prepare.py --input FILE") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise UserError(
            f"the file downloaded from {url} has sha256 {digest[:12]}..., expected {SHAKESPEARE_SHA256[:12]}...; "
            "nothing was saved. Try again later, or pass --input FILE")
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(dest, data)
    print(f"downloaded Tiny Shakespeare to {dest}")
    return dest


def split_tokens(ids, val_fraction, source):
    n_train = int(len(ids) * (1 - val_fraction))
    if n_train < 2 or len(ids) - n_train < 2:
        raise UserError(
            f"{source} gives {len(ids)} tokens, too few to split into train and val at val_fraction "
            f"{val_fraction}; use a longer text")
    return ids[:n_train], ids[n_train:]


def write_dataset(out_dir, train_ids, val_ids, meta):
    """Writes the bins and meta.json; meta.json goes last, so its presence means complete."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "meta.json").unlink(missing_ok=True)
        write_atomic(out_dir / "train.bin", train_ids.tobytes())
        write_atomic(out_dir / "val.bin", val_ids.tobytes())
        write_atomic(out_dir / "meta.json", (json.dumps(meta, indent=1, ensure_ascii=False) + "\n").encode())
    except OSError as e:
        raise UserError(f"cannot write to {out_dir} ({e.strerror}); pick another --out_dir") from None


@cli
def main(argv):
    cfg = load_config(PrepareConfig, argv, "prepare.py", __doc__.strip().splitlines()[0])
    if not 0 < cfg.val_fraction < 1:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {cfg.val_fraction}")
    if cfg.input:
        input_path, out_dir = Path(cfg.input), cfg.out_dir or f"data/{Path(cfg.input).stem}_char"
    else:
        out_dir = cfg.out_dir or "data/shakespeare_char"
        input_path = download_shakespeare(cfg.url, Path(out_dir) / "input.txt")
    text, sha256 = read_text(input_path)

    tokenizer = CharTokenizer(sorted(set(text)))
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    ids = np.array(tokenizer.encode(text), dtype=dtype)
    train_ids, val_ids = split_tokens(ids, cfg.val_fraction, input_path)
    meta = {
        "format": META_FORMAT,
        **tokenizer.meta(),
        "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name,
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "source": input_path.name,
        "sha256": sha256,
    }
    write_dataset(out_dir, train_ids, val_ids, meta)
    print(f"{len(text):,} characters, vocabulary of {tokenizer.vocab_size}, "
          f"{len(train_ids):,} train and {len(val_ids):,} val tokens -> {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
