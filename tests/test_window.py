"""window: each query sees only its `window` newest keys (a causal band), and a
windowed model's KV cache keeps only the window, so generation with rope runs past
block_size at a fixed memory."""

import pytest
import torch

from model import GPT, GPTConfig
from tinygpt import decoding
from tinygpt.decoding import KVCache, generate, stream

BLOCK = 16


def windowed_gpt(window, pos="rope", seed=0, **overrides):
    """A random tiny model in float64 with weights far from the init, so greedy tokens
    have clear winners and cached and uncached sums agree to the last bit that matters."""
    torch.manual_seed(seed)
    config = GPTConfig(**{"vocab_size": 13, "block_size": BLOCK, "n_layer": 2, "n_head": 2, "n_embd": 16,
                          "pos": pos, "window": window, **overrides})
    model = GPT(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def same_weights(model, **changes):
    """The model's weights under another config (another window, another attention path)."""
    twin = GPT(GPTConfig(**{**vars(model.config), **changes})).double().eval()
    twin.load_state_dict(model.state_dict())
    return twin


def tokens(*shape, seed=1):
    return torch.randint(0, 13, shape, generator=torch.Generator().manual_seed(seed))


# --- The band -------------------------------------------------------------------------------


@pytest.mark.parametrize("mixer, pos", [("average", "learned"), ("head", "learned"), ("multihead", "learned"),
                                        ("multihead", "rope")])
def test_a_window_at_least_as_long_as_the_sequence_is_full_attention(mixer, pos):
    full = windowed_gpt(0, pos=pos, mixer=mixer)
    idx = tokens(2, 10)
    for window in (10, 12, BLOCK):
        torch.testing.assert_close(same_weights(full, window=window)(idx)[0], full(idx)[0])
    assert not torch.allclose(same_weights(full, window=9)(idx)[0], full(idx)[0])  # shorter: it matters


@pytest.mark.parametrize("score", ["dot", "additive"])
def test_each_query_sees_only_its_window_newest_keys(score):
    model = windowed_gpt(4, pos="learned", n_layer=1, score=score)
    idx = tokens(1, BLOCK)
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 1) % 13
    a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[0, :5], b[0, :5])  # before it: causal
    assert not torch.allclose(a[0, 5:9], b[0, 5:9])  # positions 5 to 8 have it among their 4 newest keys
    assert torch.equal(a[0, 9:], b[0, 9:])  # from 9 on it is out of the window


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_a_window_runs_the_same_in_the_fused_kernel_and_written_out(pos):
    fused = windowed_gpt(5, pos=pos)
    written_out = same_weights(fused, fused_attention=False)
    idx = tokens(3, BLOCK)
    torch.testing.assert_close(written_out(idx)[0], fused(idx)[0])


@pytest.mark.parametrize("window", [-1, BLOCK + 1])
def test_a_window_must_be_0_to_block_size(window):
    with pytest.raises(ValueError, match="window must be 0"):
        GPTConfig(block_size=BLOCK, window=window)


# --- The KV cache keeps only the window -------------------------------------------------------


def test_cached_logits_with_a_window_match_the_full_forward_within_and_past_block_size():
    model = windowed_gpt(5)
    idx = tokens(2, 3 * BLOCK)
    full, _ = model(idx)  # rope past block_size, no cache: each query sees its 5 newest keys
    cache = KVCache(model.config.n_layer, 5)
    first, _ = model(idx[:, :3], cache=cache)
    steps = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(3, 3 * BLOCK)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full)
    assert cache.k[0].shape == (2, 2, 5, 8) and len(cache) == 5 and cache.seen == 3 * BLOCK


def test_inputs_longer_than_the_window_are_read_whole_and_only_the_window_kept():
    model = windowed_gpt(5)
    idx = tokens(2, 2 * BLOCK)
    full, _ = model(idx)
    cache = KVCache(model.config.n_layer, 5)
    chunks = [model(idx[:, :12], cache=cache)[0]]  # a prompt longer than the window
    chunks.append(model(idx[:, 12:15], cache=cache)[0])  # three at once, past a full cache
    chunks += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(15, 18)]  # the cache slides
    chunks.append(model(idx[:, 18:21], cache=cache)[0])  # three at once, after sliding
    chunks += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(21, 2 * BLOCK)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full)
    assert cache.k[0].size(2) == 5


@pytest.mark.parametrize("pos, window", [("rope", 5), ("rope", 1), ("learned", 5), ("sinusoidal", 7)])
def test_tokens_with_a_window_are_the_same_with_and_without_the_cache_far_past_block_size(pos, window):
    model = windowed_gpt(window, pos=pos)
    prompt = tokens(2, 9)  # longer than the window
    for new in (5, 6 * BLOCK):  # within block_size, and six blocks past it
        cached, uncached = (generate(model, prompt, new, temperature=1.0, use_cache=use_cache,
                                           generator=torch.Generator().manual_seed(3)) for use_cache in (True, False))
        assert torch.equal(cached, uncached)
        greedy = [generate(model, prompt, new, temperature=0, use_cache=use_cache) for use_cache in (True, False)]
        assert torch.equal(*greedy)
    assert len(set(cached[0, -4 * BLOCK:].tolist())) > 5  # sampled: varied, so the equality means something


def test_a_full_cache_drops_its_oldest_key_for_each_new_token_and_changes_no_other():
    model = windowed_gpt(5)
    cache = KVCache(model.config.n_layer, 5)
    model(tokens(2, 5), cache=cache)
    for step in range(7):
        before = [buf.clone() for buf in cache.k + cache.v]
        model(tokens(2, 1, seed=step), cache=cache)
        for buf, old in zip(cache.k + cache.v, before):
            assert buf.size(2) == 5 and torch.equal(buf[:, :, :4], old[:, :, 1:])
            assert not torch.equal(buf[:, :, 4], old[:, :, 4])  # the new token's, in the newest place


def test_a_windowed_cache_never_grows_past_the_window_however_long_generation_runs():
    model = windowed_gpt(5)
    caches = []

    def new_cache(n_layer, max_len):
        caches.append(KVCache(n_layer, max_len))
        return caches[-1]

    sizes = [caches[0].nbytes() for _ in stream(model, tokens(1, 3), 10 * BLOCK, temperature=0, new_cache=new_cache)]
    assert len(caches) == 1  # made once, never rebuilt: rope lets it slide
    one_position = 2 * model.config.n_layer * model.config.n_embd * 8  # keys and values of every layer, float64
    assert max(sizes) == 5 * one_position  # the window, not the 160 positions seen
    assert caches[0].seen == 3 + 10 * BLOCK - 1  # the last token is yielded, not yet fed back


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_a_left_padded_batch_with_a_window_generates_what_each_prompt_does_alone(pos):
    model = windowed_gpt(4, pos=pos)
    prompts = [[1, 2, 3, 4, 5, 6], [7], [8, 9, 10]]
    idx, valid = decoding.left_pad(prompts, "cpu")
    new = BLOCK - idx.size(1)  # within block_size; the window slides past the padding and the prompts
    for use_cache in (True, False):
        batched = generate(model, idx, new, temperature=0, valid=valid, use_cache=use_cache)[:, idx.size(1):]
        for row, prompt in enumerate(prompts):
            alone = generate(model, torch.tensor([prompt]), new, temperature=0, use_cache=use_cache)[:, len(prompt):]
            assert torch.equal(batched[row], alone[0]), f"prompt {row}, cache {use_cache}"
