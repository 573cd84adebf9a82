"""Tokens per second of generation, with and without the KV cache.

    python bench/sampling.py                       # shakespeare_char shape, 500 tokens, CPU
    python bench/sampling.py --device=cuda --max_new_tokens=2000

Random weights: speed does not depend on what the model has learned. Greedy
decoding, so both runs produce the same tokens and do the same work.
"""

import sys
import time
from pathlib import Path
from dataclasses import dataclass

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's modules

from config import UserError, cli, load_config, option
from model import GPT, GPTConfig


@dataclass
class BenchConfig:
    n_layer: int = option(6, "number of transformer blocks")
    n_head: int = option(6, "attention heads per block")
    n_embd: int = option(384, "width of the residual stream")
    block_size: int = option(256, "context length in tokens")
    vocab_size: int = option(65, "vocabulary size")
    batch_size: int = option(1, "sequences generated at once")
    prompt_tokens: int = option(1, "length of the (random) prompt")
    max_new_tokens: int = option(500, "tokens generated per run")
    device: str = option("cpu", "cpu, cuda, cuda:1, mps")
    seed: int = option(1337, "random seed for the weights and prompt")
    threads: int = option(0, "CPU threads for torch (0: its default, one per core)")


def tokens_per_second(model, idx, max_new_tokens, use_cache):
    """Generated tokens (all rows) per second, and the tokens."""
    sync = torch.cuda.synchronize if idx.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = model.generate(idx, max_new_tokens, temperature=0.0, use_cache=use_cache)
    sync()
    return idx.size(0) * max_new_tokens / (time.perf_counter() - t0), out


@cli
def main(argv):
    cfg = load_config(BenchConfig, argv, "bench/sampling.py", __doc__.strip().splitlines()[0])
    if cfg.max_new_tokens < 1 or cfg.prompt_tokens < 1 or cfg.batch_size < 1:
        raise UserError("max_new_tokens, prompt_tokens and batch_size must be at least 1")
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    mconf = GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                      n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=0.0, bias=False)
    model = GPT(mconf).to(cfg.device).eval()
    idx = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.prompt_tokens), device=cfg.device)
    print(f"{model.num_params() / 1e6:.1f}M parameters, block_size {cfg.block_size}, batch {cfg.batch_size}, "
          f"prompt {cfg.prompt_tokens} + {cfg.max_new_tokens} new tokens on {cfg.device}, "
          f"{torch.get_num_threads()} threads")
    tokens_per_second(model, idx, 8, use_cache=True)  # warm up allocator and kernels
    cached, out_cached = tokens_per_second(model, idx, cfg.max_new_tokens, use_cache=True)
    print(f"kv cache:    {cached:8.1f} tokens/s")
    full, out_full = tokens_per_second(model, idx, cfg.max_new_tokens, use_cache=False)
    print(f"no cache:    {full:8.1f} tokens/s")
    print(f"speedup:     {cached / full:8.1f}x")
    if not torch.equal(out_cached, out_full):
        print("warning: greedy tokens differ with and without the cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
