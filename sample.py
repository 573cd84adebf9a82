r"""Generates text from a checkpoint written by train.py, printing it as it comes.

    python sample.py --out_dir=out/shakespeare_char
    python sample.py --out_dir=out --start="ROMEO:" --num_samples=3 --max_new_tokens=200
    python sample.py --out_dir=out --start=FILE:prompt.txt --temperature=0
    python sample.py --out_dir=out --prompts=prompts.txt    # one prompt a line, one batch
    python sample.py --out_dir=out --start="ROMEO:" --stop="\n\n"   # each sample ends at a blank line
    python sample.py --init_from=gpt2-xl --start="The meaning of life is"   # GPT-2 (see gpt2.py)

The checkpoint holds all that is needed: the weights, the model's shape and the
tokenizer. Samples go to stdout, separated by a line of dashes; warnings go to stderr.
"""

import tinygpt.terminal  # noqa: F401  first: Ctrl-C while torch loads is one line, not a traceback  # isort: skip
import contextlib
import os
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import torch

from config import UserError, cli, load_config, option
from model import GPT, GPTConfig
from prepare import tokenizer_from_meta
from tinygpt import gpt2
from tinygpt.checkpoint import checkpoint_path, load_checkpoint
from tinygpt.device import check_device, pick_device, pick_dtype
from tinygpt.terminal import stdout_lost
from tinygpt.textstream import TextStream, unescape

SEPARATOR = "-" * 40


@dataclass
class SampleConfig:
    out_dir: str = option("out", "the directory train.py wrote its checkpoints to")
    checkpoint: str = option("", "which checkpoint in out_dir: best.pt (the lowest val loss) or ckpt.pt (the latest); "
                             "empty: best.pt when it exists")
    init_from: str = option("resume", "resume: the checkpoint in out_dir; or GPT-2: gpt2, gpt2-medium, gpt2-large, "
                            "gpt2-xl, or a directory in the Hugging Face layout (config.json, model.safetensors)")
    start: str = option("", "the prompt, or FILE:path to read it from a file; empty starts from a newline")
    prompts: str = option("", "a file of prompts, one a line (blank lines skipped), generated in one batch")
    num_samples: int = option(1, "how many samples to generate (for each prompt)", low=1)
    max_new_tokens: int = option(500, "tokens to generate in each sample", low=0)
    stop: list[str] = option([], "end a sample where it first generates this text, which is not printed; repeat "
                             "for more; \\n and \\t stand for a newline and a tab")
    temperature: float = option(0.8, "below 1 more predictable, above 1 more random; 0 always takes the likeliest",
                                low=0)
    top_k: int | None = option(200, "sample from the k likeliest tokens only (none: no limit)", low=1)
    top_p: float = option(1.0, "sample from the likeliest tokens whose probabilities add up to p (1: no limit)",
                          above=0, high=1)
    unknown: str = option("error", "prompt characters the model never saw: error, or skip (drop them, with a warning)",
                          choices=("error", "skip"))
    seed: int = option(1337, "random seed: the same seed and settings give the same text", low=0, high=2**63 - 1)
    device: str = option("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    dtype: str = option("auto", "auto (bf16 on CUDA if supported, else fp16; fp32 on CPU), float32, bfloat16, float16",
                        choices=("auto", "float32", "bfloat16", "float16"))
    kv_cache: bool = option(True, "keep earlier positions' keys and values (false: recompute the context each token)")


def check_config(cfg):
    """What the options' ranges (checked by load_config) cannot say."""
    if cfg.start and cfg.prompts:
        raise UserError("--start and --prompts were both given; use one of them")
    if "" in cfg.stop:
        raise UserError("--stop is empty; give the text that ends a sample, e.g. --stop='\\n\\n'")


# --- The model and the prompts -------------------------------------------------------


