"""A GPT built up one idea at a time.

Read from the top. Each class adds one idea, and GPTConfig has a switch for each,
so every rung of the ladder is a model that trains (config/ladder/):

    bigram              each token looks up the next token's logits; no communication
    CausalAverage       each position averages itself and every position before it
    Head                one head of self-attention: scaled dot-product scores
    MultiHeadAttention  several heads side by side, then a projection
    FeedForward         a per-position MLP after the communication
    Block               residual connections and pre-norm LayerNorm around both
    GPT                 embeddings, a stack of blocks, and the output head

Rotary positions, the KV cache and additive scores come in at the multi-head rung; what they
and the rest call by name follows the path, under "Beside the main path". Shapes: B batch, T time,
C channels (n_embd), H heads, hs head size, V vocabulary, S keys (T, or more with a KV cache).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

MIXERS = ("none", "average", "head", "multihead")
POSITIONS = ("learned", "sinusoidal", "rope", "none")
SCORES = ("dot", "additive")
GELUS = ("exact", "tanh")


@dataclass
class GPTConfig:
    vocab_size: int = 65  # rows of the token embedding
    block_size: int = 256  # the longest context the model sees
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    # The ladder's switches; the defaults are the full GPT.
    mixer: str = "multihead"  # how positions communicate: one of MIXERS
    feedforward: bool = True
    residual: bool = True
    layernorm: bool = True
    # Beside the main path.
    pos: str = "learned"  # where each token is: one of POSITIONS
    score: str = "dot"  # how a query scores a key (head, multihead): q·k / sqrt(hs), or additive
    window: int = 0  # each query sees only its `window` newest keys, itself included (0: all)
    bias: bool = True  # biases in Linear and LayerNorm
    tie_weights: bool = True  # the output head shares the token embedding's matrix
    gelu: str = "exact"  # the feed-forward's GELU: exact, or tanh (GPT-2's approximation)
    fused_attention: bool = True  # PyTorch's fused kernel (False: the written-out attention)
    real_vocab_size: int | None = None  # the tokenizer's where vocab_size is padded: logits cut

    def __post_init__(self):
        check_config(self)  # beside the main path

    @property
    def head_size(self):
        return self.n_embd if self.mixer == "head" else self.n_embd // self.n_head


# --- Rung 2: causal averaging -----------------------------------------------------------------


def tril_mask(T, S, device=None):
    """(T, S) bool, the lower triangle (tril): True where query t may see key s, itself and every
    key before it. With S > T the queries are the newest T positions, after S - T cached ones."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)


class CausalAverage(nn.Module):
    """Each position becomes the mean of itself and every earlier position: the simplest way for a
    token to hear of its past. Scores are 0 where a position may look and -inf where it may not; a
    softmax over each row turns them into 1/(t+1). No parameters: every earlier token counts the
    same."""

    def forward(self, x, mask=None):
        B, T, C = x.shape
        mask = tril_mask(T, T, x.device) if mask is None else mask  # a mask given hides padding too
        scores = torch.zeros(T, T, device=x.device, dtype=x.dtype)  # (T, T)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = F.softmax(scores, dim=-1)  # row t: 1/(t+1) up to t, then 0
        return (weights @ x.unsqueeze(1)).view(B, T, C)  # (B, T, C): x as the values of one head


# --- Rung 3: one head of self-attention -----------------------------------------------------


def attention(q, k, v, mask=None, scores=None):
    """(output (..., T, hs), weights (..., T, S)) for queries q (..., T, hs), keys and values k, v
    (..., S, hs). q·k / sqrt(hs) keeps the scores at unit variance, so the softmax does not
    saturate into one-hot; a key a query may not see gets -inf, so weight 0. scores (..., T, S):
    other scores of q and k, to use instead."""
    T, S = q.size(-2), k.size(-2)
    if scores is None:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., T, S)
    mask = tril_mask(T, S, q.device) if mask is None else mask
    weights = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (..., T, S)
    return weights @ v, weights  # (..., T, hs), (..., T, S)


