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

import errno
import hashlib
import itertools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from config import UserError, load_config, option
from tinygpt import system
from tinygpt.files import DATASET_FILES, META_FORMAT, check_path, staging_dir, swap_in, write_atomic, write_error
from tinygpt.textfiles import (
    CHUNK_BYTES,
    SHAKESPEARE_URL,
    download_shakespeare,
    input_files,
    is_shakespeare,
    progress,
    read_chunks,
    regular_files,
)
from tinygpt.tokenizer import CharTokenizer, TiktokenTokenizer, cut_point


@dataclass
class PrepareConfig:
    input: list[str] = option([], "text file (UTF-8) or directory of *.txt; repeat for more; none: Tiny Shakespeare")
    tokenizer: str = option("char", "char, or a tiktoken encoding: gpt2, r50k_base, cl100k_base, o200k_base, ...")
    out_dir: str = option("", "where to write the bins and meta.json; empty: data/<first input's stem>_<tokenizer>")
    val_fraction: float = option(0.1, "fraction of the tokens, from the end, kept for validation", above=0, below=1)
    url: str = option(SHAKESPEARE_URL, "where to fetch Tiny Shakespeare from when no --input is given")


@system.cli
def main(argv):
    cfg = load_config(PrepareConfig, argv, "prepare.py", __doc__)
    # A named BPE encoding may need a download: find out before any other work.
    tokenizer = None if cfg.tokenizer == "char" else TiktokenTokenizer(cfg.tokenizer)
    if cfg.input:
        files = input_files(cfg.input)
        out_dir = Path(cfg.out_dir or default_out_dir(cfg.input[0], files, cfg.tokenizer))
    else:  # Tiny Shakespeare, downloaded into out_dir below
        files, out_dir = [], Path(cfg.out_dir or f"data/shakespeare_{cfg.tokenizer}")
    check_path(str(out_dir), "--out_dir", directory=True)
    # A name that is not valid UTF-8 is shown with U+FFFD in its place (meta.json is UTF-8).
    source = ", ".join(os.fsencode(Path(name).name).decode("utf-8", "replace") for name in cfg.input) or "input.txt"
    # The new data set is built beside out_dir, then swapped in whole: a failure, Ctrl-C or a
    # kill at any moment leaves the old one, complete, and the next run removes the leftovers.
    try:
        files = files or [download_shakespeare(cfg.url, out_dir / "input.txt")]
        with staging_dir(out_dir) as stage:
            tokenizer, (n_chars, n_tokens, n_train) = write_dataset(stage, files, tokenizer, cfg.val_fraction, source,
                                                                    notes := set())
            swap_in(stage, out_dir, replaced=DATASET_FILES)
    except OSError as e:
        raise UserError(f"{write_error(out_dir, e)}; the data set there is as it was: {how_to_fix(e, out_dir)}") \
            from None
    print(f"{n_chars:,} characters in {len(files)} file(s), {cfg.tokenizer} vocabulary of {tokenizer.vocab_size:,}, "
          f"{n_train:,} train and {n_tokens - n_train:,} val tokens -> {out_dir}" + "".join(f"; {n}" for n in notes))
    return 0


def how_to_fix(e, out_dir):
    """What to do about OSError e, which stopped the new data set going into out_dir, by its cause."""
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):  # the new data set is made beside out_dir
        return f"{out_dir} or the directory it is in is not writable; get write permission, or pick another --out_dir"
    if e.errno in (errno.EXDEV, errno.EBUSY):  # what a mount point's rename fails with
        return (f"{out_dir} is a mount point, which cannot be swapped for the new data set; pick another --out_dir, "
                "e.g. a directory inside it")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free some space, or pick another --out_dir"
    return "pick another --out_dir"  # a directory removed under it, an I/O error: not a full disk


def make_default(data_dir, processes):
    """train.py's data set on a fresh clone: data/shakespeare_char, made as `python prepare.py`
    makes it (downloaded, checked). No other, whose error names its command; and by one process
    alone (under torchrun they would race)."""
    if Path(data_dir) == Path("data/shakespeare_char") and processes == 1:
        print(f"{data_dir} is not there yet: preparing it first, as python prepare.py does")
        if main([]):
            raise UserError("")  # main has said why


