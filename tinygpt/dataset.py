"""A prepared data set as prepare.py writes it and train.py reads it: meta.json checked field by field, and the token
files checked against it, so a damaged or hand-edited data set is one error line at
the start of a run, not a crash at its end; then batches for training and evaluation.

    meta.json   {"format": 1, "tokenizer": "char", "vocab": [...], "vocab_size": 65,
                 "dtype": "uint16", "train_tokens": N, "val_tokens": M, ...}
                 ("tiktoken" data sets name an "encoding" instead of listing a vocab)
    train.bin   train_tokens ids, each below vocab_size, in dtype
    val.bin     val_tokens ids, likewise
"""

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from config import UserError
from tinygpt.textfiles import CHUNK_BYTES, read_chunks
from tinygpt.tokenizer import cpu_count, cut_point

META_FORMAT = 1
# A data set's files (and what older versions left when killed); a new one replaces these alone.
DATASET_FILES = ("train.bin", "val.bin", "meta.json", "tokens.bin.tmp", "val.bin.tmp", "meta.json.tmp")
DTYPES = ("uint16", "uint32")


def _count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def meta_problem(meta):
    """What is wrong with the contents of a meta.json, in words, or None."""
    if not isinstance(meta, dict):
        return f"holds a JSON {type(meta).__name__}, not an object"
    if not _count(meta.get("format")) or meta["format"] < 1:
        return f"format must be an integer of at least 1, got {meta.get('format')!r}"
    vocab_size, dtype = meta.get("vocab_size"), meta.get("dtype")
    if not _count(vocab_size) or vocab_size < 1:
        return f"vocab_size must be an integer of at least 1, got {vocab_size!r}"
    if dtype not in DTYPES:
        return f"dtype must be {' or '.join(DTYPES)}, got {dtype!r}"
    if vocab_size > np.iinfo(dtype).max + 1:
        return f"vocab_size {vocab_size} does not fit in {dtype} ids"
    for split in ("train_tokens", "val_tokens"):
        if not _count(meta.get(split)):
            return f"{split} must be an integer of at least 0, got {meta.get(split)!r}"
    if meta.get("tokenizer") == "char":
        vocab = meta.get("vocab")
        if not isinstance(vocab, list) or not all(isinstance(ch, str) and len(ch) == 1 for ch in vocab):
            return "vocab must be a list of single characters"
        if len(set(vocab)) != len(vocab):
            return "vocab lists a character twice"
        if len(vocab) != vocab_size:
            return f"vocab lists {len(vocab)} characters but vocab_size is {vocab_size}"
    elif meta.get("tokenizer") == "tiktoken":
        if not isinstance(meta.get("encoding"), str) or not meta["encoding"]:
            return f"encoding must name a tiktoken encoding, got {meta.get('encoding')!r}"
    else:
        return f"tokenizer must be char or tiktoken, got {meta.get('tokenizer')!r}"
    return None


def read_meta(data_dir):
    """meta.json of a data set, checked; a UserError says what is wrong and how to fix it."""
    path = Path(data_dir) / "meta.json"
    again = f"prepare the data again: python prepare.py --input FILE --out_dir {data_dir}"
    if not path.is_file():
        raise UserError(f"{path} not found; run: python prepare.py --input FILE --out_dir {data_dir}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path} is not valid JSON; {again}") from None
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    if isinstance(meta, dict) and _count(meta.get("format")) and meta["format"] > META_FORMAT:
        raise UserError(f"{path} is format {meta['format']}, newer than this code ({META_FORMAT}); update the code")
    problem = meta_problem(meta)
    if problem:
        raise UserError(f"{path}: {problem}; {again}")
    return meta


def open_split(data_dir, split, meta):
    """The tokens of one split as a read-only memmap, checked against meta.json (from
    read_meta): the file's size, and every id below vocab_size (one fast pass)."""
    path = Path(data_dir) / f"{split}.bin"
    if not path.is_file():
        raise UserError(f"{path} not found; run prepare.py again for {data_dir}")
    dtype = np.dtype(meta["dtype"])
    expected = meta[f"{split}_tokens"]
    if path.stat().st_size != expected * dtype.itemsize:
        raise UserError(
            f"{path} holds {path.stat().st_size} bytes but meta.json says {expected} {dtype.name} tokens; "
            "run prepare.py again")
    if expected == 0:
        return np.zeros(0, dtype=dtype)  # an empty file cannot be memory-mapped
    data = np.memmap(path, dtype=dtype, mode="r")
    largest = int(data.max())
    if largest >= meta["vocab_size"]:
        raise UserError(f"{path} holds token id {largest}, but meta.json's vocab_size is {meta['vocab_size']}; "
                        "run prepare.py again")
    return data


