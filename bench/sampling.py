"""Tokens per second of generation, with and without the KV cache, and the cache's memory over time.

    python bench/sampling.py                       # shakespeare_char shape, 500 tokens, CPU
    python bench/sampling.py --device=cuda --max_new_tokens=2000
    python bench/sampling.py --pos=rope --window=64 --max_new_tokens=2000 --compare=false   # past block_size

Random weights: speed does not depend on what the model has learned. Greedy
decoding, so both runs produce the same tokens and do the same work. The cached
run is watched in --segments equal parts: for each, the positions the KV cache
holds, the bytes in its buffers, and the tokens/s of that part alone. With rope a
windowed model's cache slides and holds only its window, so far past block_size
the last part should run as fast as the first, in the same memory.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's modules

from config import UserError, load_config, option
from model import GPT, GPTConfig
from tinygpt import system  # noqa: E402
from tinygpt.decoding import KVCache, generate, stream


@dataclass
class BenchConfig:
    n_layer: int = option(6, "number of transformer blocks")
    n_head: int = option(6, "attention heads per block")
    n_embd: int = option(384, "width of the residual stream")
    block_size: int = option(256, "context length in tokens")
    vocab_size: int = option(65, "vocabulary size")
    pos: str = option("learned", "position encoding: learned, sinusoidal, rope or none (rope slides past block_size)")
    window: int = option(0, "each query sees only its window newest keys; the cache holds that many (0: block_size)")
    batch_size: int = option(1, "sequences generated at once")
    prompt_tokens: int = option(1, "length of the (random) prompt")
    max_new_tokens: int = option(500, "tokens generated per run")
    segments: int = option(4, "parts of the cached run reported one by one (e.g. 4 x 500 of 2000 tokens)")
    compare: bool = option(True, "also generate without the cache, and check both give the same tokens")
    device: str = option("cpu", "cpu, cuda, cuda:1, mps")
    seed: int = option(1337, "random seed for the weights and prompt")
    threads: int = option(0, "CPU threads for torch (0: its default, one per core)")


def tokens_per_second(model, idx, max_new_tokens, use_cache):
    """Generated tokens (all rows) per second, and the tokens."""
    sync = torch.cuda.synchronize if idx.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = generate(model, idx, max_new_tokens, temperature=0.0, use_cache=use_cache)
    sync()
    return idx.size(0) * max_new_tokens / (time.perf_counter() - t0), out


def watched_generation(model, idx, max_new_tokens, segments):
    """Cached greedy generation, timed part by part. Returns the tokens and per part
    (tokens so far, positions the cache holds, bytes in its buffers, tokens/s of the part)."""
    sync = torch.cuda.synchronize if idx.device.type == "cuda" else (lambda: None)
    caches = []  # every cache generation makes (learned positions rebuild one past block_size)

    def new_cache(n_layer, max_len):
        caches.append(KVCache(n_layer, max_len))
        return caches[-1]

    ends = {round(max_new_tokens * (i + 1) / segments) for i in range(segments)}
    parts, new, done = [], [], 0
    sync()
    t0 = time.perf_counter()
    for token in stream(model, idx, max_new_tokens, temperature=0.0, new_cache=new_cache):
        new.append(token)
        if len(new) in ends:
            sync()
            t1 = time.perf_counter()
            parts.append((len(new), len(caches[-1]), caches[-1].nbytes(), idx.size(0) * (len(new) - done) / (t1 - t0)))
            t0, done = t1, len(new)
    return torch.cat([idx, *new], dim=1), parts


@system.cli
def main(argv):
    cfg = load_config(BenchConfig, argv, "bench/sampling.py", __doc__)
    if cfg.max_new_tokens < 1 or cfg.prompt_tokens < 1 or cfg.batch_size < 1:
        raise UserError("max_new_tokens, prompt_tokens and batch_size must be at least 1")
    if not 1 <= cfg.segments <= cfg.max_new_tokens:
        raise UserError(f"segments must be 1 to max_new_tokens ({cfg.max_new_tokens}), got {cfg.segments}")
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    try:
        mconf = GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=0.0, bias=False, pos=cfg.pos,
                          window=cfg.window)
    except ValueError as e:
        raise UserError(f"model config: {e}") from None
    model = GPT(mconf).to(cfg.device).eval()
    idx = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.prompt_tokens), device=cfg.device)
    print(f"{model.num_params() / 1e6:.1f}M parameters, block_size {cfg.block_size}, pos {cfg.pos}, "
          f"window {cfg.window or 'none'}, batch {cfg.batch_size}, prompt {cfg.prompt_tokens} + "
          f"{cfg.max_new_tokens} new tokens on {cfg.device}, {torch.get_num_threads()} threads")
    tokens_per_second(model, idx, 8, use_cache=True)  # warm up allocator and kernels
    t0 = time.perf_counter()
    out_cached, parts = watched_generation(model, idx, cfg.max_new_tokens, cfg.segments)
    cached = cfg.batch_size * cfg.max_new_tokens / (time.perf_counter() - t0)
    print(f"kv cache:    {cached:8.1f} tokens/s")
    print(f"{'tokens':>10} {'cache holds':>12} {'cache bytes':>14} {'tokens/s':>10}   (each part alone)")
    for tokens, held, nbytes, speed in parts:
        print(f"{tokens:>10,} {held:>12,} {nbytes:>14,} {speed:>10.1f}")
    if len(parts) > 1:
        first, last = parts[0], parts[-1]
        print(f"last part against the first: tokens/s {100 * (last[3] / first[3] - 1):+.1f}%, "
              f"cache bytes {last[2] / first[2]:.2f}x")
    if cfg.compare:
        full, out_full = tokens_per_second(model, idx, cfg.max_new_tokens, use_cache=False)
        print(f"no cache:    {full:8.1f} tokens/s")
        print(f"speedup:     {cached / full:8.1f}x")
        if not torch.equal(out_cached, out_full):
            print("warning: greedy tokens differ with and without the cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
