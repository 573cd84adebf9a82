"""Turns text files into token files that train.py reads.

    python prepare.py --input notes.txt                    # -> data/notes_char/
    python prepare.py --input notes.txt --tokenizer gpt2   # -> data/notes_gpt2/
    python prepare.py --input a.txt --input b.txt          # several documents
    python prepare.py --input books/                       # a directory: its *.txt, sorted
    python prepare.py                                      # Tiny Shakespeare, downloaded -> data/shakespeare_char/
    python prepare.py --input input.txt                    # Tiny Shakespeare (by its sha256) -> the same

Writes DIR/train.bin and DIR/val.bin (token ids, numpy uint16, or uint32 for
vocabularies past 65,536) and DIR/meta.json, which holds all that is needed to
rebuild the tokenizer and read the bins. The first (1 - val_fraction) of the
tokens are for training, the rest for validation. Several inputs are documents,
in order, separated by the end-of-text token (char has none: a blank line).
Inputs stream through in chunks, so memory stays bounded whatever their size:
char reads them twice (first to find the characters), BPE encodes on every core.
"""

import tinygpt.terminal  # noqa: F401  first: Ctrl-C while torch loads is one line, not a traceback  # isort: skip
import codecs
import hashlib
import itertools
import json
import os
import shutil
import stat
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from config import UserError, cli, load_config, option
from tinygpt.dataset import META_FORMAT, open_split, read_meta  # noqa: F401 (read through prepare by older code)
from tinygpt.files import staging_dir, swap_in, write_atomic, write_error
from tinygpt.tokenizer import CharTokenizer, TiktokenTokenizer, cpu_count, cut_point, tokenizer_from_meta  # noqa: F401

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_BYTES = 1_115_394
CHUNK_BYTES = 1 << 23  # read and encode 8 MiB at a time
# A data set (and what older versions left when killed); swap_in carries all else in out_dir over.
DATASET_FILES = ("train.bin", "val.bin", "meta.json", "tokens.bin.tmp", "val.bin.tmp", "meta.json.tmp")


@dataclass
class PrepareConfig:
    input: list[str] = option([], "text file (UTF-8) or directory of *.txt; repeat for more; none: Tiny Shakespeare")
    tokenizer: str = option("char", "char, or a tiktoken encoding: gpt2, r50k_base, cl100k_base, o200k_base, ...")
    out_dir: str = option("", "where to write the bins and meta.json; empty: data/<first input's stem>_<tokenizer>")
    val_fraction: float = option(0.1, "fraction of the tokens, from the end, kept for validation", above=0, below=1)
    url: str = option(SHAKESPEARE_URL, "where to fetch Tiny Shakespeare from when no --input is given")


# --- Reading text ------------------------------------------------------------------