def default_out_dir(first_input, files, tokenizer):
    """data/<first input's stem>_<tokenizer>; Tiny Shakespeare under any name goes
    where the presets look for it, as if prepare.py had downloaded it."""
    if len(files) == 1 and is_shakespeare(files[0]):
        return f"data/shakespeare_{tokenizer}"
    return f"data/{Path(os.path.abspath(first_input)).stem}_{tokenizer}"


def write_dataset(stage, files, tokenizer, val_fraction, source, notes=None):
    """Writes train.bin, val.bin and meta.json into the directory stage, reading the files chunk by
    chunk, so memory stays bounded whatever their size. Returns the tokenizer (for char, made from
    the text) and (characters, tokens, train tokens); notes: a set for what reading the text noted
    (read_chunks)."""
    files, shown = regular_files(files, stage)  # shown: a copy of a pipe -> the pipe, for messages
    stats = [(p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    total = sum(size for size, _ in stats)
    if tokenizer is None:  # char: one token for each character the text has, found in a first pass
        with progress(total, "finding characters") as bar:
            texts = (text for path in files for text in read_chunks(path, bar=bar, shown=shown.get(path)))
            tokenizer = CharTokenizer.from_texts(itertools.chain(texts, ["\n"] if len(files) > 1 else []))
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    with open(stage / "train.bin", "w+b") as out, progress(total, "encoding") as bar:
        n_tokens, n_chars, sha256 = encode_files(files, shown, tokenizer, dtype, out, bar, notes)
        if [(p.stat().st_size, p.stat().st_mtime_ns) for p in files] != stats:
            raise UserError("an input file changed while it was being read; run prepare.py again")
        n_train = int(n_tokens * (1 - val_fraction))  # all but the last val_fraction of the tokens
        if n_train < 2 or n_tokens - n_train < 2:
            raise UserError(f"{source} gives {n_tokens} tokens, too few to split into train and val at "
                            f"val_fraction {val_fraction}; use a longer text")
        split_off(out, stage / "val.bin", n_train * dtype.itemsize)  # the last tokens move to val.bin
    meta = {"format": META_FORMAT, **tokenizer.meta(), "vocab_size": tokenizer.vocab_size, "dtype": dtype.name,
            "train_tokens": n_train, "val_tokens": n_tokens - n_train, "source": source,
            "documents": len(files), "sha256": sha256}
    write_atomic(stage / "meta.json", (json.dumps(meta, indent=1, ensure_ascii=False) + "\n").encode())
    for copy in shown:
        copy.unlink()
    return tokenizer, (n_chars, n_tokens, n_train)


def separator(tokenizer, previous):
    """What goes between two documents: the end-of-text token, else a blank line."""
    if getattr(tokenizer, "eot_token", None) is not None:
        return np.array([tokenizer.eot_token], dtype=np.uint32)
    return tokenizer.encode_array("\n" if previous.endswith("\n") else "\n\n")


def encode_files(files, shown, tokenizer, dtype, out, bar=None, notes=None):
    """Writes the ids of the files, one document after another, to the open file out (new, empty), a
    chunk at a time. Returns (tokens, characters, sha256 of all the input bytes); notes: see
    read_chunks."""
    hasher, threads, n_chars, last = hashlib.sha256(), system.cpu_count(), 0, ""
    for i, path in enumerate(files):
        if i:
            out.write(separator(tokenizer, last).astype(dtype))
        carry = ""
        for text in read_chunks(path, hasher, bar, shown.get(path), notes=notes):
            text = carry + text
            # Cut at a word boundary, so that no BPE piece straddles two chunks.
            cut = cut_point(text, len(text))
            out.write(tokenizer.encode_array(text[:cut], threads).astype(dtype, copy=False))
            n_chars, last, carry = n_chars + cut, text[-1], text[cut:]
        out.write(tokenizer.encode_array(carry, threads).astype(dtype, copy=False))
        n_chars += len(carry)
    return out.tell() // dtype.itemsize, n_chars, hasher.hexdigest()


def split_off(out, path, offset):
    """Moves what the open file out holds past offset into a new file at path, and syncs both."""
    with open(path, "wb") as tail:
        out.seek(offset)
        shutil.copyfileobj(out, tail, CHUNK_BYTES)
        out.truncate(offset)
        for f in (out, tail):
            f.flush()
            os.fsync(f.fileno())


if __name__ == "__main__":
    raise SystemExit(main())
