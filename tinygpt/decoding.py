"""Decoding: the model knows only forward(); this module decides which positions to feed it (stream,
generate), keeps the keys and values of those it has seen (KVCache), and picks each next token from the
logits (sample_next). Every step runs model.forward, with the cache or without, so what a reader changes
in model.py is what sampling runs."""

import contextlib
import math

import torch
import torch.nn.functional as F

from config import UserError


def newest(x, n, dim):
    """The last n entries of x along dim (x[:, -n:] would be all of them for n = 0)."""
    return x.narrow(dim, x.size(dim) - n, n)


class KVCache:
    """Keys and values of every layer for the positions seen, so that a new token costs one position of work.
    A query sees max_len keys at most (block_size, or the window): each step attends to the newest max_len - 1
    positions held and to its new ones, so past max_len the cache slides in a fixed memory (past block_size
    only rope allows it)."""

    def __init__(self, n_layer, max_len):
        self.max_len = max_len
        self.k, self.v = [None] * n_layer, [None] * n_layer  # each (B, H, S, hs): the last step's keys
        self.valid = None  # (B, S) bool: which of those positions are real tokens, not padding; None: all
        self.dropped = 0  # real tokens before them, per row (B, 1) once there is padding: slid past
        self.seen = 0  # positions ever added: the next one's position
        self.length = 0  # S, the positions this step attends to
        self.layer = 0  # whose extend() comes next

    def __len__(self):
        return self.length

    def nbytes(self):
        """Bytes in the keys and values held: after a step of one token, max_len positions' at most."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)

    def advance(self, valid, T):
        """Makes room for T new positions, valid (B, T) or None for all real. Returns the validity of the S
        positions they attend to (the newest held, then themselves), or None when none is padding."""
        held = min(self.length, self.max_len - 1)
        if valid is not None and self.valid is None:  # the first padding: every position before it was real
            self.valid, self.dropped = valid.new_ones(valid.size(0), held), self.seen - held
        self.layer, self.length, self.seen = 0, held + T, self.seen + T
        if self.valid is None:
            return None
        self.dropped = self.dropped + self.valid[:, : self.valid.size(1) - held].sum(dim=1, keepdim=True)
        new = self.valid.new_ones(self.valid.size(0), T) if valid is None else valid
        self.valid = torch.cat([newest(self.valid, held, dim=1), new], dim=1)  # (B, S)
        return self.valid

    def extend(self, k, v):
        """Adds this layer's new keys and values (B, H, T, hs); returns those of all S, (B, H, S, hs). Joined
        anew each step, a copy of S positions: the cache then slides by a slice, with no ring of slots."""
        i, self.layer = self.layer, self.layer + 1
        if self.k[i] is not None:  # the newest held, then the new
            held = self.length - k.size(2)
            k = torch.cat([newest(self.k[i], held, dim=2), k], dim=2)
            v = torch.cat([newest(self.v[i], held, dim=2), v], dim=2)
        self.k[i], self.v[i] = k, v
        return k, v


def left_pad(rows, device):
    """Prompts of different lengths as one batch: ids (B, T) with the shorter rows padded on the
    left, and valid (B, T) marking the real tokens, or None when no row is padded."""
    T = max(len(ids) for ids in rows)
    idx = torch.tensor([[0] * (T - len(ids)) + list(ids) for ids in rows], dtype=torch.long)
    valid = torch.tensor([[False] * (T - len(ids)) + [True] * len(ids) for ids in rows])
    return idx.to(device), (None if valid.all() else valid.to(device))


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, **kwargs):
    """idx (B, T) followed by max_new_tokens generated tokens: (B, T + max_new_tokens). See stream."""
    return torch.cat([idx, *stream(model, idx, max_new_tokens, temperature, top_k, **kwargs)], dim=1)


@torch.inference_mode()  # no_grad, and no version counters or views tracked: 20% more tokens/s on a CPU
def stream(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
           valid=None, use_cache=True, generator=None, new_cache=KVCache):
    """Yields the next token (B, 1) of every row, one step at a time, each from model.forward; call
    model.eval() first. Past block_size, with rope (attention reads only offsets) the cache slides a token at
    a time, and without one the model reads the last n_layer * (span - 1) + 1 tokens, all the newest depends
    on when each query sees its span newest keys: both give the same tokens. With learned or sinusoidal
    positions every cached key is wrong once the window moves, so it jumps, dropping its oldest quarter,
    with a cache or without: each row of a batch when its own tokens pass block_size, as it would alone.
    new_cache(n_layer, max_len) makes the caches."""
    block = model.config.block_size
    span = model.config.window or block  # the most keys a query sees
    slides = model.config.pos == "rope"
    reach = model.config.n_layer * (span - 1) + 1 if slides else block  # the context the newest token reads
    keep = reach if slides else max(1, block - max(1, block // 4))  # tokens left in the window after it moves
    attends = model.config.mixer == "multihead"  # the rungs before keep no keys to cache
    idx, valid, cache = idx[:, -block:], None if valid is None else valid[:, -block:], None
    for _ in range(max_new_tokens):
        if idx.size(1) > reach and slides:
            idx, valid = idx[:, -keep:], None if valid is None else valid[:, -keep:]
        elif idx.size(1) > reach:  # rows (left-padded: the longest is idx's width) past block_size
            idx, valid, cache = *jump(idx, valid, block, keep), None
        fresh = cache is None  # the whole window is read: the first step, after a jump, or with no cache
        if fresh:
            cache = new_cache(model.config.n_layer, span) if use_cache and attends else None
        fed = idx if fresh else idx[:, -1:]  # with a cache, only the newest token is not in it
        with faster_cpu_kernels(positions=fed.size(1)):
            logits, _ = model(fed, valid=valid if fresh else None, cache=cache, last_only=True)
        next_token = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)  # (B, 1)
        idx = torch.cat([idx, next_token], dim=1)
        if valid is not None:
            valid = torch.cat([valid, torch.ones_like(next_token, dtype=torch.bool)], dim=1)
        yield next_token


def jump(idx, valid, block, keep):
    """(idx, valid) with each row longer than block cut to its newest keep tokens, the older made padding."""
    valid = torch.ones_like(idx, dtype=torch.bool) if valid is None else valid
    real = valid.sum(dim=1, keepdim=True)  # (B, 1): each row's tokens
    valid = valid & (valid.cumsum(dim=1) > torch.where(real > block, real - keep, 0))  # (B, T)
    first = int(valid.any(dim=0).int().argmax())  # the first column where a row has a token
    idx, valid = idx[:, first:], valid[:, first:]
    return idx, None if valid.all() else valid


@contextlib.contextmanager
def faster_cpu_kernels(positions):
    """PyTorch's own CPU kernels instead of oneDNN's where faster (docs/results.md): fp32, 1.0-1.3x, and bf16
    on one position; bf16 on many keeps oneDNN (5x there). Set by hand: mkldnn.flags' arguments differ
    across torch 2.x."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled and positions > 1 and torch.is_autocast_enabled("cpu")
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """logits (B, V) -> token ids (B, 1). Temperature (0: greedy), then top_k (the k likeliest tokens),
    then top_p (the smallest set whose probabilities add up to at least p: nucleus)."""
    top = logits.amax(dim=-1, keepdim=True)  # (B, 1): NaN where a row has a NaN, inf where one overflowed
    if not math.isfinite(top.sum()):  # NaN weights (a damaged checkpoint), or an overflow: nothing to sample
        raise UserError("the model's scores for the next token are NaN or infinite: its weights are damaged or "
                        "overflow; sample from another checkpoint (--checkpoint), or retrain")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # The largest logit 0, the temperature at least fp32's smallest normal: none overflows or is 0.
    logits = (logits.float() - top) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        # Drop a token when those before it already reach top_p; the first stays (1e-300 is 0 in fp32).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = F.softmax(logits, dim=-1)  # drawn as torch.multinomial draws, less its check of probs: 6% more tokens/s
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1, keepdim=True)
