"""pos = "rope": rotary position embeddings turn queries and keys by their position."""

import pytest
import torch

from model import GPT, GPTConfig, rope_tables, rotate


def test_attention_scores_depend_only_on_the_offset_between_query_and_key():
    cos, sin = rope_tables(block_size=64, head_size=8)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(t, s):
        at = lambda x, p: rotate(x, (cos[p : p + 1], sin[p : p + 1]))  # noqa: E731
        return (at(q, t) * at(k, s)).sum()

    torch.testing.assert_close(score(10, 3), score(50, 43))
    torch.testing.assert_close(score(7, 7), (q * k).sum())  # no offset: as if not rotated
    assert not torch.allclose(score(10, 3), score(10, 4))  # but the offset itself matters


def test_rotation_keeps_the_length_of_every_query_and_key():
    cos, sin = rope_tables(block_size=16, head_size=8)
    x = torch.randn(2, 3, 16, 8)
    torch.testing.assert_close(rotate(x, (cos, sin)).norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("mixer", ["head", "multihead"])
def test_left_padding_gives_each_row_the_logits_of_its_prompt_alone(mixer):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=13, block_size=16, n_layer=2, n_head=2, n_embd=16, pos="rope", mixer=mixer))
    model = model.double().eval()
    short, long = torch.randint(13, (1, 5)), torch.randint(13, (1, 8))
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1), long])  # (2, 8)
    valid = torch.tensor([[False] * 3 + [True] * 5, [True] * 8])  # per-row positions: (B, 1, T, hs/2) angles
    logits, _ = model(batch, valid=valid)
    torch.testing.assert_close(logits[:1, 3:], model(short)[0])
    torch.testing.assert_close(logits[1:], model(long)[0])


@pytest.mark.parametrize("overrides", [{"mixer": "average"}, {"mixer": "none"}, {"n_embd": 18, "n_head": 2}])
def test_rope_needs_attention_with_an_even_head_size(overrides):
    with pytest.raises(ValueError, match="rope"):
        GPTConfig(pos="rope", **{"n_embd": 16, "n_head": 2, **overrides})
