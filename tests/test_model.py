"""model.py: every rung of the ladder is causal, trains, and agrees with itself
across the fused and written-out attention, padding, and the KV cache."""

import math

import pytest
import torch

import train
from model import (
    GPT,
    POSITIONS,
    CausalAverage,
    GPTConfig,
    Head,
    MultiHeadAttention,
    additive_scores,
    attention,
    fused_attention,
    padding_mask,
)
from tinygpt.decoding import generate

TINY = dict(vocab_size=13, block_size=16, n_layer=2, n_head=4, n_embd=32)

# The switches of each rung, as in config/ladder/ (the defaults are the full GPT).
RUNGS = {
    "bigram": dict(n_layer=0, mixer="none", feedforward=False, residual=False, layernorm=False, pos="none",
                   tie_weights=False),
    "average": dict(mixer="average", feedforward=False, residual=False, layernorm=False),
    "head": dict(mixer="head", feedforward=False, residual=False, layernorm=False),
    "multihead": dict(mixer="multihead", feedforward=False, residual=False, layernorm=False),
    "feedforward": dict(residual=False, layernorm=False),
    "residual": dict(layernorm=False),
    "layernorm": dict(tie_weights=False),
    "full": dict(dropout=0.1),
    # The ladder's other rows: additive scores on the rungs that score, and a window of 5 of the 16 positions.
    "head_additive": dict(mixer="head", score="additive", feedforward=False, residual=False, layernorm=False),
    "multihead_additive": dict(score="additive", feedforward=False, residual=False, layernorm=False),
    "window": dict(pos="rope", window=5),
}
# The rungs whose attention runs in the fused kernel by default (additive scores never do).
ATTENTION_RUNGS = [r for r in RUNGS if RUNGS[r].get("mixer", "multihead") == "multihead" and "score" not in RUNGS[r]]


def config(rung, **overrides):
    return GPTConfig(**{**TINY, **RUNGS[rung], **overrides})


def valid_config(rung, **overrides):
    try:
        config(rung, **overrides)
        return True
    except ValueError:  # e.g. rope, which needs attention to turn queries and keys
        return False