class Head(nn.Module):
    """One head of self-attention: each position asks a question (query), each position says
    what it holds (key), and the answer is a mean of what they hold (value), weighted by how
    well each key matches the question."""

    def __init__(self, config, head_size):
        super().__init__()
        self.query = nn.Linear(config.n_embd, head_size, bias=False)
        self.key = nn.Linear(config.n_embd, head_size, bias=False)
        self.value = nn.Linear(config.n_embd, head_size, bias=False)
        self.weights = None  # the last attention weights, to look at (python -m tinygpt.plot)

    def forward(self, x, mask=None):
        q = self.query(x).unsqueeze(1)  # (B, 1, T, hs): one head, shaped as many will be
        k = self.key(x).unsqueeze(1)  # (B, 1, T, hs)
        v = self.value(x).unsqueeze(1)  # (B, 1, T, hs)
        out, self.weights = attention(q, k, v, mask)  # (B, 1, T, hs), (B, 1, T, T)
        return out.squeeze(1)  # (B, T, hs)


# --- Rung 4: many heads at once -------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """n_head Heads side by side, each n_embd / n_head wide, concatenated and projected back into
    the stream. Their query, key and value matrices are stacked in one Linear, c_attn: one matmul
    for every head, not a Python loop (tests/test_model.py checks that it equals the heads computed
    one by one).

    The options come in here: rope turns queries and keys by position, a KV cache
    (tinygpt/decoding.py) adds earlier keys and values, additive scores replace q·k, and a fused
    kernel computes attention()."""

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        # Every head's query, key and value, in one matrix.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # Dropout on what the heads add to the stream, none on their weights: dropping weights sends
        # a CPU's fused attention back to the written-out math, each step 1.4x as long, for no
        # better val.
        self.resid_dropout = nn.Dropout(config.dropout)
        self.fused = config.fused_attention
        additive = config.score == "additive"
        self.score_vector = score_vectors(config.n_head, config.head_size) if additive else None
        self.keep_weights, self.weights = False, None

    def forward(self, x, mask=None, rope=None, cache=None):
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)  # (B, T, 3, H, hs)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, T, hs)
        if rope is not None:  # turned by position: q·k then depends on the offset alone
            q, k = rotate(q, rope), rotate(k, rope)
        if cache is not None:  # after the keys and values of the positions before
            k, v = cache.extend(k, v)  # (B, H, S, hs)
        if self.fused and not self.keep_weights and self.score_vector is None:
            out = fused_attention(q, k, v, mask)  # (B, H, T, hs)
        else:
            scores = None if self.score_vector is None else additive_scores(q, k, self.score_vector)
            out, weights = attention(q, k, v, mask, scores)  # (B, H, T, hs)
            self.weights = weights if self.keep_weights else None
        out = out.transpose(1, 2).reshape(B, T, C)  # (B, T, C): the heads' outputs side by side
        out = self.c_proj(out)  # (B, T, C)
        return self.resid_dropout(out) if self.training else out  # eval: dropout keeps all


# --- Rung 5: computation per position -------------------------------------------------------


class FeedForward(nn.Module):
    """After the positions have exchanged information, each one thinks it over alone."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = "tanh" if config.gelu == "tanh" else "none"

    def forward(self, x):
        h = F.gelu(self.c_fc(x), approximate=self.approximate)  # (B, T, 4C)
        out = self.c_proj(h)  # (B, T, C)
        return self.dropout(out) if self.training else out


# --- Rungs 6 and 7: residual connections and LayerNorm --------------------------------------


def layer_norm(config):
    """A LayerNorm of the stream, or with `layernorm` off, nothing."""
    return nn.LayerNorm(config.n_embd, bias=config.bias) if config.layernorm else nn.Identity()