def read_chunks(path, hasher=None, bar=None, shown=None):
    """Yields the text of a UTF-8 file piece by piece, checking it on the way: the
    UserError for a NUL byte or invalid UTF-8 gives its offset in the file, also when
    a character's bytes are split between two reads. shown: the file's name in messages
    (that of the pipe a spooled copy came from)."""
    shown = Path(shown or path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise UserError(f"input file {shown} not found") from None
    except OSError as e:  # a directory, say, or no permission
        raise UserError(f"cannot read input file {shown} ({e.strerror}); pass a readable text file") from None
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with f:
        while data := f.read(CHUNK_BYTES):
            if b"\x00" in data:
                raise UserError(f"input file {shown} looks binary (NUL byte at offset {offset + data.index(0)}); "
                                "pass a text file")
            text = decode(decoder, data, offset, shown)
            offset += len(data)
            if hasher:
                hasher.update(data)
            if bar:
                bar.update(len(data))
            if text:  # empty when the read ended inside a character's bytes
                yield text
        if offset == 0:
            raise UserError(f"input file {shown} is empty; pass a file with some text in it")
        decode(decoder, b"", offset, shown, final=True)  # a character cut off by the end of the file


def spool(path, dest):
    """Copies a pipe, FIFO or /proc file (which says its size is 0, and may be read only
    once) to the regular file dest, to be read like any other input."""
    try:
        src = open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read input file {path} ({e.strerror}); pass a readable text file") from None
    with src, open(dest, "wb") as out:
        while data := src.read(CHUNK_BYTES):
            if b"\x00" in data:  # /dev/urandom, say, which would fill the disk
                raise UserError(f"input file {path} looks binary (a NUL byte); pass a text file")
            out.write(data)
    return dest


def decode(decoder, data, offset, path, final=False):
    try:
        return decoder.decode(data, final=final)
    except UnicodeDecodeError as e:
        # e.start counts from the bytes the decoder held back from the last read.
        at = offset - len(decoder.getstate()[0]) + e.start
        raise UserError(f"input file {path} is not valid UTF-8 (byte {e.object[e.start]:#04x} at offset {at}); "
                        "convert it, e.g. iconv -f latin1 -t utf-8") from None


def read_text(path):
    """The text of a UTF-8 file and its sha256, or a UserError saying what is wrong with it."""
    hasher = hashlib.sha256()
    return "".join(read_chunks(path, hasher)), hasher.hexdigest()


def input_files(inputs):
    """The files to read, in order; a directory stands for its *.txt files, sorted."""
    files = []
    for name in map(Path, inputs):
        if name.is_dir():
            found = sorted(p for p in name.glob("*.txt") if p.is_file())
            if not found:
                raise UserError(f"input directory {name} has no .txt files; pass text files or a directory of them")
            files += found
        elif not name.exists():
            raise UserError(f"input file {name} not found")
        else:
            files.append(name)
    return files


def is_shakespeare(path):
    """Whether path is Tiny Shakespeare itself (only files of its size are hashed)."""
    if path.stat().st_size != SHAKESPEARE_BYTES:
        return False
    return hashlib.sha256(path.read_bytes()).hexdigest() == SHAKESPEARE_SHA256


def default_out_dir(first_input, files, tokenizer):
    """data/<first input's stem>_<tokenizer>; Tiny Shakespeare under any name goes
    where the presets look for it, as if prepare.py had downloaded it."""
    if len(files) == 1 and is_shakespeare(files[0]):
        return f"data/shakespeare_{tokenizer}"
    return f"data/{Path(os.path.abspath(first_input)).stem}_{tokenizer}"


def progress(total, desc):
    # No bar for what takes under a second (delay), nor when stderr is not a terminal (disable=None).
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, delay=1, disable=None)


# --- Writing -----------------------------------------------------------------------


def separator(tokenizer, previous):
    """What goes between two documents: the end-of-text token, else a blank line."""
    if getattr(tokenizer, "eot_token", None) is not None:
        return np.array([tokenizer.eot_token], dtype=np.uint32)
    return tokenizer.encode_array("\n" if previous.endswith("\n") else "\n\n")


def encode_files(files, shown, tokenizer, dtype, out, bar=None):
    """Writes the ids of the files, one document after another, to the open file out,
    a chunk at a time. Returns (tokens, characters, sha256 of all the input bytes)."""
    hasher, threads, n_tokens, n_chars, last = hashlib.sha256(), cpu_count(), 0, 0, ""

    def write(ids):
        nonlocal n_tokens
        out.write(ids.astype(dtype, copy=False))
        n_tokens += len(ids)

    for i, path in enumerate(files):
        if i:
            write(separator(tokenizer, last))
        carry = ""
        for text in read_chunks(path, hasher, bar, shown.get(path)):
            text = carry + text
            # Cut at a word boundary, so that no BPE piece straddles two chunks.
            cut = cut_point(text, len(text))
            write(tokenizer.encode_array(text[:cut], threads))
            n_chars, last, carry = n_chars + cut, text[-1], text[cut:]
        write(tokenizer.encode_array(carry, threads))
        n_chars += len(carry)
    return n_tokens, n_chars, hasher.hexdigest()


def split_point(n_tokens, val_fraction, source):
    """How many tokens are for training: all but the last val_fraction of them."""
    n_train = int(n_tokens * (1 - val_fraction))
    if n_train < 2 or n_tokens - n_train < 2:
        raise UserError(
            f"{source} gives {n_tokens} tokens, too few to split into train and val at val_fraction "
            f"{val_fraction}; use a longer text")
    return n_train


