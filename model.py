"""A GPT built up one idea at a time.

Read from the top. Each class adds one idea, and `GPTConfig` has a switch for
each, so every rung of the ladder is a model that trains (see config/ladder/):

    bigram            each token looks up its next-token logits; no communication
    CausalAverage     each position averages itself and everything before it
    Head              one head of self-attention: scaled dot-product, or additive scores
    MultiHeadAttention  several heads in parallel, one fused q/k/v projection
    FeedForward       a per-position MLP after the communication
    Block             residual connections and pre-norm LayerNorm around both
    GPT               embeddings, a stack of blocks, and the output head

Shapes: B batch, T time (positions), C channels (n_embd), H heads, V vocabulary,
S key positions (equals T unless a KV cache holds earlier positions), hs head size.
This file knows nothing of files or tokenizers: ids in, logits out.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinygpt import decoding as generate  # the KV cache and the decoding loop, kept apart from the lesson
from tinygpt.positions import (  # the encodings past a learned table
    rope_rates,
    rope_tables,
    rotate,
    sinusoidal_positions,
)

MIXERS = ("none", "average", "head", "multihead")
SCORES = ("dot", "additive")  # how a query scores a key: q·k/sqrt(hs), or wᵀ tanh(q + k)
POSITIONS = ("learned", "sinusoidal", "rope", "none")
GELUS = ("exact", "tanh")  # tanh: the approximation GPT-2 was trained with


@dataclass
class GPTConfig:
    vocab_size: int = 65  # rows of the embedding: the tokenizer's, maybe padded (padded_vocab_size)
    real_vocab_size: int | None = None  # the tokenizer's; logits past it are padding, cut off
    block_size: int = 256  # the longest context the model sees
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm
    # The ladder's switches; the defaults are the full GPT.
    mixer: str = "multihead"  # how positions communicate: one of MIXERS
    feedforward: bool = True
    residual: bool = True
    layernorm: bool = True
    pos: str = "learned"  # position encoding: one of POSITIONS
    tie_weights: bool = True  # output head shares the token embedding matrix
    gelu: str = "exact"  # the feed-forward's GELU: one of GELUS
    fused_attention: bool = True  # F.scaled_dot_product_attention vs written out
    score: str = "dot"  # how a query scores a key, in head and multihead: one of SCORES
    window: int = 0  # each query sees only its `window` newest keys, itself included (0: all of them)

    def __post_init__(self):
        for name, allowed in (("mixer", MIXERS), ("pos", POSITIONS), ("gelu", GELUS), ("score", SCORES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.mixer == "multihead" and self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.pos == "rope" and (self.mixer not in ("head", "multihead") or self.head_size % 2):
            raise ValueError(f"pos 'rope' turns pairs of query and key channels: it needs mixer head or "
                             f"multihead and an even head size, got mixer {self.mixer!r}, head size {self.head_size}")
        if self.score == "additive" and (self.pos == "rope" or self.mixer not in ("head", "multihead")):
            raise ValueError(f"score 'additive' needs mixer head or multihead and a pos other than rope (whose angles "
                             f"cancel in q·k, not in q + k); got mixer {self.mixer!r}, pos {self.pos!r}")
        for name in ("vocab_size", "block_size", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.window <= self.block_size:
            raise ValueError(f"window must be 0 (all keys) to block_size ({self.block_size}), got {self.window}")
        if self.real_vocab_size is not None and not 1 <= self.real_vocab_size <= self.vocab_size:
            raise ValueError(f"real_vocab_size must be 1 to vocab_size ({self.vocab_size}), got {self.real_vocab_size}")

    @property
    def head_size(self):
        return self.n_embd if self.mixer == "head" else self.n_embd // self.n_head


def padded_vocab_size(n, multiple=64):
    """n rounded up to a multiple: GPU matmuls run faster on round sizes (50257 -> 50304)."""
    return -(-n // multiple) * multiple


# --- Masks and dropout ------------------------------------------------------------


def causal_mask(T, S, device=None, window=None):
    """(T, S) bool: query t (the last T of S positions) may see keys up to itself,
    and with a window only the `window` newest of those."""
    # With S > T the queries are the newest positions, after S - T cached ones.
    mask = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)
    return mask if window is None else mask.triu(diagonal=S - T - window + 1)


def attention_mask(valid, T):
    """(B, 1, T, S) bool for the last T of S positions, given valid (B, S) bool.

    A key is visible when it is not in the future and not padding. Each query
    always sees itself, so a padding query's softmax is never over nothing.
    """
    B, S = valid.shape
    causal = causal_mask(T, S, valid.device)  # (T, S)
    keys = torch.arange(S, device=valid.device)
    itself = keys[None, :] == keys[S - T:, None]  # (T, S): query t's own position
    return (causal & valid[:, None, None, :]) | itself  # (B, 1, T, S)


class Dropout(nn.Dropout):
    """nn.Dropout, but free while it does nothing (eval, or p = 0): x comes back without a
    call into torch, ~3 us less on a CPU, and each generated token passes nine of them."""

    def forward(self, x):
        return F.dropout(x, self.p) if self.training and self.p > 0 else x


# --- Rung 2: causal averaging -----------------------------------------------------


class CausalAverage(nn.Module):
    """Each position becomes the mean of itself and every earlier position.

    The weights come from a lower-triangular (tril) mask: scores of zero where a
    position may look, -inf where it may not, then a softmax over each row turns
    the zeros into 1/(t+1). No parameters: every earlier token counts the same.
    """

    def forward(self, x, mask=None, cache=None, rope=None):
        B, T, C = x.shape
        v = x.unsqueeze(1)  # (B, 1, T, C): one "head" whose values are the inputs
        if cache is not None:
            _, v = cache.extend(None, v)  # (B, 1, S, C)
        S = v.size(2)
        if mask is None:
            mask = causal_mask(T, S, x.device)
        scores = torch.zeros(T, S, device=x.device, dtype=x.dtype).masked_fill(~mask, float("-inf"))  # (B?, 1?, T, S)
        weights = F.softmax(scores, dim=-1)  # each row: 1/(number visible) where visible
        return (weights @ v).reshape(B, T, C)  # (B, T, C)


# --- Rung 3: one head of self-attention --------------------------------------------


def explicit_attention(q, k, v, mask=None, dropout=None, score_vector=None):
    """Attention written out. Returns (output, weights).

    q (..., T, hs), k and v (..., S, hs). Scaled dot-product scores, where scaling
    by 1/sqrt(hs) keeps them at unit variance, so the softmax does not saturate
    into one-hot; or, given a score_vector, additive ones (additive_scores).
    """
    T, S = q.size(-2), k.size(-2)
    if score_vector is None:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., T, S)
    else:
        scores = additive_scores(q, k, score_vector)  # (..., T, S)
    if mask is None:
        mask = causal_mask(T, S, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))  # no looking ahead, no padding
    weights = F.softmax(scores, dim=-1)  # (..., T, S)
    if dropout is not None:
        weights = dropout(weights)
    return weights @ v, weights  # (..., T, hs), (..., T, S)


def fused_attention(q, k, v, mask=None, dropout_p=0.0):
    """explicit_attention's output from PyTorch's fused kernel, which keeps no weights.
    On a CPU it runs in fp32 under bf16 autocast: there its bf16 backward takes ~5x as
    long as fp32's, more than the bf16 matmuls around it save."""
    T, S = q.size(-2), k.size(-2)
    if mask is None and S != T and T > 1:  # is_causal describes only the square case: a mask
        mask = causal_mask(T, S, q.device)  # one query (the newest) sees every key: none needed
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):  # q, k, v bf16, or fp32 from a caller
        with torch.autocast("cpu", enabled=False):
            return fused_attention(q.float(), k.float(), v.float(), mask, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal=mask is None and S == T)