def load_data(data_dir, block_size=None):
    """meta.json and the memmapped train and val splits; with block_size, each split checked
    to be longer than it."""
    meta = read_meta(data_dir)
    splits = {split: open_split(data_dir, split, meta) for split in ("train", "val")}
    if block_size is not None:
        check_block_size(splits, block_size, data_dir)
    return meta, splits


def check_block_size(splits, block_size, data_dir):
    """Each split must hold more than one window of block_size tokens and its next-token target."""
    for split, data in splits.items():
        if len(data) <= block_size:
            raise UserError(f"the {split} split of {data_dir} has {len(data)} tokens, not more than "
                            f"block_size {block_size}; lower --block_size or prepare a longer text")


# --- Batches -------------------------------------------------------------------------------


def get_batch(data, batch_size, block_size, rng, device):
    """batch_size random windows of data: inputs (B, T) and next-token targets (B, T)."""
    starts = rng.integers(0, len(data) - block_size, size=batch_size)
    x = np.stack([data[s : s + block_size] for s in starts]).astype(np.int64)
    y = np.stack([data[s + 1 : s + 1 + block_size] for s in starts]).astype(np.int64)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if device.startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def train_batches(data, cfg, rank, it, device):
    """One process's training batches, grad_accum a step, from step it on: each step's drawn afresh
    from its own seed, so a resumed run, on any number of processes, draws what an uninterrupted one would."""
    while True:
        rng = np.random.default_rng(step_seed(cfg.seed, rank, it))
        for _ in range(cfg.grad_accum):
            yield get_batch(data, cfg.batch_size, cfg.block_size, rng, device)
        it += 1


def step_seed(seed, rank, it):
    """The seed of step `it` on process `rank`, for its batches and dropout masks."""
    return int(np.random.SeedSequence((seed, rank, it)).generate_state(1)[0])


@torch.no_grad()
def mean_loss(model, ids, block_size, batch_size, device, autocast=None):
    """The mean next-token loss, in nats, of every token of ids (a 1-D array) after the first.

    ids is cut into non-overlapping windows of block_size predictions, the last one
    shorter if need be, so each token is predicted once, from the tokens before it in
    its window. Call model.eval() first.
    """
    n = len(ids) - 1  # predictions: every token but the first
    starts = list(range(0, n, block_size))
    full, rest = n // block_size, n % block_size
    total = 0.0
    # Windows of one length in each batch: the full ones, then the shorter last one.
    for group, T in ((starts[:full], block_size), (starts[full:], rest)):
        for i in range(0, len(group), batch_size):
            chunk = group[i : i + batch_size]
            x = np.stack([ids[s : s + T] for s in chunk]).astype(np.int64)  # (B, T)
            y = np.stack([ids[s + 1 : s + 1 + T] for s in chunk]).astype(np.int64)  # (B, T): the next tokens
            with autocast or contextlib.nullcontext():
                _, loss = model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
            total += loss.item() * y.size
    return total / n


@torch.no_grad()
def estimate_loss(model, splits, cfg, device, autocast, seed):
    """Mean loss per split. eval_iters > 0: that many random batches (seeded, so the
    training data order is untouched). eval_iters = 0: every token of the val split,
    scored as python -m tinygpt.score scores a file (mean_loss), and as many train tokens from the
    train split's start."""
    model.eval()
    out = {}
    for name, data in splits.items():
        if cfg.eval_iters == 0:
            tokens = data[: len(splits["val"])]  # train: as many tokens as val has
            out[name] = mean_loss(model, tokens, cfg.block_size, 4 * cfg.batch_size, device, autocast)
            continue
        rng = np.random.default_rng(seed)
        total = 0.0
        for _ in range(cfg.eval_iters):
            x, y = get_batch(data, cfg.batch_size, cfg.block_size, rng, device)
            with autocast:
                _, loss = model(x, y)
            total += loss.item()
        out[name] = total / cfg.eval_iters
    model.train()
    return out


# --- Writing ------------------------------------------------------------------------------------------


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


def split_off(out, path, offset):
    """Moves what the open file out holds past offset into a new file at path, and syncs both."""
    with open(path, "wb") as tail:
        out.seek(offset)
        shutil.copyfileobj(out, tail, CHUNK_BYTES)
        out.truncate(offset)
        for f in (out, tail):
            f.flush()
            os.fsync(f.fileno())


def split_point(n_tokens, val_fraction, source):
    """How many tokens are for training: all but the last val_fraction of them."""
    n_train = int(n_tokens * (1 - val_fraction))
    if n_train < 2 or n_tokens - n_train < 2:
        raise UserError(
            f"{source} gives {n_tokens} tokens, too few to split into train and val at val_fraction "
            f"{val_fraction}; use a longer text")
    return n_train