def make(rung, seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(config(rung, **overrides)).eval()


# Every rung with every position encoding it accepts; multihead rungs also written out.
VARIANTS = [(rung, dict(pos=pos)) for rung in RUNGS for pos in POSITIONS if valid_config(rung, pos=pos)]
VARIANTS += [(rung, dict(pos=pos, fused_attention=False)) for rung in ATTENTION_RUNGS for pos in POSITIONS
             if valid_config(rung, pos=pos)]
VARIANT_IDS = [f"{rung}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for rung, o in VARIANTS]



def tokens(*shape, seed=1):
    return torch.randint(0, TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


# --- Causality -----------------------------------------------------------------------


@pytest.mark.parametrize("rung, overrides", VARIANTS, ids=VARIANT_IDS)
def test_output_at_t_ignores_tokens_after_t(rung, overrides):
    model = make(rung, **overrides)
    idx = tokens(2, 16)
    with torch.no_grad():
        logits, _ = model(idx)
        for t in (0, 6, 14):
            changed = idx.clone()
            changed[:, t + 1:] = (idx[:, t + 1:] + 1 + tokens(2, 15 - t, seed=t)) % TINY["vocab_size"]
            new_logits, _ = model(changed)
            torch.testing.assert_close(new_logits[:, : t + 1], logits[:, : t + 1], atol=1e-6, rtol=0)
            assert not torch.allclose(new_logits[:, t + 1:], logits[:, t + 1:])  # the change did reach the model


# --- Rung 2: CausalAverage -----------------------------------------------------------


def test_causal_average_is_the_mean_of_the_prefix():
    x = torch.randn(3, 7, 5)
    out = CausalAverage()(x)
    for b in range(3):
        for t in range(7):
            torch.testing.assert_close(out[b, t], x[b, : t + 1].mean(dim=0))


def test_causal_average_skips_left_padding():
    x = torch.randn(2, 7, 5)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :3] = False
    out = CausalAverage()(x, padding_mask(valid, 7))
    for t in range(7):
        torch.testing.assert_close(out[0, t], x[0, : t + 1].mean(dim=0))
    for t in range(3, 7):
        torch.testing.assert_close(out[1, t], x[1, 3 : t + 1].mean(dim=0))


# --- Rungs 3 and 4: one head, then many -----------------------------------------------------


def test_a_head_weights_each_earlier_value_by_its_softmaxed_scaled_dot_product():
    torch.manual_seed(0)
    head, x = Head(GPTConfig(n_embd=8, n_head=2), head_size=4), torch.randn(2, 5, 8)
    q, k, v = head.query(x), head.key(x), head.value(x)  # (B, T, hs)
    out = head(x)
    for t in range(5):  # query t against keys 0..t only
        weights = torch.softmax(q[:, t : t + 1] @ k[:, : t + 1].transpose(1, 2) / 2.0, dim=-1)  # sqrt(4) = 2
        torch.testing.assert_close(out[:, t : t + 1], weights @ v[:, : t + 1])


@pytest.mark.parametrize("fused", [True, False])
def test_multihead_attention_is_its_heads_one_by_one_concatenated_then_projected(fused):
    """The lecture's step: n_head Heads side by side. The fused c_attn holds each head's query, key and
    value matrices as row blocks; a Head given those rows gives that head's output."""
    torch.manual_seed(0)
    config = GPTConfig(n_embd=12, n_head=3, fused_attention=fused)
    mha, x = MultiHeadAttention(config), torch.randn(2, 6, 12)
    W_q, W_k, W_v = mha.c_attn.weight.split(12)  # (C, C) each: rows h*hs to (h+1)*hs are head h's
    b_q, b_k, b_v = mha.c_attn.bias.split(12)
    outputs = []
    for h in range(3):
        rows = slice(4 * h, 4 * (h + 1))
        q, k, v = x @ W_q[rows].T + b_q[rows], x @ W_k[rows].T + b_k[rows], x @ W_v[rows].T + b_v[rows]  # (B, T, 4)
        outputs.append(attention(q, k, v)[0])  # (B, T, 4): head h, alone
    expected = mha.c_proj(torch.cat(outputs, dim=-1))  # (B, T, C)
    torch.testing.assert_close(mha(x), expected, atol=1e-6, rtol=1e-5)


# --- Fused attention, written-out attention, padding ------------------------------------


def left_padded_batch():
    """Row 0: 12 real tokens. Row 1: 4 pads, then the 8 tokens of `prompt`."""
    idx = tokens(2, 12, seed=3)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :4] = False
    idx[1, :4] = 0
    return idx, valid, idx[1:, 4:]


@pytest.mark.parametrize("pos", [p for p in POSITIONS if valid_config("full", pos=p)])
@pytest.mark.parametrize("rung", ATTENTION_RUNGS)
def test_written_out_attention_equals_the_fused_kernel(rung, pos):
    fused = make(rung, pos=pos)
    explicit = make(rung, pos=pos, fused_attention=False)
    explicit.load_state_dict(fused.state_dict())
    idx = tokens(3, 16)
    padded, valid, _ = left_padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(explicit(idx)[0], fused(idx)[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(explicit(padded, valid=valid)[0], fused(padded, valid=valid)[0], atol=1e-5, rtol=0)


def test_training_with_dropout_leaves_each_querys_attention_weights_summing_to_one():
    """Dropout sits on the embeddings and on what each sub-layer adds to the stream, never on the
    attention weights: on a CPU, dropping them sent the fused kernel back to the written-out math."""
    model = make("full", dropout=0.5, fused_attention=False).train()
    attn = model.blocks[0].mixer
    attn.keep_weights = True
    torch.manual_seed(1)
    _, loss = model(tokens(3, 16), tokens(3, 16))
    torch.testing.assert_close(attn.weights.sum(-1), torch.ones(3, attn.n_head, 16), atol=1e-5, rtol=0)
    torch.manual_seed(2)
    assert not torch.allclose(model(tokens(3, 16), tokens(3, 16))[1], loss)  # other masks: dropout is on


@pytest.mark.parametrize("rung, overrides", VARIANTS, ids=VARIANT_IDS)
def test_left_padded_row_gives_the_logits_of_its_prompt_alone(rung, overrides):
    model = make(rung, **overrides)
    idx, valid, prompt = left_padded_batch()
    with torch.no_grad():
        batched, _ = model(idx, valid=valid)
        alone, _ = model(prompt)
        full_row, _ = model(idx[:1])
    torch.testing.assert_close(batched[1, 4:], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batched[0], full_row[0], atol=1e-5, rtol=0)  # a row without padding is untouched


# --- Additive scores -------------------------------------------------------------------------


def test_additive_score_of_query_t_and_key_s_is_w_dot_tanh_of_their_sum():
    q, k = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 6, 5)  # (B, H, T, hs), (B, H, S, hs)
    w = torch.randn(3 * 5)  # each head's w, flat
    scores = additive_scores(q, k, w)
    assert scores.shape == (2, 3, 4, 6)
    for b, h, t, s in [(0, 0, 0, 0), (1, 2, 3, 5), (0, 1, 2, 4)]:
        expected = w.view(3, 5)[h] @ torch.tanh(q[b, h, t] + k[b, h, s])
        torch.testing.assert_close(scores[b, h, t, s], expected)


@pytest.mark.parametrize("rung", ["head_additive", "multihead_additive"])
def test_additive_heads_keep_one_vector_per_head_that_muon_and_weight_decay_leave_alone(rung):
    model = make(rung, n_layer=2)
    vectors = [p for name, p in model.named_parameters() if name.endswith("score_vector")]
    assert [p.shape for p in vectors] == [(TINY["n_embd"],)] * 2  # H heads of hs, flat, in each layer
    cfg = train.TrainConfig(optimizer="muon", muon_weight_decay=0.0)
    adamw, muon = train.make_optimizer(model, cfg, "cpu").optimizers
    assert not any(p is v for g in muon.param_groups for p in g["params"] for v in vectors)
    assert all(any(p is v for g in adamw.param_groups if g["weight_decay"] == 0 for p in g["params"]) for v in vectors)
    dot = make(rung.removesuffix("_additive"), n_layer=2)
    assert model.num_params() == dot.num_params() + 2 * TINY["n_embd"]  # W_q and W_k are the query and key


@pytest.mark.parametrize("overrides", [{"mixer": "average"}, {"mixer": "none"}, {"pos": "rope"}, {"score": "sum"}])
def test_additive_scores_need_a_mixer_that_scores_and_no_rope(overrides):
    with pytest.raises(ValueError, match="score"):
        GPTConfig(**{"score": "additive", **overrides})


@pytest.mark.parametrize("mixer", ["average", "head"])
def test_rotary_positions_come_in_at_the_multihead_rung(mixer):
    with pytest.raises(ValueError, match="needs mixer multihead"):
        GPTConfig(mixer=mixer, pos="rope", n_head=2, n_embd=8)


# --- Training ------------------------------------------------------------------------------


@pytest.mark.parametrize("rung", RUNGS)
def test_every_rung_trains_and_overfits_one_batch(rung):
    torch.manual_seed(0)
    model = GPT(config(rung)).train()
    starts = tokens(4, 1, seed=5)
    if rung == "average":
        # A mean knows which tokens came before but not their order: each row repeats one token.
        data = starts.expand(4, 17)
    else:
        # Counting up from a random start: the bigram can learn it, and so can every rung above.
        data = (starts + torch.arange(17)) % TINY["vocab_size"]  # (4, 17)
    x, y = data[:, :-1], data[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(150):
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if not losses:
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    assert losses[-1] < 0.1 * math.log(TINY["vocab_size"])  # far better than uniform guessing


def test_stack_without_residuals_keeps_its_activations_at_scale():
    # A deep stack with no residual path must not shrink its signal to nothing:
    # at 1e-30 and below floats turn denormal, CPUs crawl, and the loss sits at ln(V).
    model = make("feedforward", n_layer=4, n_embd=128, block_size=64)
    x = model.wte(tokens(2, 64)) + model.wpe(torch.arange(64))
    start = x.std().item()
    with torch.no_grad():
        for block in model.blocks:
            x = block(x)
    assert x.std().item() > 1e-3 * start


# --- Parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_num_params_matches_the_formula(bias):
    V, T, L, C = 13, 16, 3, 24
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=4, n_embd=C, bias=bias))
    b = 1 if bias else 0
    layernorm = C + b * C  # gain, and an offset with bias
    attention = C * 3 * C + b * 3 * C + C * C + b * C  # fused q/k/v, then the output projection
    feedforward = C * 4 * C + b * 4 * C + 4 * C * C + b * C
    block = 2 * layernorm + attention + feedforward
    # Token and position embeddings, the blocks, the final LayerNorm; the head is the token embedding.
    expected = V * C + T * C + L * block + layernorm
    assert model.num_params() == expected
    untied = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=4, n_embd=C, bias=bias, tie_weights=False))
    assert untied.num_params() == expected + V * C


