"""Generation: the KV cache, the decoding loop, and the sampling rule.

model.GPT.stream and GPT.generate call into here. The model itself knows only
forward(); this file decides which positions to feed it, keeps the keys and
values of those it has seen, and picks each next token from the logits.
"""

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values of every layer for the positions already seen.

    During generation each new token then costs one position of work, not the
    whole context. Buffers are max_len long and filled in place (torch.cat would
    copy the whole cache every token). `valid` (B, S) marks real tokens and the
    left-padding of shorter prompts in the batch; it stays None while none is.
    Once full, the cache slides: the oldest positions make room for the new
    (the model allows that only with rope, whose keys do not depend on where
    the window starts).
    """

    def __init__(self, n_layer, max_len):
        self.max_len = max_len
        self.k = [None] * n_layer  # each (B, H, max_len, hs) once used
        self.v = [None] * n_layer
        self.valid = None  # (B, max_len) bool, or None: no padding anywhere
        self.length = 0  # positions held, the new ones included
        self.seen = 0  # positions ever added: the next one's position
        self.layer = 0  # which layer's extend() comes next

    def __len__(self):
        return self.length

    def advance(self, valid, T):
        """Makes room for T new positions, valid (B, T) or None for all real.
        Returns the validity of all S positions, or None when none is padding."""
        drop = self.length + T - self.max_len
        if drop > 0:  # full: slide the window, dropping the oldest positions
            keep = self.length - drop
            for buf in (*self.k, *self.v):
                if buf is not None:
                    buf[:, :, :keep] = buf[:, :, drop : self.length].clone()
            if self.valid is not None:
                self.valid[:, :keep] = self.valid[:, drop : self.length].clone()
            self.length = keep
        if valid is not None and self.valid is None:
            self.valid = torch.ones(valid.size(0), self.max_len, dtype=torch.bool, device=valid.device)
        if self.valid is not None:
            self.valid[:, self.length : self.length + T] = True if valid is None else valid
        self.length += T
        self.seen += T
        self.layer = 0
        return None if self.valid is None else self.valid[:, : self.length]

    def extend(self, k, v):
        """Adds this layer's new keys and values; returns them for all S positions."""
        i, self.layer = self.layer, self.layer + 1
        start = self.length - v.size(2)
        if self.v[i] is None:
            B, H, _, hs = v.shape
            self.v[i] = v.new_empty(B, H, self.max_len, hs)
            self.k[i] = None if k is None else k.new_empty(B, H, self.max_len, hs)
        self.v[i][:, :, start : self.length] = v
        if k is not None:
            self.k[i][:, :, start : self.length] = k
        k = None if k is None else self.k[i][:, :, : self.length]
        return k, self.v[i][:, :, : self.length]  # (B, H, S, hs) views of the buffers


@torch.no_grad()
def stream(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
           valid=None, use_cache=True, generator=None):
    """Yields the next token (B, 1) of every row, one step at a time.

    Call model.eval() first. Past block_size the context window moves on.
    With rope, attention reads only offsets between positions, so the cache
    slides a token at a time and is never rebuilt; without a cache the model
    reads the last n_layer * (block_size - 1) + 1 tokens, all that the newest
    one depends on when each query sees block_size keys: both give the same
    tokens. With learned or sinusoidal positions every cached key is wrong
    once the window moves (positions shift), and sliding would mean a rebuild
    every token, as slow as no cache. So the window jumps, dropping its oldest
    quarter: one rebuild per block_size/4 tokens, always at least 3/4 of a
    block of context. Without a cache the window jumps the same way.
    """
    block = model.config.block_size
    slides = model.config.pos == "rope"
    reach = model.config.n_layer * (block - 1) + 1 if slides else block  # the context the newest token reads
    keep = reach if slides else block - max(1, block // 4)  # tokens left in the window after it moves
    idx = idx[:, -block:]
    valid = None if valid is None else valid[:, -block:]
    cache = None
    for _ in range(max_new_tokens):
        if idx.size(1) > reach:
            idx = idx[:, -keep:]
            valid = None if valid is None else valid[:, -keep:]
            cache = cache if slides else None
        if cache is not None:
            logits, _ = model(idx[:, -1:], cache=cache, last_only=True)  # only the newest is not cached
        else:
            cache = KVCache(model.config.n_layer, block) if use_cache else None
            logits, _ = model(idx, valid=valid, cache=cache, last_only=True)
        next_token = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)  # (B, 1)
        idx = torch.cat([idx, next_token], dim=1)
        if valid is not None:
            valid = torch.cat([valid, torch.ones_like(next_token, dtype=torch.bool)], dim=1)
        yield next_token


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """logits (B, V) -> token ids (B, 1). Temperature, then top-k, then top-p.

    temperature 0 is greedy. top_k keeps the k most likely tokens; top_p keeps
    the smallest set whose probabilities add up to at least p (nucleus).
    """
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first stays.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