def write_dataset(stage, files, tokenizer, val_fraction, source):
    """Writes train.bin, val.bin and meta.json into the directory stage. Returns the
    tokenizer and (characters, tokens, train tokens)."""
    shown = {}  # a spooled copy -> the pipe or FIFO it came from
    for i, path in enumerate(files):
        if not stat.S_ISREG(path.stat().st_mode):
            files[i] = spool(path, stage / f"input{i}.spooled")
            shown[files[i]] = path
    stats = [(p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    total = sum(size for size, _ in stats)
    if tokenizer is None:
        with progress(total, "finding characters") as bar:  # a first pass, which also checks the files
            texts = (text for path in files for text in read_chunks(path, bar=bar, shown=shown.get(path)))
            separators = ["\n"] if len(files) > 1 else []
            tokenizer = CharTokenizer.from_texts(itertools.chain(texts, separators))
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    with open(stage / "train.bin", "w+b") as out, progress(total, "encoding") as bar:
        n_tokens, n_chars, sha256 = encode_files(files, shown, tokenizer, dtype, out, bar)
        if [(p.stat().st_size, p.stat().st_mtime_ns) for p in files] != stats:
            raise UserError("an input file changed while it was being read; run prepare.py again")
        n_train = split_point(n_tokens, val_fraction, source)
        # All the tokens went to train.bin; the last ones move to val.bin.
        with open(stage / "val.bin", "wb") as val:
            out.seek(n_train * dtype.itemsize)
            shutil.copyfileobj(out, val, CHUNK_BYTES)
            out.truncate(n_train * dtype.itemsize)
            for f in (out, val):
                f.flush()
                os.fsync(f.fileno())
    meta = {"format": META_FORMAT, **tokenizer.meta(), "vocab_size": tokenizer.vocab_size, "dtype": dtype.name,
            "train_tokens": n_train, "val_tokens": n_tokens - n_train, "source": source,
            "documents": len(files), "sha256": sha256}
    write_atomic(stage / "meta.json", (json.dumps(meta, indent=1, ensure_ascii=False) + "\n").encode())
    for copy in shown:
        copy.unlink()
    return tokenizer, (n_chars, n_tokens, n_train)


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
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(dest, data)
    except OSError as e:
        raise UserError(f"{write_error(dest, e)}; nothing was saved: free space or pick another --out_dir") from None
    print(f"downloaded Tiny Shakespeare to {dest}")
    return dest


@cli
def main(argv):
    cfg = load_config(PrepareConfig, argv, "prepare.py", __doc__.strip().splitlines()[0])
    # A named BPE encoding may need a download: find out before any other work.
    tokenizer = None if cfg.tokenizer == "char" else TiktokenTokenizer(cfg.tokenizer)
    if cfg.input:
        files = input_files(cfg.input)
        out_dir = Path(cfg.out_dir or default_out_dir(cfg.input[0], files, cfg.tokenizer))
    else:
        out_dir = Path(cfg.out_dir or f"data/shakespeare_{cfg.tokenizer}")
        files = [download_shakespeare(cfg.url, out_dir / "input.txt")]
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out_dir {out_dir} is a file, not a directory; pick another --out_dir")
    # A name that is not valid UTF-8 is shown with U+FFFD in its place (meta.json is UTF-8).
    source = ", ".join(os.fsencode(Path(name).name).decode("utf-8", "replace") for name in cfg.input) or "input.txt"
    # The new data set is built beside out_dir, then swapped in whole: a failure, Ctrl-C or a
    # kill at any moment leaves the old one, complete, and the next run removes the leftovers.
    try:
        with staging_dir(out_dir) as stage:
            tokenizer, (n_chars, n_tokens, n_train) = write_dataset(stage, files, tokenizer, cfg.val_fraction, source)
            swap_in(stage, out_dir, replaced=DATASET_FILES)
    except OSError as e:
        raise UserError(f"{write_error(out_dir, e)}; the data set there is as it was: free some space, "
                        "or pick another --out_dir") from None
    print(f"{n_chars:,} characters in {len(files)} file(s), {cfg.tokenizer} vocabulary of {tokenizer.vocab_size:,}, "
          f"{n_train:,} train and {n_tokens - n_train:,} val tokens -> {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