def load_model(path, device):
    """The model, in eval mode on device, and the tokenizer, both from one checkpoint."""
    ckpt = load_checkpoint(path, "cpu")  # to the CPU first: only the weights need to go to the device
    if "meta" not in ckpt:
        raise UserError(f"{path} holds no tokenizer (meta); it was not written by this train.py")
    try:
        model = GPT(GPTConfig(**{**ckpt["model_config"], "dropout": 0.0}))
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, RuntimeError) as e:
        first_line = str(e).strip().splitlines()[0][:200]
        raise UserError(f"{path} does not fit this version of model.py ({first_line}); "
                        "sample with the code that trained it, or retrain") from None
    return model.to(device).eval(), tokenizer_from_meta(ckpt["meta"])


def load(cfg, device):
    """The model and tokenizer that cfg names: GPT-2 with --init_from, else the checkpoint in out_dir."""
    if cfg.init_from == "resume":
        return load_model(checkpoint_path(cfg.out_dir, cfg.checkpoint), device)
    if not gpt2.is_gpt2(cfg.init_from):
        raise UserError(f"init_from must be resume (a checkpoint in --out_dir), {', '.join(gpt2.SIZES)} or a "
                        f"directory in the Hugging Face layout; got {cfg.init_from!r}")
    config, state, meta = gpt2.load(cfg.init_from)
    return gpt2.build(config, state).to(device), tokenizer_from_meta(meta)


def read_text(path, option_name):
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{option_name}: file {path} not found") from None
    except IsADirectoryError:
        raise UserError(f"{option_name}: {path} is a directory; pass a text file") from None
    except UnicodeDecodeError:
        raise UserError(f"{option_name}: file {path} is not UTF-8 text") from None


def read_prompts(cfg):
    """[(text, source, first_line)]: each prompt and where it came from, for messages."""
    if cfg.prompts:
        lines = read_text(cfg.prompts, "--prompts").splitlines()
        prompts = [(line, cfg.prompts, n) for n, line in enumerate(lines, 1) if line.strip()]
        if not prompts:
            raise UserError(f"--prompts: file {cfg.prompts} has no prompts; write one a line")
        return prompts
    if cfg.start.startswith("FILE:"):
        path = cfg.start.removeprefix("FILE:")
        return [(read_text(path, "--start"), path, 1)]
    return [(cfg.start, "--start", 1)]


def where(text, i, source, first_line):
    """Where character i of a prompt is, counted from 1 as editors count."""
    column = i - text.rfind("\n", 0, i)
    if source == "--start" and "\n" not in text:
        return f"--start column {column}"
    return f"{source} line {first_line + text.count(chr(10), 0, i)} column {column}"


def normalized(text, tokenizer):
    """text, or its composed (NFC) or decomposed (NFD) Unicode form if the tokenizer knows
    more of that one's characters: an accent typed as a separate mark (as macOS may
    write it) or not is the same letter to the reader, but not to a char tokenizer."""
    forms = {form: unicodedata.normalize(form, text) for form in ("NFC", "NFD")}
    form = min(forms, key=lambda f: len(tokenizer.unknown(forms[f])))
    if len(tokenizer.unknown(forms[form])) >= len(tokenizer.unknown(text)):
        return text
    print(f"note: the prompt is read in Unicode form {form}, whose characters the model knows", file=sys.stderr)
    return forms[form]


def drop_unknown(prompts, tokenizer, on_unknown, what="the prompt"):
    """The text of each prompt. Characters the tokenizer lacks are an error, all of
    them named in one message, or with on_unknown="skip" dropped with a warning."""
    prompts = [(normalized(text, tokenizer), source, first_line) for text, source, first_line in prompts]
    found = {}  # character -> where it first appears
    for text, source, first_line in prompts:
        for ch in tokenizer.unknown(text):
            found.setdefault(ch, where(text, text.index(ch), source, first_line))
    if found:
        listed = ", ".join(f"{ch!r} ({place})" for ch, place in list(found.items())[:10])
        more = f" and {len(found) - 10} more" if len(found) > 10 else ""
        message = f"{len(found)} character(s) the model never saw: {listed}{more}"
        if any(unicodedata.combining(ch) for ch in found):
            message += " (accents typed as separate marks; the model knows no other Unicode form of them either)"
        if on_unknown == "error":
            raise UserError(f"{what} has {message}; remove them, or pass --unknown=skip to drop them")
        print(f"warning: dropped {message}", file=sys.stderr)
    return ["".join(ch for ch in text if ch not in found) for text, _, _ in prompts]


