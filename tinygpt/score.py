"""Scores a text file with a model: how well it predicts the text, in bits per character and per token.

Fewer bits is better: 0 for a model always right, log2(65) = 6.02 for a uniform guess among 65 characters. The text
is read in non-overlapping windows of the model's block_size, each without the context before it, as train.py reads
its whole val split (--eval_iters=0), so a prepared data set's val text scores the val_bpc the trainer logged. The
first token has no context and is not scored; bits per character count the characters of the tokens scored.
"""

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from config import UserError, load_config, option
from tinygpt import system
from tinygpt.files import checkpoint_path
from tinygpt.prompts import drop_unknown
from tinygpt.system import autocast, choose_device, pick_dtype
from tinygpt.textfiles import read_text
from tinygpt.weights import load_model


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


@dataclass
class ScoreConfig:
    input: str = option("", "the text file (UTF-8) to score")
    out_dir: str = option("out/shakespeare_char", "the directory train.py wrote its checkpoints to")
    checkpoint: str = option("", "which checkpoint in out_dir: best.pt (the lowest val loss) or ckpt.pt (the latest); "
                             "empty: best.pt when it exists")
    init_from: str = option("resume", "resume (the checkpoint in out_dir), another directory train.py wrote, or "
                            "GPT-2: gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a Hugging Face directory (config.json)")
    unknown: str = option("error", "characters the model never saw: error, or skip (drop them, with a warning)",
                          choices=("error", "skip"))
    batch_size: int = option(16, "windows per forward pass (memory and speed, not the result)", low=1)
    device: str = option("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    dtype: str = option("auto", "auto (bf16 on CUDA if supported, else fp16; fp32 on CPU), float32, bfloat16, float16",
                        choices=("auto", "float32", "bfloat16", "float16"))


@system.cli
def main(argv):
    cfg = load_config(ScoreConfig, argv, "-m tinygpt.score", __doc__)
    if not cfg.input:
        raise UserError("no text to score: pass --input=FILE")
    device = choose_device(cfg.device)
    device_type = torch.device(device).type
    dtype = pick_dtype(cfg.dtype, device_type)
    text = read_text(cfg.input, "--input")
    model, tokenizer = load_model(cfg.init_from, cfg.out_dir, cfg.checkpoint, device)
    [text] = drop_unknown([(text, cfg.input, 1)], tokenizer, cfg.unknown, what=f"--input {cfg.input}")
    ids = tokenizer.encode_array(text)
    if len(ids) < 2:
        raise UserError(f"--input {cfg.input} has {len(ids)} token(s); scoring needs 2 or more (the first has no "
                        "context)")
    loss = mean_loss(model, ids, model.config.block_size, cfg.batch_size, device, autocast(device_type, dtype))
    if not math.isfinite(loss):  # NaN weights (a damaged checkpoint), or an overflow
        model_name = checkpoint_path(cfg.out_dir, cfg.checkpoint) if cfg.init_from == "resume" else cfg.init_from
        raise UserError(f"{model_name} gives a loss of {loss} on --input {cfg.input}: its weights are damaged or "
                        "overflow; score another checkpoint (--checkpoint), or retrain")
    scored_tokens = len(ids) - 1
    scored_chars = len(text) - len(tokenizer.decode(ids[:1]))
    bits = loss * scored_tokens / math.log(2)
    print(f"{cfg.input}: {len(text):,} characters, {len(ids):,} tokens; {scored_tokens:,} tokens scored, "
          f"in windows of {model.config.block_size}")
    print(f"bits per character: {bits / max(scored_chars, 1):.4f}")
    print(f"bits per token: {bits / scored_tokens:.4f}")
    print(f"loss per token: {loss:.4f} nats")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