def test_output_head_shares_the_token_embedding_storage():
    model = make("full")
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    untied = make("layernorm")
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()


# --- Errors ---------------------------------------------------------------------------------


def test_sequence_longer_than_block_size_is_an_error():
    model = make("full")
    model(tokens(1, 16))  # exactly block_size is fine
    with pytest.raises(ValueError, match="block_size"):
        model(tokens(1, 17))


def test_n_embd_not_divisible_by_n_head_is_an_error():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)


# --- Generation with the KV cache ---------------------------------------------------------


def randomized(model):
    """Weights far from the init, so greedy decoding has clear winners and varied output."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("rung, overrides", VARIANTS, ids=VARIANT_IDS)
def test_cached_generation_equals_uncached_within_and_beyond_block_size(rung, overrides):
    model = randomized(make(rung, **overrides))
    prompt = tokens(2, 5)
    for new in (8, 40):  # 5 + 8 fits the block of 16; 5 + 40 slides past it
        cached = generate(model, prompt, new, temperature=0, use_cache=True)
        uncached = generate(model, prompt, new, temperature=0, use_cache=False)
        assert cached.shape == (2, 5 + new)
        assert torch.equal(cached, uncached)


@pytest.mark.parametrize("rung", ["head", "full"])
def test_cached_generation_of_a_left_padded_batch_equals_each_prompt_alone(rung):
    model = randomized(make(rung))
    idx, valid, prompt = left_padded_batch()
    # 12 + 4 stays within block_size, where the two windows hold the same tokens.
    batched = generate(model, idx, 4, temperature=0, valid=valid, use_cache=True)
    alone = generate(model, prompt, 4, temperature=0, use_cache=True)
    assert torch.equal(batched[1, 12:], alone[0, 8:])
    assert torch.equal(batched, generate(model, idx, 4, temperature=0, valid=valid, use_cache=False))


@pytest.mark.parametrize("qk_dtype", [torch.bfloat16, torch.float32])
def test_fused_attention_runs_in_fp32_on_a_cpu_under_bf16_autocast(qk_dtype):
    """bf16 attention's backward is several times slower than fp32's on CPUs: the kernel takes fp32 there."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 16, requires_grad=True) for _ in range(3))
    expected = fused_attention(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_attention(q.to(qk_dtype), k.to(qk_dtype), v.bfloat16())
    assert out.dtype == torch.float32  # computed in fp32 from the bf16 inputs
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)  # only the inputs' rounding differs
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


