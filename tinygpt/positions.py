"""Position encodings other than a learned table, for model.GPT's `pos` switch.

    sinusoidal  a fixed table of sines and cosines added to the token embeddings
    rope        rotary embeddings: queries and keys turned by an angle per position

They live beside model.py, which imports them, so the lesson there stays one idea
per class; what they do to attention is told where they are used.
"""

import math

import torch


def sinusoidal_positions(block_size, n_embd):
    """(block_size, n_embd) fixed encodings from "Attention Is All You Need"."""
    pos = torch.arange(block_size).float()[:, None]  # (T, 1)
    freq = torch.exp(torch.arange(0, n_embd, 2).float() * (-math.log(10000.0) / n_embd))  # (C/2,)
    table = torch.zeros(block_size, n_embd)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : n_embd // 2]
    return table


def rope_frequencies(head_size, base=10000.0):
    """(hs/2,): the turning rates of rotary position embedding (RoPE).

    RoPE turns each pair of query and key channels by an angle that grows with
    the position, pair i at its own rate base^(-2i/hs). A query at t and a key
    at s then score by their offset t - s alone: positions become relative.
    """
    return base ** (-torch.arange(0, head_size, 2).float() / head_size)


def rope_rates(head_size):
    """(hs,): each channel's turning rate, pair i's (channels i and i + hs/2) for both, the
    first one negated: cos(-a) = cos(a), and sin(-a) = -sin(a) puts the rotation's minus
    sign into the tables, so rotate() needs no sign or split of its own."""
    freq = rope_frequencies(head_size)
    return torch.cat([-freq, freq])


def rope_tables(pos, rates):
    """(cos, sin), each (T, hs): what rotate() turns positions pos (T,) by, given rope_rates."""
    angles = pos[:, None] * rates  # (T, hs)
    return angles.cos(), angles.sin()


def rotate(x, rope):
    """x (..., T, hs) with each pair (x1, x2) = (channel i, channel i + hs/2) turned by its
    angle: (x1 cos - x2 sin, x1 sin + x2 cos). roll swaps the halves to (x2, x1), and the
    table's first half of sin is negated. It turns x in x's own dtype: under bf16 autocast fp32
    tables would promote every op to fp32 and mixed dtypes, and the CPU preset's step took ~3 ms
    (5%) longer for it."""
    cos, sin = (table.to(x.dtype) for table in rope)  # each (T, hs), from rope_tables
    return torch.addcmul(x * cos, x.roll(x.size(-1) // 2, dims=-1), sin)  # x cos + roll(x) sin, (..., T, hs)