def additive_scores(q, k, score_vector):
    """Additive (Bahdanau) scores wᵀ tanh(q + k), a small network where the dot product is a product:
    (B, H, T, S) for q (B, H, T, hs) and k (B, H, S, hs), already W_q x and W_k x (the head's query and
    key projections); score_vector (H * hs,) holds each head's w. Its (B, H, T, S, hs) intermediate
    is hs times the scores' memory, kept for the backward pass (tanh's gradient reads it), and no
    fused kernel avoids it: batch 64, block 256, 6 heads of 64 need 6.4 GB a layer, not 0.1."""
    hidden = torch.tanh(q.unsqueeze(-2) + k.unsqueeze(-3))  # (B, H, T, S, hs)
    return torch.einsum("bhtsd,hd->bhts", hidden, score_vector.view(q.size(1), -1))  # (B, H, T, S)


def score_vectors(n_head, head_size):  # additive_scores' w, flat: a vector, so no weight decay, no Muon
    return nn.Parameter(torch.randn(n_head * head_size) / math.sqrt(head_size))


class Head(nn.Module):
    """One head of self-attention: each position asks a question (query), each
    position advertises what it holds (key), and the answer is a weighted mean
    of what they hold (value), weighted by how well key matches query."""

    def __init__(self, config, head_size):
        super().__init__()
        self.query = nn.Linear(config.n_embd, head_size, bias=False)
        self.key = nn.Linear(config.n_embd, head_size, bias=False)
        self.value = nn.Linear(config.n_embd, head_size, bias=False)
        self.dropout = Dropout(config.dropout)
        self.score_vector = score_vectors(1, head_size) if config.score == "additive" else None
        self.weights = None  # the last attention weights, kept for inspection

    def forward(self, x, mask=None, cache=None, rope=None):
        q = self.query(x).unsqueeze(1)  # (B, 1, T, hs)
        k = self.key(x).unsqueeze(1)  # (B, 1, T, hs)
        v = self.value(x).unsqueeze(1)  # (B, 1, T, hs)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)  # cached keys keep their rotation
        if cache is not None:
            k, v = cache.extend(k, v)  # (B, 1, S, hs)
        out, self.weights = explicit_attention(q, k, v, mask, self.dropout, self.score_vector)  # (B, 1, T, hs)
        return out.squeeze(1)  # (B, T, hs)


