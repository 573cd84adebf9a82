"""pos = "rope": rotary position embeddings turn queries and keys by their position."""

import pytest
import torch

from model import GPT, GPTConfig, rope_rates, rope_tables, rotate
from tinygpt.decoding import KVCache, generate


def tables(n, head_size):
    """(cos, sin), each (n, hs): the angles of positions 0 to n - 1."""
    return rope_tables(torch.arange(n), rope_rates(head_size))


def test_attention_scores_depend_only_on_the_offset_between_query_and_key():
    cos, sin = tables(64, head_size=8)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(t, s):
        at = lambda x, p: rotate(x, (cos[p : p + 1], sin[p : p + 1]))  # noqa: E731
        return (at(q, t) * at(k, s)).sum()

    torch.testing.assert_close(score(10, 3), score(50, 43))
    torch.testing.assert_close(score(7, 7), (q * k).sum())  # no offset: as if not rotated
    assert not torch.allclose(score(10, 3), score(10, 4))  # but the offset itself matters


def test_each_pair_of_channels_turns_like_a_complex_number_times_e_to_the_i_angle():
    """Channels i and i + hs/2 as x1 + i x2, times e^(i pos freq_i): the rotation trained checkpoints hold."""
    x = torch.randn(2, 3, 5, 8)
    angles = torch.arange(5).float()[:, None] * rope_rates(8)[4:]  # (T, hs/2): each pair's rate
    turned = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(rotate(x, tables(5, 8)), torch.cat([turned.real, turned.imag], dim=-1))


def test_rotation_keeps_the_length_of_every_query_and_key():
    cos, sin = tables(16, head_size=8)
    x = torch.randn(2, 3, 16, 8)
    torch.testing.assert_close(rotate(x, (cos, sin)).norm(dim=-1), x.norm(dim=-1))


def test_rotation_keeps_the_dtype_of_what_it_turns_and_bf16_stays_within_bf16_rounding():
    x = torch.randn(2, 3, 16, 8)
    turned = rotate(x.bfloat16(), tables(16, head_size=8))  # fp32 tables would promote it to fp32
    assert turned.dtype == torch.bfloat16
    torch.testing.assert_close(turned.float(), rotate(x, tables(16, 8)), atol=4e-2, rtol=2e-2)


def test_left_padding_gives_each_row_the_logits_of_its_prompt_alone():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=13, block_size=16, n_layer=2, n_head=2, n_embd=16, pos="rope"))
    model = model.double().eval()
    short, long = torch.randint(13, (1, 5)), torch.randint(13, (1, 8))
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1), long])  # (2, 8)
    valid = torch.tensor([[False] * 3 + [True] * 5, [True] * 8])  # rope reads offsets, which padding keeps
    logits, _ = model(batch, valid=valid)
    torch.testing.assert_close(logits[:1, 3:], model(short)[0])
    torch.testing.assert_close(logits[1:], model(long)[0])


@pytest.mark.parametrize("overrides", [{"mixer": "average"}, {"mixer": "none"}, {"n_embd": 18, "n_head": 2}])
def test_rope_needs_attention_with_an_even_head_size(overrides):
    with pytest.raises(ValueError, match="rope"):
        GPTConfig(pos="rope", **{"n_embd": 16, "n_head": 2, **overrides})


def rope_gpt(n_layer=2):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=13, block_size=16, n_layer=n_layer, n_head=2, n_embd=16, pos="rope")
    return GPT(config).double().eval()


def test_past_block_size_the_cache_slides_and_matches_a_banded_full_forward():
    model = rope_gpt()
    idx = torch.randint(13, (2, 48))  # three blocks
    full, _ = model(idx)  # without a cache: each query sees the 16 newest keys up to itself
    cache = KVCache(model.config.n_layer, 16)
    first, _ = model(idx[:, :16], cache=cache)
    steps = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(16, 48)]
    assert len(cache) == 16 and cache.seen == 48  # it holds one block, having seen three
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full)


def test_past_block_size_each_query_sees_only_the_block_size_newest_keys():
    model = rope_gpt(n_layer=1)
    idx = torch.randint(13, (1, 40))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 13
    a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[0, 26:], b[0, 26:])  # position 10 is 16 or more back: out of the window
    assert not torch.allclose(a[0, 10:26], b[0, 10:26])


@pytest.mark.parametrize("pos, prompt_forwards", [("rope", 1), ("learned", 9)])
def test_generation_past_block_size_rebuilds_the_cache_only_without_rope(pos, prompt_forwards):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=13, block_size=16, n_layer=2, n_head=2, n_embd=16, pos=pos)).eval()
    lengths = []
    model.register_forward_pre_hook(lambda m, args: lengths.append(args[0].size(1)))
    generate(model, torch.randint(13, (1, 5)), 48, temperature=0)
    assert len(lengths) == 48 and sum(n > 1 for n in lengths) == prompt_forwards  # the rest: one token each
