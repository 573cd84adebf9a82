"""Decoding: the model knows only forward(); this module decides which positions to feed it (stream, generate),
keeps the keys and values of those it has seen (KVCache), steps one token through the model unrolled (on a CUDA GPU,
if asked, replayed from a CUDA graph), and picks each next token from the logits (sample_next).
"""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import UserError
from model import GPT, Block, FeedForward, MultiHeadAttention, fused_attention, rope_tables, rotate


class KVCache:
    """Keys and values of every layer for the positions seen, so a new token costs one position of work, in buffers
    max_len long (the most keys a query sees: block_size, or the window), filled in place. Once full, the cache
    slides (past block_size only rope allows it); more new positions than fit are attended to whole, the newest kept."""

    def __init__(self, n_layer, max_len):
        self.max_len = max_len
        self.k = [None] * n_layer  # each (B, H, max_len, hs) once used
        self.v = [None] * n_layer
        self.valid = None  # (B, max_len) bool, or None: no padding anywhere
        self.length = 0  # positions this step attends to (S): the held ones and the new
        self.seen = 0  # positions ever added: the next one's position
        self.real = 0  # real (not padding) tokens ever added, per row (B, 1) once there is padding
        self.dropped = 0  # real tokens before the first one attended to, per row: the window slid past them
        self.layer = 0  # which layer's extend() comes next
        self.write = 0  # the slot this step's first new position goes to
        self.oldest = 0  # the slot of the oldest position held: 0 until a full cache slides
        self.slot = None  # for a CUDA graph's step (GraphedStep): the new position's slot, a (1,) tensor
        self.graph = None  # that GraphedStep, made after the prompt, freed with the cache

    def __len__(self):
        return self.length

    def nbytes(self):
        """Bytes in the key and value buffers: they never grow past max_len positions."""
        return sum(buf.numel() * buf.element_size() for buf in (*self.k, *self.v) if buf is not None)

    def advance(self, valid, T):
        """Makes room for T new positions, valid (B, T) or None for all real. Returns
        the validity of the S positions they attend to, or None when none is padding."""
        held = min(self.length, self.max_len)  # a step that overflowed kept only the newest max_len
        self.layer = 0
        if T == 1 and held == self.max_len and valid is None:
            # Full, and one real token: it takes the oldest one's slot, and the buffers become a ring. Its one
            # query sees every key, and softmax does not care in what order: nothing is copied, no key moves.
            self.write, self.oldest = self.oldest, (self.oldest + 1) % self.max_len
            self.length, self.seen = held, self.seen + 1
            if self.valid is None:
                return None
            self.valid[:, self.write] = True
            self.real = self.real + 1
            self.dropped = self.real - self.valid.sum(dim=1, keepdim=True)  # (B, 1)
            return self.valid  # in the buffers' order, as the keys are
        slide = int(T == 1 and held == self.max_len)  # full, and a token that may be padding: the window slides
        if self.oldest or slide:  # the keys back in order after the ring turned, then one place on if sliding
            for buf in (*self.k, *self.v):
                if buf is not None:
                    buf.copy_(buf.roll(-self.oldest - slide, dims=2))
            if self.valid is not None:
                self.valid.copy_(self.valid.roll(-self.oldest - slide, dims=1))
            self.oldest, held = 0, held - slide
        self.length, self.write = held + T, held
        if valid is not None and self.valid is None:
            self.valid = torch.ones(valid.size(0), self.max_len, dtype=torch.bool, device=valid.device)
            self.real = self.seen  # every token before this one was real
        self.seen += T
        if self.valid is None:
            return None
        new = torch.ones(self.valid.size(0), T, dtype=torch.bool, device=self.valid.device) if valid is None else valid
        all_valid = torch.cat([self.valid[:, :held], new], dim=1)  # (B, S)
        self.valid[:, : min(self.length, self.max_len)] = all_valid[:, -self.max_len :]
        self.real = self.real + new.sum(dim=1, keepdim=True)  # (B, 1)
        self.dropped = self.real - all_valid.sum(dim=1, keepdim=True)  # (B, 1)
        return all_valid

    def extend(self, k, v):
        """Adds this layer's new keys and values; returns them for all S positions (a graph's step: the whole
        buffers, masked by GraphedStep)."""
        i, self.layer = self.layer, self.layer + 1
        if self.slot is not None:  # one position, at slot; the whole buffers, of one shape at every step
            self.k[i].index_copy_(2, self.slot, k)
            self.v[i].index_copy_(2, self.slot, v)
            return self.k[i], self.v[i]  # (B, H, max_len, hs)
        if self.v[i] is None:
            B, H, _, hs = v.shape
            # Zeros, not whatever memory held: a graph's step reads every slot, and 0 weight times a NaN is NaN.
            self.k[i], self.v[i] = k.new_zeros(B, H, self.max_len, hs), v.new_zeros(B, H, self.max_len, hs)
        T, S = k.size(2), self.length  # S - T held before this step
        if S <= self.max_len:  # room for them: written in place, read as views of the buffers
            self.k[i].narrow(2, self.write, T).copy_(k)  # [:, :, write:write + T] = k, a few us sooner
            self.v[i].narrow(2, self.write, T).copy_(v)
            return self.k[i].narrow(2, 0, S), self.v[i].narrow(2, 0, S)  # (B, H, S, hs)
        # More than the buffers hold: attend to copies, and keep the newest max_len.
        k = torch.cat([self.k[i][:, :, : S - T], k], dim=2)  # (B, H, S, hs)
        v = torch.cat([self.v[i][:, :, : S - T], v], dim=2)
        self.k[i].copy_(k[:, :, -self.max_len :])
        self.v[i].copy_(v[:, :, -self.max_len :])
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
           valid=None, use_cache=True, generator=None, new_cache=KVCache, cuda_graphs=False):
    """Yields the next token (B, 1) of every row, one step at a time; call model.eval() first. Past block_size, with
    rope (attention reads only offsets) the cache slides a token at a time, and without one the model reads the last
    n_layer * (span - 1) + 1 tokens, all the newest depends on when each query sees its span newest keys: both give the
    same tokens. With learned or sinusoidal positions every cached key is wrong once the window moves, so it jumps,
    dropping its oldest quarter, with a cache or without. new_cache(n_layer, max_len) makes the caches; cuda_graphs:
    on a CUDA GPU, each cached step replayed from a CUDA graph (GraphedStep)."""
    block = model.config.block_size
    span = model.config.window or block  # the most keys a query sees
    slides = model.config.pos == "rope"
    reach = model.config.n_layer * (span - 1) + 1 if slides else block  # the context the newest token reads
    keep = reach if slides else max(1, block - max(1, block // 4))  # tokens left in the window after it moves
    idx = idx[:, -block:]
    valid = None if valid is None else valid[:, -block:]
    cache = None
    step = unrolled_step(model, cuda_graphs and graphs_apply(idx)) if valid is None else None  # padding: forward()
    for _ in range(max_new_tokens):
        if idx.size(1) > reach:
            idx = idx[:, -keep:]
            valid = None if valid is None else valid[:, -keep:]
            cache = cache if slides else None
        if cache is not None:  # only the newest token is not cached
            with faster_cpu_kernels(positions=1):
                logits = step(idx[:, -1:], cache) if step else model(idx[:, -1:], cache=cache, last_only=True)[0]
        else:
            attends = model.config.mixer == "multihead"  # the rungs before keep no keys to cache
            cache = new_cache(model.config.n_layer, span) if use_cache and attends else None
            with faster_cpu_kernels(positions=idx.size(1)):
                logits, _ = model(idx, valid=valid, cache=cache, last_only=True)
        next_token = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)  # (B, 1)
        idx = torch.cat([idx, next_token], dim=1)
        if valid is not None:
            valid = torch.cat([valid, torch.ones_like(next_token, dtype=torch.bool)], dim=1)
        yield next_token


def unrolled_step(model, graphs=False):
    """model.forward for one new token per row after cached ones, unrolled: (token (B, 1), cache) -> logits (B, 1, V),
    the same kernels on the same tensors, so the same logits to the bit, without the Python around the modules: 1.46x
    forward()'s tokens/s for 4 layers of 128 (docs/results.md). It covers the GPT as trained (multi-head dot-product
    attention in the fused kernel, feed-forward, residuals, LayerNorm), any positions, no padding; else, or for a module
    a caller has hooked or replaced, None: model.forward runs. graphs: each step replayed from a CUDA graph
    (GraphedStep), over the whole cache with a mask: the same logits to rounding, not to the bit."""
    c = model.config
    full_gpt = (c.mixer, c.score, c.feedforward, c.residual, c.layernorm, c.fused_attention) == (
        "multihead", "dot", True, True, True, True)
    plain = {GPT, Block, MultiHeadAttention, FeedForward, nn.Dropout,
             nn.ModuleList, nn.Embedding, nn.LayerNorm, nn.Linear}
    untouched = all(type(m) in plain and not (m._forward_hooks or m._forward_pre_hooks) for m in model.modules())
    if model.training or not full_gpt or not untouched or any(b.mixer.keep_weights for b in model.blocks):
        return None  # keep_weights: a caller wants attention weights, which only forward() keeps
    H, C, eps = c.n_head, c.n_embd, model.ln_f.eps
    layers = [(b.ln_1.weight, b.ln_1.bias, b.mixer.c_attn.weight, b.mixer.c_attn.bias, b.mixer.c_proj.weight,
               b.mixer.c_proj.bias, b.ln_2.weight, b.ln_2.bias, b.ffwd.c_fc.weight, b.ffwd.c_fc.bias,
               b.ffwd.c_proj.weight, b.ffwd.c_proj.bias, b.ffwd.approximate) for b in model.blocks]
    table = model.wpe.weight if c.pos == "learned" else model.pos_table if c.pos == "sinusoidal" else None

    def core(token, pos, cache, mask=None):  # pos: the token's position, an int or (1,); mask: the keys it sees
        B = token.size(0)
        x = F.embedding(token, model.wte.weight)  # (B, 1, C)
        if table is not None:
            x = x + table[pos]
        rope = rope_tables(pos, model.rope_rates) if c.pos == "rope" else None
        for ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, out_w, out_b, gelu in layers:
            h = F.layer_norm(x, (C,), ln1_w, ln1_b, eps)
            qkv = F.linear(h, attn_w, attn_b).view(B, 1, 3, H, C // H).permute(2, 0, 3, 1, 4)  # (3, B, H, 1, hs)
            q, k, v = qkv.unbind(0)
            if rope is not None:
                q, k = rotate(qkv[:2], rope).unbind(0)
            k, v = cache.extend(k, v)  # (B, H, S, hs)
            h = fused_attention(q, k, v, mask).transpose(1, 2).reshape(B, 1, C)  # (B, 1, C)
            x = x + F.linear(h, proj_w, proj_b)
            h = F.layer_norm(x, (C,), ln2_w, ln2_b, eps)
            x = x + F.linear(F.gelu(F.linear(h, fc_w, fc_b), approximate=gelu), out_w, out_b)
        x = F.layer_norm(x, (C,), model.ln_f.weight, model.ln_f.bias, eps)
        return F.linear(x, model.lm_head.weight)[..., : c.real_vocab_size]  # (B, 1, V)

    def step(token, cache):
        cache.advance(None, 1)
        if graphs:
            cache.graph = cache.graph or GraphedStep(core, cache, token)
            return cache.graph(token, cache)
        pos = cache.seen - 1  # an int: it indexes the table 2% sooner than a tensor
        return core(token, torch.arange(pos, pos + 1, device=token.device) if c.pos == "rope" else pos, cache)

    return step


def graphs_apply(idx):
    """Whether decoding idx replays its steps from CUDA graphs: on a CUDA GPU, where Python's launches are the step."""
    return idx.is_cuda


class GraphedStep:
    """unrolled_step's core on a CUDA GPU, replayed from a CUDA graph: a token's few hundred kernels in one launch,
    where launching them from Python takes longer than running them. A graph's shapes and addresses are fixed, so it
    attends to the cache's whole buffers, the slots not yet written masked out, and reads the token, its position and
    its slot from tensors that each step fills first. The first step runs as is, then is captured (capture)."""

    def __init__(self, core, cache, token):
        self.core, self.graph = core, None
        self.token, self.pos = torch.zeros_like(token), torch.zeros(1, dtype=torch.long, device=token.device)
        cache.slot = torch.zeros(1, dtype=torch.long, device=token.device)

    def __call__(self, token, cache):  # cache: advanced for this step
        self.token.copy_(token)
        self.pos.fill_(cache.seen - 1)
        cache.slot.fill_(cache.write)
        if self.graph is not None:
            self.graph.replay()
            return self.logits.clone()  # the next replay writes over self.logits

        def run():  # this step, from its first layer
            cache.layer = 0
            # The slots written: up to the position's while the cache fills them in order, then all of them.
            written = (torch.arange(cache.max_len, device=self.pos.device) <= self.pos)[None]  # (1, max_len)
            return self.core(self.token, self.pos, cache, written)

        logits, self.graph, self.logits = capture(run)
        return logits


def capture(fn):
    """(fn(), graph, its output): fn run once as is, then again with its kernels captured in a CUDA graph, not run;
    graph.replay() runs them on the same tensors, into that output. Both on one side stream, so that the libraries'
    handles for it exist before the capture; autocast's cache of cast weights off in the capture."""
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    uncached = torch.autocast("cuda", torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cuda"),
                              cache_enabled=False)
    with torch.cuda.stream(stream):
        out = fn()
        with torch.cuda.graph(graph, stream=stream), uncached:
            replayed = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return out, graph, replayed


@contextlib.contextmanager
def faster_cpu_kernels(positions):
    """PyTorch's own CPU kernels instead of oneDNN's where faster (docs/results.md): fp32, 1.0-1.3x, and bf16 on one
    position; bf16 on many keeps oneDNN (5x there). Set by hand: mkldnn.flags' arguments differ across torch 2.x."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled and positions > 1 and torch.is_autocast_enabled("cpu")
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """logits (B, V) -> token ids (B, 1). Temperature (0: greedy), then top_k (the k likeliest tokens),
    then top_p (the smallest set whose probabilities add up to at least p: nucleus)."""
    if not torch.isfinite(logits).all():  # NaN weights (a damaged checkpoint), or an overflow: nothing to sample
        raise UserError("the model's scores for the next token are NaN or infinite: its weights are damaged or "
                        "overflow; sample from another checkpoint (--checkpoint), or retrain")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    # The largest logit 0, the temperature at least fp32's smallest normal: no tiny temperature overflows or is 0.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(logits.dtype).tiny)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first stays (a top_p of 1e-300 is 0 in fp32).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
