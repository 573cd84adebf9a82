"""A prepared data set as prepare.py writes it and train.py reads it, checked field by field so that a damaged
or hand-edited one is one error line at the start of a run, not a crash at its end; and a model's loss on a text.

    meta.json   {"format": 1, "tokenizer": "char", "vocab": [...], "vocab_size": 65,
                 "dtype": "uint16", "train_tokens": N, "val_tokens": M, ...}
                 ("tiktoken" data sets name an "encoding" instead of listing a vocab)
    train.bin   train_tokens ids, each below vocab_size, in dtype
    val.bin     val_tokens ids, likewise
"""

import contextlib
import json
from pathlib import Path

import numpy as np
import torch

from config import UserError

META_FORMAT = 1
DATASET_FILES = ("train.bin", "val.bin", "meta.json")  # what prepare.py writes; a new data set replaces these alone
DTYPES = ("uint16", "uint32")


def meta_problem(meta):
    """What is wrong with the contents of a meta.json, in words, or None."""
    if not isinstance(meta, dict):
        return f"holds a JSON {type(meta).__name__}, not an object"
    for key, least in (("format", 1), ("vocab_size", 1), ("train_tokens", 0), ("val_tokens", 0)):
        if type(meta.get(key)) is not int or meta[key] < least:  # (a bool is no count)
            return f"{key} must be an integer of at least {least}, got {meta.get(key)!r}"
    if meta["format"] > META_FORMAT:
        return f"format {meta['format']} is newer than this code's {META_FORMAT}: update the code"
    if meta.get("dtype") not in DTYPES:
        return f"dtype must be {' or '.join(DTYPES)}, got {meta.get('dtype')!r}"
    if meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1:
        return f"vocab_size {meta['vocab_size']} does not fit in {meta['dtype']} ids"
    return tokenizer_problem(meta)


def tokenizer_problem(meta):
    """What is wrong with the tokenizer that meta describes, or None: a meta.json's object, or a checkpoint's copy of
    one (which may lack the counts)."""
    if meta.get("tokenizer") == "char":
        vocab = meta.get("vocab")
        if type(vocab) is not list or not all(type(ch) is str and len(ch) == 1 for ch in vocab) \
                or not len(set(vocab)) == len(vocab) == meta.get("vocab_size", len(vocab)):
            return f"vocab must be a list of vocab_size ({meta.get('vocab_size')}) different single characters"
    elif meta.get("tokenizer") == "tiktoken":
        if not isinstance(meta.get("encoding"), str) or not meta["encoding"]:
            return f"encoding must name a tiktoken encoding, got {meta.get('encoding')!r}"
    else:
        return f"tokenizer must be char or tiktoken, got {meta.get('tokenizer')!r}"
    return None


def prepare_again(data_dir):
    """The command that makes data_dir; Tiny Shakespeare's needs no file (prepare.py downloads it)."""
    path, tokenizer = Path(data_dir), Path(data_dir).name.removeprefix("shakespeare_")
    if path.parent == Path("data") and path.name != tokenizer:
        return "python prepare.py" + ("" if tokenizer == "char" else f" --tokenizer {tokenizer}")
    return f"python prepare.py --input FILE --out_dir {data_dir}"


def read_meta(data_dir):
    """meta.json of a data set, checked; a UserError says what is wrong and how to fix it."""
    path = Path(data_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} not found; run: {prepare_again(data_dir)}") from None
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path} is not valid JSON; prepare the data again: {prepare_again(data_dir)}") from None
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    problem = meta_problem(meta)
    if problem:
        raise UserError(f"{path}: {problem}; prepare the data again: {prepare_again(data_dir)}")
    return meta


def open_split(data_dir, split, meta):
    """The tokens of one split as a read-only memmap, checked against meta.json (from
    read_meta): the file's size, and every id below vocab_size (one fast pass)."""
    path = Path(data_dir) / f"{split}.bin"
    if not path.is_file():
        raise UserError(f"{path} not found; run prepare.py again for {data_dir}")
    dtype, expected = np.dtype(meta["dtype"]), meta[f"{split}_tokens"]
    if path.stat().st_size != expected * dtype.itemsize:
        raise UserError(f"{path} holds {path.stat().st_size} bytes but meta.json says {expected} {dtype.name} "
                        "tokens; run prepare.py again")
    if expected == 0:
        return np.zeros(0, dtype=dtype)  # an empty file cannot be memory-mapped
    data = np.memmap(path, dtype=dtype, mode="r")
    if data.max() >= meta["vocab_size"]:
        raise UserError(f"{path} holds token id {data.max()}, but meta.json's vocab_size is {meta['vocab_size']}; "
                        "run prepare.py again")
    return data


def load_data(data_dir):
    """(meta.json, the memmapped train and val splits), each checked."""
    meta = read_meta(data_dir)
    return meta, {split: open_split(data_dir, split, meta) for split in ("train", "val")}


def check_block_size(splits, block_size, data_dir):
    """Each split must hold more than one window of block_size tokens and its next-token target."""
    for split, data in splits.items():
        if len(data) <= block_size:
            raise UserError(f"the {split} split of {data_dir} has {len(data)} tokens, not more than "
                            f"block_size {block_size}; lower --block_size or prepare a longer text")


@torch.no_grad()
def mean_loss(model, ids, block_size, batch_size, device, autocast=None):
    """The mean next-token loss, in nats, of every token of ids (a 1-D array) after the first: ids cut
    into non-overlapping windows of block_size predictions, the last one shorter if need be, so each
    token is predicted once, from the tokens before it in its window. Call model.eval() first."""
    n = len(ids) - 1  # predictions: every token but the first
    starts = list(range(0, n, block_size))
    full, rest = n // block_size, n % block_size
    total = 0.0
    for group, T in ((starts[:full], block_size), (starts[full:], rest)):  # windows of one length in each batch
        for i in range(0, len(group), batch_size):
            chunk = group[i : i + batch_size]
            x = np.stack([ids[s : s + T] for s in chunk]).astype(np.int64)  # (B, T)
            y = np.stack([ids[s + 1 : s + 1 + T] for s in chunk]).astype(np.int64)  # (B, T): the next tokens
            with autocast or contextlib.nullcontext():
                _, loss = model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
            total += loss.item() * y.size
    return total / n