class Block(nn.Module):
    """Communication (the mixer), then computation (the feed-forward). With `residual`, each adds to
    a running stream, x + f(x), so the gradient has a direct path to the bottom of a deep stack.
    With `layernorm`, each reads a normalized copy of the stream (pre-norm): a steady scale however
    deep."""

    def __init__(self, config):
        super().__init__()
        self.ln_1, self.ln_2 = layer_norm(config), layer_norm(config)
        if config.mixer == "multihead":
            self.mixer = MultiHeadAttention(config)
        elif config.mixer == "head":  # one head, as wide as the stream
            head = AdditiveHead if config.score == "additive" else Head
            self.mixer = head(config, head_size=config.n_embd)
        else:
            self.mixer = CausalAverage() if config.mixer == "average" else None
        self.ffwd = FeedForward(config) if config.feedforward else None
        self.residual = config.residual

    def forward(self, x, mask=None, rope=None, cache=None):
        if self.mixer is not None:
            beside = (rope, cache) if isinstance(self.mixer, MultiHeadAttention) else ()
            h = self.mixer(self.ln_1(x), mask, *beside)  # (B, T, C)
            x = x + h if self.residual else h
        if self.ffwd is not None:
            h = self.ffwd(self.ln_2(x))  # (B, T, C)
            x = x + h if self.residual else h
        return x


# --- The whole model --------------------------------------------------------------------------


def sinusoidal_positions(block_size, n_embd):
    """(block_size, n_embd) fixed encodings ("Attention Is All You Need"): sines in even channels,
    cosines in odd."""
    pos = torch.arange(block_size).float()[:, None]  # (T, 1)
    freq = torch.exp(torch.arange(0, n_embd, 2).float() * (-math.log(10000.0) / n_embd))  # (C/2,)
    table = torch.zeros(block_size, n_embd)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : n_embd // 2]
    return table


class GPT(nn.Module):
    """Token embeddings and positions in, a stack of blocks, a last LayerNorm, and a head that
    turns each position's vector into logits over the vocabulary for the token after it."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token -> vector
        if config.pos == "learned":
            self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position -> vector
        elif config.pos == "sinusoidal":
            table = sinusoidal_positions(config.block_size, config.n_embd)
            self.register_buffer("pos_table", table, persistent=False)
        elif config.pos == "rope":
            self.register_buffer("rope_rates", rope_rates(config.head_size), persistent=False)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = layer_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:  # one matrix reads tokens in and writes them out
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: each block adds to the stream twice; smaller projections keep its variance from
        # growing.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") and config.residual:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear) and not self.config.residual:
            # Without residual connections each layer's output is the next one's only input: std
            # 0.02 shrinks it 1000x a block, to denormal floats (slow) and a loss stuck at ln(V).
            # 1/sqrt(fan_in) keeps its scale.
            nn.init.normal_(module.weight, std=1 / math.sqrt(module.in_features))
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self):  # each counted once: the tied head shares the embedding's
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None, valid=None, cache=None, last_only=False):
        """idx (B, T) token ids -> logits (B, T, V), and the mean cross-entropy loss given targets
        (B, T). For decoding: valid (B, T) marks the real tokens of left-padded prompts; cache, a
        KVCache, holds the keys and values of the positions before idx; last_only: the last
        position's logits (B, 1, V) alone."""
        pos, mask = where_tokens_are(self.config, idx, valid, cache)  # training: 0 to T - 1, causal
        rope = rope_tables(pos, self.rope_rates) if self.config.pos == "rope" else None
        x = self.wte(idx)  # (B, T, C)
        if self.config.pos == "learned":
            x = x + self.wpe(pos)  # (B, T, C): what the token is, and where
        elif self.config.pos == "sinusoidal":
            x = x + self.pos_table[pos]
        x = self.drop(x) if self.training else x  # dropout, only while training
        for block in self.blocks:
            x = block(x, mask, rope, cache)  # (B, T, C)
        if last_only:
            x = x[:, -1:, :]  # (B, 1, C)
        # (B, T, V): the padded vocabulary's extra rows cut off, never sampled
        logits = self.lm_head(self.ln_f(x))[..., : self.config.real_vocab_size]
        if targets is None:
            return logits, None
        flat = logits.reshape(-1, logits.size(-1)).float()  # (B * T, V)
        return logits, F.cross_entropy(flat, targets.reshape(-1), ignore_index=-1)