# --- Rung 4: many heads at once -------------------------------------------------


class MultiHeadAttention(nn.Module):
    """n_head heads side by side, each of size n_embd / n_head, then a projection.

    The per-head query/key/value matrices are stacked into one Linear, so the
    heads cost one matmul instead of a Python loop. Dot-product scores run in PyTorch's
    fused kernel by default; `fused_attention=False`, setting `keep_weights`, or additive
    scores (no kernel computes them) run the written-out version above, which keeps weights.
    """

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = Dropout(config.dropout)
        self.resid_dropout = Dropout(config.dropout)
        self.fused = config.fused_attention
        self.score_vector = score_vectors(config.n_head, config.head_size) if config.score == "additive" else None
        self.keep_weights = False
        self.weights = None

    def forward(self, x, mask=None, cache=None, rope=None):
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hs)
        if rope is not None:  # queries and keys turned together; cached keys keep their rotation
            qk, v = qkv.split((2, 1))  # one piece each, where qkv[:2] and qkv[2] zero-fill a gradient each
            (q, k), v = rotate(qk, rope).unbind(0), v.squeeze(0)  # each (B, H, T, hs)
        else:
            q, k, v = qkv.unbind(0)  # three views, one call
        if cache is not None:
            k, v = cache.extend(k, v)  # (B, H, S, hs)
        if self.fused and not self.keep_weights and self.score_vector is None:
            out = fused_attention(q, k, v, mask, self.attn_dropout.p if self.training else 0.0)  # (B, H, T, hs)
        else:
            out, weights = explicit_attention(q, k, v, mask, self.attn_dropout, self.score_vector)  # (B, H, T, hs)
            self.weights = weights if self.keep_weights else None
        out = out.transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads side by side
        return self.resid_dropout(self.c_proj(out))


# --- Rung 5: computation per position ---------------------------------------------