def encode_prompts(prompts, tokenizer, on_unknown):
    """Token ids of each prompt (see drop_unknown); an empty one starts from a newline."""
    start = tokenizer.encode("\n") if not tokenizer.unknown("\n") else [0]  # where nanoGPT starts
    return [tokenizer.encode(text) if text else start for text in drop_unknown(prompts, tokenizer, on_unknown)]


def left_pad(rows, device):
    """Ids (B, T) with the shorter rows padded on the left, and valid (B, T) marking
    the real tokens, or None when no row is padded."""
    T = max(len(ids) for ids in rows)
    idx = torch.zeros(len(rows), T, dtype=torch.long)
    valid = torch.zeros(len(rows), T, dtype=torch.bool)
    for r, ids in enumerate(rows):
        idx[r, T - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        valid[r, T - len(ids) :] = True
    return idx.to(device), (None if valid.all() else valid.to(device))


# --- Decoding, one token at a time --------------------------------------------------------


def write(text):
    print(text, end="", flush=True)  # flushed, so each token shows as soon as it exists
    if stdout_lost():  # the reader went away (| head): no one to generate for
        raise BrokenPipeError


def generate(model, rows, cfg, tokenizer, top_k, generator):
    """Continues every prompt in rows in one batch. A single prompt is printed token by
    token; a batch is printed when it is done, one sample after another. Each row ends
    at its first stop sequence, and generation when every row has ended."""
    device = next(model.parameters()).device
    idx, valid = left_pad(rows, device)
    streams = [TextStream(tokenizer, [unescape(stop) for stop in cfg.stop]) for _ in rows]
    texts = [""] * len(rows)
    live = len(rows) == 1

    def add(r, piece):
        texts[r] += piece
        if live and piece:
            write(piece)

    for r, ids in enumerate(rows):
        add(r, tokenizer.decode(ids))  # the prompt, as the tokenizer reads it
    tokens = model.stream(idx, cfg.max_new_tokens, cfg.temperature, top_k, cfg.top_p,
                          valid=valid, use_cache=cfg.kv_cache, generator=generator)
    for token in tokens:  # (B, 1)
        for r, t in enumerate(token[:, 0].tolist()):
            add(r, streams[r].push([t]))
        if all(stream.stopped for stream in streams):
            break
    for r, stream in enumerate(streams):
        add(r, stream.flush())
    for text in texts:
        end = ("" if text.endswith("\n") else "\n") + SEPARATOR + "\n"
        write(end if live else text + end)


@cli
def main(argv):
    cfg = load_config(SampleConfig, argv, "sample.py", __doc__.strip().splitlines()[0])
    check_config(cfg)
    device = check_device(pick_device(cfg.device))
    device_type = torch.device(device).type
    dtype = pick_dtype(cfg.dtype, device_type)
    prompts = read_prompts(cfg)
    model, tokenizer = load(cfg, device)
    rows = encode_prompts(prompts, tokenizer, cfg.unknown)
    n_vocab = model.config.real_vocab_size or model.config.vocab_size
    top_k = None if cfg.top_k is None else min(cfg.top_k, n_vocab)  # more than the vocabulary is all of it
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    autocast = (torch.autocast(device_type=device_type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())
    try:
        with autocast:
            for _ in range(cfg.num_samples):
                generate(model, rows, cfg, tokenizer, top_k, generator)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly, without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return 0


if __name__ == "__main__":
    sys.exit(main())