# --- Beside the main path ---------------------------------------------------------------------
# What the lesson calls by name: rotary positions, which keys each token may see (windows, padding,
# the KV cache's positions), PyTorch's fused attention, additive scores, and the checks of a config.


def rope_rates(head_size, base=10000.0):
    """(hs,): rotary positions' (RoPE) turning rates. Channels i and i + hs/2 turn together, by
    base^(-2i/hs) per position, so q·k depends on the offset t - s alone. The first half is
    negated: sin(-a) = -sin(a) puts the rotation's minus sign into the sin table, so rotate()
    needs no sign of its own."""
    freq = base ** (-torch.arange(0, head_size, 2).float() / head_size)  # (hs/2,)
    return torch.cat([-freq, freq])


def rope_tables(pos, rates):  # (cos, sin), each (T, hs): the angles rotate() turns positions pos by
    angles = pos[:, None] * rates  # (T, hs)
    return angles.cos(), angles.sin()


def rotate(x, rope):
    """x (..., T, hs) with each pair (x1, x2) turned by its angle: (x1 cos - x2 sin, x1 sin + x2
    cos); roll swaps the halves. In x's dtype: fp32 tables would promote a bf16 step to fp32, 5%
    slower on a CPU."""
    cos, sin = (table.to(x.dtype) for table in rope)  # each (T, hs), from rope_tables
    # x cos + roll(x) sin, (..., T, hs)
    return torch.addcmul(x * cos, x.roll(x.size(-1) // 2, dims=-1), sin)


def where_tokens_are(config, idx, valid=None, cache=None):
    """(pos, mask) for idx (B, T), the tokens after the cache's. pos (T,) or (B, T): each token's
    position, from its row's first real token (valid (B, T) marks those of left-padded prompts).
    mask (T, S), (B, 1, T, S) or None: the keys each query may see. cache.advance(valid, T) makes
    room for T positions and returns the validity of all S (None: no padding); len(cache) is S;
    cache.seen counts positions ever added, .dropped those slid past."""
    T, past = idx.size(1), 0 if cache is None else cache.seen
    relative = config.pos == "rope"  # offsets only: past block_size too
    if past + T > config.block_size and not relative or cache is not None and T > config.block_size:
        raise ValueError(f"sequence of {past + T} tokens is longer than block_size "
                         f"{config.block_size}")
    pos = torch.arange(past, past + T, device=idx.device)  # (T,)
    if cache is None and valid is None:  # training: every key is new, none is padding
        return pos, causal_mask(config, T, T, idx.device)
    all_valid = valid if cache is None else cache.advance(valid, T)  # (B, S), or None
    band = causal_mask(config, T, T if cache is None else len(cache), idx.device)  # (T, S), or None
    if all_valid is None:
        return pos, band
    if not relative:  # from each row's first real token, and past those a window's cache slid by
        pos = (all_valid.cumsum(dim=1) - 1).clamp(min=0)[:, -T:]  # (B, T)
        pos = pos + (0 if cache is None else cache.dropped)
    mask = padding_mask(all_valid, T)  # (B, 1, T, S)
    return pos, mask if band is None else mask & band


def causal_mask(config, T, S, device):
    """(T, S) for the last T of S positions: each query sees the keys up to itself, its `window`
    newest at most (block_size's without one). None where the fused kernel needs no mask (T == S
    within the window, or one query); the written-out attention always gets it, so a traced graph
    (ONNX) cuts the window at any length."""
    span = config.window or config.block_size
    needed = S > span or T not in (1, S) or not config.fused_attention
    return tril_mask(T, S, device).triu(diagonal=S - T - span + 1) if needed else None


def padding_mask(valid, T):
    """(B, 1, T, S) for the last T of S positions, given valid (B, S): causal, and no padding key.
    Each query always sees itself, so a padding query's softmax is never over nothing."""
    S = valid.size(1)
    keys = torch.arange(S, device=valid.device)
    itself = keys[None, :] == keys[S - T :, None]  # (T, S): query t's own position
    return (tril_mask(T, S, valid.device) & valid[:, None, None, :]) | itself


def fused_attention(q, k, v, mask=None):
    """attention()'s output from PyTorch's fused kernel, which keeps no weights (no mask: causal, or
    one query). On a CPU under bf16 autocast it runs in fp32: its bf16 backward there takes ~5x as
    long."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return fused_attention(q.float(), k.float(), v.float(), mask)
    return F.scaled_dot_product_attention(q, k, v, mask, is_causal=mask is None and q.size(-2) > 1)


def additive_scores(q, k, score_vector):
    """Additive (Bahdanau) scores wᵀ tanh(q + k), (B, H, T, S), for q (B, H, T, hs) and k
    (B, H, S, hs); score_vector (H * hs,) holds each head's w. The backward keeps its
    (B, H, T, S, hs) intermediate, which no fused kernel avoids: batch 64, block 256, 6 heads of 64
    need 6.4 GB a layer, not 0.1."""
    hidden = torch.tanh(q.unsqueeze(-2) + k.unsqueeze(-3))  # (B, H, T, S, hs)
    return torch.einsum("bhtsd,hd->bhts", hidden, score_vector.view(q.size(1), -1))  # (B, H, T, S)


def score_vectors(n_head, head_size):  # additive_scores' w, flat: a vector, no weight decay or Muon
    return nn.Parameter(torch.randn(n_head * head_size) / math.sqrt(head_size))


class AdditiveHead(Head):
    """One head with additive scores instead of the dot product (the ladder's rung 3b)."""

    def __init__(self, config, head_size):
        super().__init__(config, head_size)
        self.score_vector = score_vectors(1, head_size)

    def forward(self, x, mask=None):
        q, k, v = (f(x).unsqueeze(1) for f in (self.query, self.key, self.value))  # (B, 1, T, hs)
        scores = additive_scores(q, k, self.score_vector)  # (B, 1, T, T)
        out, self.weights = attention(q, k, v, mask, scores)  # (B, 1, T, hs)
        return out.squeeze(1)  # (B, T, hs)


def check_config(config):
    """A ValueError for switches that cannot go together, or sizes that cannot be."""
    for name, allowed in ("mixer", MIXERS), ("pos", POSITIONS), ("gelu", GELUS), ("score", SCORES):
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {getattr(config, name)!r}")
    for name in ("vocab_size", "block_size", "n_embd"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(config, name)}")
    if config.mixer == "multihead" and config.n_embd % config.n_head:
        raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
    if config.pos == "rope" and (config.mixer != "multihead" or config.head_size % 2):
        raise ValueError(f"pos 'rope' turns pairs of query and key channels: it needs mixer "
                         f"multihead and an even head size, got mixer {config.mixer!r}, head size "
                         f"{config.head_size}")
    if config.score == "additive" and (config.pos == "rope" or config.mixer in ("none", "average")):
        raise ValueError("score 'additive' needs mixer head or multihead and a pos other than rope "
                         "(whose angles cancel in q·k, not in q + k); got mixer "
                         f"{config.mixer!r}, pos {config.pos!r}")
    if not 0 <= config.window <= config.block_size:
        raise ValueError(f"window must be 0 (all keys) to block_size ({config.block_size}), got "
                         f"{config.window}")
    if config.real_vocab_size is not None and not 1 <= config.real_vocab_size <= config.vocab_size:
        raise ValueError(f"real_vocab_size must be 1 to vocab_size ({config.vocab_size}), got "
                         f"{config.real_vocab_size}")