class FeedForward(nn.Module):
    """After positions have exchanged information, each one thinks it over alone."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = Dropout(config.dropout)
        self.approximate = "tanh" if config.gelu == "tanh" else "none"

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))  # (B, T, C)


# --- Rungs 6 and 7: residual connections and LayerNorm ----------------------------


class Block(nn.Module):
    """Communication (the mixer) then computation (feed-forward).

    With `residual`, each sub-layer adds to a running stream, x + f(x), so the
    gradient has a direct path to the bottom of a deep stack. With `layernorm`,
    each sub-layer sees a normalized copy of the stream (pre-norm), which keeps
    activations at a steady scale however deep the stack.
    """

    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        norm = (lambda: nn.LayerNorm(C, bias=config.bias)) if config.layernorm else nn.Identity
        self.ln_1, self.ln_2 = norm(), norm()
        mixers = {
            "none": lambda: None,
            "average": CausalAverage,
            "head": lambda: Head(config, head_size=C),  # one head, as wide as the stream
            "multihead": lambda: MultiHeadAttention(config),
        }
        self.mixer = mixers[config.mixer]()
        self.ffwd = FeedForward(config) if config.feedforward else None
        self.residual = config.residual

    def forward(self, x, mask=None, cache=None, rope=None):
        if self.mixer is not None:
            h = self.mixer(self.ln_1(x), mask, cache, rope)  # (B, T, C)
            x = x + h if self.residual else h
        if self.ffwd is not None:
            h = self.ffwd(self.ln_2(x))  # (B, T, C)
            x = x + h if self.residual else h
        return x


# --- The whole model ----------------------------------------------------------------


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        C = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, C)  # token -> vector
        if config.pos == "learned":
            self.wpe = nn.Embedding(config.block_size, C)
        elif config.pos == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_positions(config.block_size, C), persistent=False)
        elif config.pos == "rope":
            self.register_buffer("rope_rates", rope_rates(config.head_size), persistent=False)
        self.drop = Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(C, bias=config.bias) if config.layernorm else nn.Identity()
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        if config.tie_weights:
            # The same matrix reads tokens in and writes them out: similar tokens
            # get similar vectors either way, and it saves V*C parameters.
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") and config.residual:
                # Each block adds its output to the residual stream twice; scaling
                # keeps the stream's variance from growing with depth (GPT-2).
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * max(config.n_layer, 1)))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear) and not self.config.residual:
            # Without residual connections each layer's output is the next one's only
            # input: std 0.02 shrinks it 1000x or more per block, to denormal floats (slow
            # on CPUs) and a loss stuck at ln(V). 1/sqrt(fan_in) keeps its scale.
            nn.init.normal_(module.weight, mean=0.0, std=1 / math.sqrt(module.in_features))
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self):  # each counted once: the tied head shares the embedding's
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None, valid=None, cache=None, last_only=False):
        """idx (B, T) token ids -> logits (B, T, V), and the mean loss if targets.

        valid (B, T) bool marks real tokens when prompts are left-padded; their
        positions then count from each row's first real token. With a cache,
        idx holds only the new positions and the cache supplies the rest.
        last_only: the last position's logits (B, 1, V) alone, all that generation needs.
        """
        B, T = idx.shape
        block, relative = self.config.block_size, self.config.pos == "rope"
        past = 0 if cache is None else cache.seen
        if (past + T > block and not relative) or (cache is not None and T > block):
            raise ValueError(f"sequence of {past + T} tokens is longer than block_size {block}")
        all_valid = valid if cache is None else cache.advance(valid, T)  # (B, S) or None: no padding
        if all_valid is None or relative:  # rope reads offsets only, and left-padding keeps those
            pos = torch.arange(past, past + T, device=idx.device)  # (T,)
        else:  # each row counts from its first real token, and from those a window's cache slid past
            pos = (all_valid.cumsum(dim=1) - 1).clamp(min=0)[:, -T:] + (0 if cache is None else cache.dropped)
        mask = None if all_valid is None else attention_mask(all_valid, T)  # (B, 1, T, S); None: plainly causal
        S, span = (T if cache is None else len(cache)), self.config.window or block
        if S > span:  # a window, or rope past block_size: each query sees only the span newest keys
            band = causal_mask(T, S, idx.device, window=span)  # (T, S)
            mask = band if mask is None else mask & band
        x = self.wte(idx)  # (B, T, C)
        if self.config.pos == "learned":
            x = x + self.wpe(pos)
        elif self.config.pos == "sinusoidal":
            x = x + self.pos_table[pos]
        rope = None
        if relative:  # the same angles for every head, at any position
            rope = rope_tables(pos, self.rope_rates)  # (cos, sin), each (T, hs)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, mask, cache, rope)  # (B, T, C)
        if last_only:
            x = x[:, -1:, :]  # (B, 1, C)
        # Padding logits are cut off here, so they are never sampled and never in the loss.
        logits = self.lm_head(self.ln_f(x))[..., : self.config.real_vocab_size]  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def stream(self, idx, max_new_tokens, *args, **kwargs):  # the next token (B, 1) of every row, one at a time
        return generate.stream(self, idx, max_new_tokens, *args, **kwargs)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, **kwargs):  # (B, T + max_new_tokens)
        new = list(generate.stream(self, idx, max_new_tokens, temperature=temperature, top_k=top_k, **kwargs))
        return torch.cat([idx, *new], dim=1)
