r"""Generates text from a checkpoint written by train.py, printing it as it comes.

    python sample.py                        # what python train.py trained, in out/shakespeare_char
    python sample.py --start="ROMEO:" --num_samples=3 --max_new_tokens=200
    python sample.py --start=FILE:prompt.txt --temperature=0
    python sample.py --prompts=prompts.txt    # one prompt a line, one batch
    python sample.py --start="ROMEO:" --stop="\n\n"   # each sample ends at a blank line
    python sample.py --init_from=gpt2-xl --start="The meaning of life is"   # tinygpt/gpt2.py

The checkpoint holds all that is needed: the weights, the model's shape and the
tokenizer. Samples go to stdout, separated by a line of dashes; warnings go to stderr.
"""

import os
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from config import UserError, load_config, option
from tinygpt import decoding, system
from tinygpt.prompts import TextStream, encode_prompts, read_prompts, unescape
from tinygpt.system import autocast, choose_device, pick_dtype
from tinygpt.weights import load_model

SEPARATOR = "-" * 40


@dataclass
class SampleConfig:
    out_dir: str = option("out/shakespeare_char", "where train.py wrote its checkpoints")
    checkpoint: str = option("", "best.pt (lowest val loss) or ckpt.pt (latest); empty: best.pt "
                             "if there is one")
    init_from: str = option("resume", "resume: out_dir's checkpoint; or GPT-2: gpt2, gpt2-medium, "
                            "gpt2-large, gpt2-xl, or a directory in the Hugging Face layout")
    start: str = option("", "the prompt, or FILE:path to read it from; empty starts from a newline")
    prompts: str = option("", "a file of prompts, one a line (blank lines skipped), in one batch")
    num_samples: int = option(1, "how many samples to generate (for each prompt)", low=1)
    max_new_tokens: int = option(500, "tokens to generate in each sample", low=0)
    stop: list[str] = option([], "end a sample where it first says this text, not printed; repeat "
                             "for more; \\n and \\t stand for a newline and a tab")
    temperature: float = option(0.8, "under 1 more predictable, over 1 more random; 0: likeliest",
                                low=0)
    top_k: int | None = option(200, "sample from the k likeliest tokens (none: no limit)", low=1)
    top_p: float = option(1.0, "the likeliest tokens whose probabilities add up to p (1: no limit)",
                          above=0, high=1)
    unknown: str = option("error", "prompt characters the model never saw: error, or skip (warned)",
                          choices=("error", "skip"))
    seed: int = option(1337, "the same seed and settings give the same text", low=0, high=2**63 - 1)
    device: str = option("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    dtype: str = option("auto", "auto (bf16 on CUDA if supported, else fp16; fp32 on CPU)",
                        choices=("auto", "float32", "bfloat16", "float16"))
    kv_cache: bool = option(True, "keep earlier positions' keys and values (false: recompute them)")


def write(text):
    print(text, end="", flush=True)  # flushed, so each token shows as soon as it exists
    if getattr(sys.stdout, "lost", False):  # cli's stdout failed, the reader gone (| head): stop
        raise BrokenPipeError


def print_samples(model, rows, cfg, tokenizer, generator):
    """Continues every prompt in rows (token ids) in one batch. A single prompt is printed token
    by token; a batch when it is done, one sample after another. Each row ends at its first stop
    sequence, and generation when every row has ended."""
    idx, valid = decoding.left_pad(rows, next(model.parameters()).device)
    streams = [TextStream(tokenizer, [unescape(stop) for stop in cfg.stop]) for _ in rows]
    texts = [""] * len(rows)
    live = len(rows) == 1

    def add(r, piece):
        texts[r] += piece
        if live and piece:
            write(piece)

    for r, ids in enumerate(rows):
        add(r, tokenizer.decode(ids))  # the prompt, as the tokenizer reads it
    tokens = decoding.stream(model, idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                             valid=valid, use_cache=cfg.kv_cache, generator=generator)
    # A batch prints when it is done: until then a bar on a terminal's stderr says how far it is.
    for token in tqdm(tokens, f"{len(rows):,} samples", cfg.max_new_tokens, unit="token",
                      disable=live or None):
        for r, t in enumerate(token[:, 0].tolist()):
            add(r, streams[r].push([t]))
        if all(stream.stopped for stream in streams):
            break
    for r, stream in enumerate(streams):
        add(r, stream.flush())
        end = ("" if texts[r].endswith("\n") else "\n") + SEPARATOR + "\n"
        write(end if live else texts[r] + end)


@system.cli
def main(argv):
    cfg = load_config(SampleConfig, argv, "sample.py", __doc__)
    if cfg.start and cfg.prompts:
        raise UserError("--start and --prompts were both given; use one of them")
    if "" in cfg.stop:
        raise UserError("--stop is empty; give the text that ends a sample, e.g. --stop='\\n\\n'")
    device = choose_device(cfg.device)
    device_type = torch.device(device).type
    prompts = read_prompts(cfg.start, cfg.prompts)
    model, tokenizer = load_model(cfg.init_from, cfg.out_dir, cfg.checkpoint, device)
    rows = encode_prompts(prompts, tokenizer, cfg.unknown)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    try:
        with autocast(device_type, pick_dtype(cfg.dtype, device_type)):
            for _ in range(cfg.num_samples):
                print_samples(model, rows, cfg, tokenizer, generator)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly, without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
