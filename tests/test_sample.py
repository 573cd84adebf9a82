"""Generation: the KV cache, padding, the sampling filters, and sample.py's command line."""

from pathlib import Path

import pytest
import torch

import model as lesson
import prepare
import sample
import train
from config import UserError
from model import GPT, GPTConfig
from tinygpt import decoding, prompts
from tinygpt.decoding import KVCache, generate, sample_next, stream
from tinygpt.prompts import TextStream, unescape
from tinygpt.tokenizer import tokenizer_from_meta

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
BLOCK = 16



def tiny_gpt(seed=0, **overrides):
    """A random tiny model in float64, where cached and uncached sums agree so
    closely that no argmax can flip between them."""
    torch.manual_seed(seed)
    config = GPTConfig(**{"vocab_size": 13, "block_size": BLOCK, "n_layer": 2, "n_head": 2, "n_embd": 16,
                          "dropout": 0.0, **overrides})
    return GPT(config).double().eval()


# --- The KV cache ------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"pos": "sinusoidal"}, {"pos": "rope"}, {"pos": "none"},
                                       {"bias": False, "gelu": "tanh"}, {"window": 6}, {"pos": "rope", "window": 6},
                                       {"vocab_size": 16, "real_vocab_size": 13}])
def test_cached_logits_match_a_full_forward_pass_one_position_at_a_time(overrides):
    model = tiny_gpt(**overrides)
    idx = torch.randint(13, (2, BLOCK))
    full, _ = model(idx)
    cache = KVCache(model.config.n_layer, model.config.window or BLOCK)
    first, _ = model(idx[:, :5], cache=cache)
    steps = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(5, BLOCK)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full)


@pytest.mark.parametrize("mixer,pos", [("multihead", "learned"), ("multihead", "sinusoidal"), ("multihead", "none"),
                                       ("multihead", "rope"), ("head", "learned"), ("average", "learned")])
def test_greedy_tokens_are_identical_with_and_without_the_cache_within_and_beyond_block_size(mixer, pos):
    model = tiny_gpt(mixer=mixer, pos=pos)
    idx = torch.randint(13, (2, 5))
    cached = generate(model, idx, 4 * BLOCK, temperature=0.0, use_cache=True)
    recomputed = generate(model, idx, 4 * BLOCK, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 5 + 4 * BLOCK)
    assert torch.equal(cached, recomputed)


def test_sampled_tokens_are_identical_with_and_without_the_cache_for_a_fixed_seed():
    model = tiny_gpt()
    idx = torch.randint(13, (3, 4))
    runs = [generate(model, idx, 3 * BLOCK, temperature=1.0, top_k=8, top_p=0.9, use_cache=use_cache,
                           generator=torch.Generator().manual_seed(7)) for use_cache in (True, False)]
    assert torch.equal(runs[0], runs[1])
    other_seed = generate(model, idx, 3 * BLOCK, temperature=1.0, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(runs[0], other_seed)  # the seed matters, so the equality above means something


CHANGES = {  # what a reader might try in model.py; LayerNorm would take out a shift of every channel alike
    "Block": lambda out: out + torch.linspace(-2.0, 2.0, out.size(-1), dtype=out.dtype),
    "MultiHeadAttention": lambda out: 3 * out,
}


@pytest.mark.parametrize("pos", ["learned", "rope"])
@pytest.mark.parametrize("changed", CHANGES)
def test_a_forward_changed_in_model_py_gives_the_same_greedy_tokens_with_the_cache_as_without(monkeypatch,
                                                                                              changed, pos):
    model = tiny_gpt(pos=pos)
    with torch.no_grad():  # weights far from the init, where the change shows in the tokens
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    idx = torch.randint(13, (8, 5))
    before = generate(model, idx, 3 * BLOCK, temperature=0.0)  # past block_size: rope slides, learned jumps
    forward = getattr(lesson, changed).forward
    monkeypatch.setattr(getattr(lesson, changed), "forward",
                        lambda self, *args: CHANGES[changed](forward(self, *args)))
    cached = generate(model, idx, 3 * BLOCK, temperature=0.0, use_cache=True)
    assert torch.equal(cached, generate(model, idx, 3 * BLOCK, temperature=0.0, use_cache=False))
    assert not torch.equal(cached, before)  # the change shows, so the equality means something


@pytest.mark.parametrize("bf16", [False, True])
def test_decoding_runs_without_onednn_except_bf16_on_many_positions_and_leaves_the_setting_as_it_was(monkeypatch,
                                                                                                   bf16):
    model = tiny_gpt().float()
    seen = []  # (positions fed, oneDNN on) per step of model.forward
    advance = KVCache.advance
    monkeypatch.setattr(KVCache, "advance", lambda cache, valid, T: seen.append((T, torch.backends.mkldnn.enabled))
                        or advance(cache, valid, T))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        between = [torch.backends.mkldnn.enabled for _ in stream(model, torch.randint(13, (1, 5)), 6)]
    assert seen == [(5, bf16)] + [(1, False)] * 5  # bf16 on a prompt: oneDNN's matmuls are the faster
    assert between == [True] * 6 and torch.backends.mkldnn.enabled  # the caller's setting, between steps and after


def test_a_prompt_longer_than_block_size_is_cut_to_its_last_block_size_tokens():
    model = tiny_gpt()
    idx = torch.randint(13, (1, 3 * BLOCK))
    out = generate(model, idx, 5, temperature=0.0)
    assert torch.equal(out[:, -5:], generate(model, idx[:, -BLOCK:], 5, temperature=0.0)[:, -5:])


@pytest.mark.parametrize("use_cache", [True, False])
def test_batched_greedy_output_equals_each_prompt_generated_alone(use_cache):
    model = tiny_gpt()
    prompts = [[1, 2, 3, 4, 5, 6], [7], [8, 9, 10]]
    idx, valid = decoding.left_pad(prompts, "cpu")
    assert valid is not None and valid.sum(dim=1).tolist() == [6, 1, 3]
    new = BLOCK - idx.size(1)  # within the window: padding then fills no place a lone prompt would use
    batched = generate(model, idx, new, temperature=0.0, valid=valid, use_cache=use_cache)[:, idx.size(1):]
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), new, temperature=0.0, use_cache=use_cache)[:, len(prompt):]
        assert torch.equal(batched[row], alone[0]), f"prompt {row}"


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rope"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_past_block_size_each_row_of_a_batch_goes_on_as_it_would_alone(pos, use_cache):
    model = tiny_gpt(pos=pos)
    if pos == "learned":  # positions that sway the next token, as trained ones do
        torch.nn.init.normal_(model.wpe.weight, std=1.0)
    prompts = [list(range(1, 11)), [7], [8, 9, 10]]
    idx, valid = decoding.left_pad(prompts, "cpu")
    new = 3 * BLOCK  # each row's window jumps (or slides) several times, each when its own tokens say
    batched = generate(model, idx, new, temperature=0.0, valid=valid, use_cache=use_cache)[:, idx.size(1):]
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), new, temperature=0.0, use_cache=use_cache)[:, len(prompt):]
        assert torch.equal(batched[row], alone[0]), f"prompt {row}"


def test_prompts_of_equal_length_need_no_padding_mask():
    idx, valid = decoding.left_pad([[1, 2], [3, 4]], "cpu")
    assert valid is None and idx.tolist() == [[1, 2], [3, 4]]


# --- Temperature, top-k, top-p -----------------------------------------------------------------


def draws(logits, n=4000, seed=0, **kwargs):
    """n samples of one distribution, as a set of the tokens drawn and their counts."""
    batch = logits.expand(n, -1)
    tokens = sample_next(batch, generator=torch.Generator().manual_seed(seed), **kwargs)[:, 0]
    return torch.bincount(tokens, minlength=logits.size(-1))


LOGITS = torch.tensor([[0.5, 3.0, 1.0, 2.5, -1.0, 0.0]])  # token 1 likeliest, then 3, 2, 0, 5, 4


def test_temperature_zero_top_k_one_and_a_tiny_top_p_are_all_greedy():
    model = tiny_gpt()
    idx = torch.randint(13, (2, 3))
    greedy = generate(model, idx, 2 * BLOCK, temperature=0.0)
    for filters in ({"top_k": 1}, {"top_p": 1e-6}):
        g = torch.Generator().manual_seed(0)
        assert torch.equal(generate(model, idx, 2 * BLOCK, temperature=1.0, generator=g, **filters), greedy)


@pytest.mark.parametrize("filters", [{"temperature": 1e-45}, {"temperature": 1.0, "top_p": 1e-300},
                                     {"temperature": 1e-45, "top_k": 3, "top_p": 1e-300}])
def test_a_temperature_or_top_p_so_small_that_probabilities_underflow_samples_the_likeliest_token(filters):
    assert torch.equal(sample_next(LOGITS, **filters, generator=torch.Generator().manual_seed(0)),
                       LOGITS.argmax(dim=-1, keepdim=True))


def test_top_k_never_samples_outside_the_k_likeliest_tokens():
    counts = draws(LOGITS, temperature=1.0, top_k=3)
    assert set(counts.nonzero().flatten().tolist()) == {1, 3, 2}


def test_top_p_keeps_the_smallest_set_whose_probabilities_reach_p():
    probs = torch.softmax(LOGITS, dim=-1)[0]  # about .46 .28 .10 .06 ...
    p = (probs[1] + probs[3]).item()  # tokens 1 and 3 reach p exactly: the third is not needed
    assert set(draws(LOGITS, temperature=1.0, top_p=p).nonzero().flatten().tolist()) == {1, 3}
    assert set(draws(LOGITS, temperature=1.0, top_p=p + 0.01).nonzero().flatten().tolist()) == {1, 3, 2}


def test_top_k_larger_than_the_vocabulary_keeps_every_token():
    assert (draws(LOGITS, n=20000, temperature=3.0, top_k=1000) > 0).all()


def test_each_token_is_drawn_as_often_as_its_probability_says():
    counts = draws(LOGITS, n=40000, temperature=1.0)
    assert torch.allclose(counts / counts.sum(), torch.softmax(LOGITS[0], dim=-1), atol=0.01)


@pytest.mark.parametrize("temperature", [0.8, 0.0])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nan_or_inf_score_in_any_row_is_a_user_error(temperature, value):
    batch = LOGITS.repeat(3, 1)
    batch[1, 4] = value  # one score of one row, and not its largest
    with pytest.raises(UserError, match="NaN or infinite"):
        sample_next(batch, temperature=temperature)


def test_lower_temperature_makes_the_likeliest_token_likelier():
    share = [draws(LOGITS, temperature=t)[1].item() for t in (0.3, 1.0, 3.0)]
    assert share[0] > share[1] > share[2]
    assert share[1] / 4000 == pytest.approx(torch.softmax(LOGITS, -1)[0, 1].item(), abs=0.03)


# --- Decoding a stream of tokens -------------------------------------------------------------------


class ByteTokenizer:
    """One token per byte, as a byte-level BPE can split a character."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_a_token_that_ends_inside_a_character_until_it_is_complete():
    stream = TextStream(ByteTokenizer())
    pieces = [stream.push([b]) for b in "né!".encode()]
    assert pieces == ["n", "", "é", "!"]
    assert stream.flush() == ""


def test_an_empty_prompt_starts_from_a_newline_or_else_token_zero():
    with_newline = tokenizer_from_meta({"tokenizer": "char", "vocab": ["\n", "a", "b"]})
    without = tokenizer_from_meta({"tokenizer": "char", "vocab": ["a", "b"]})
    assert prompts.encode_prompts([("", "--start", 1)], with_newline, "error") == [[0]]
    assert prompts.encode_prompts([("", "--start", 1), ("ba", "--start", 1)], without, "error") == [[0], [1, 0]]


# --- sample.py end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    """A checkpoint of config/tiny.toml, trained briefly on some Shakespeare."""
    root = tmp_path_factory.mktemp("sample")
    if SHAKESPEARE.is_file():
        text = SHAKESPEARE.read_text(encoding="utf-8")[:20000]
    else:
        lines = ["ROMEO: What light through yonder window breaks?", "First Citizen: To be, or not to be!",
                 "JULIET: O Romeo, Romeo!"]
        text = "\n".join(lines[i % 3] for i in range(400))
    (root / "input.txt").write_text(text, encoding="utf-8")
    assert prepare.main(["--input", str(root / "input.txt"), "--out_dir", str(root / "data")]) == 0
    assert train.main([TINY, f"--data_dir={root / 'data'}", f"--out_dir={root / 'out'}", "--max_iters=30",
                       "--eval_interval=30"]) == 0
    return root / "out"


def run_sample(capsys, out_dir, *args):
    capsys.readouterr()
    code = sample.main([f"--out_dir={out_dir}", "--max_new_tokens=24", *args])
    out, err = capsys.readouterr()
    return code, out, err


def samples(out):
    """The samples in sample.py's output, each without the newline added before a separator."""
    chunks = out.split(sample.SEPARATOR + "\n")
    assert chunks[-1] == ""
    return chunks[:-1]


def test_sample_prints_each_sample_as_the_prompt_and_max_new_tokens_characters(capsys, out_dir):
    code, out, err = run_sample(capsys, out_dir, "--start=ROMEO:", "--num_samples=3", "--seed=1")
    assert code == 0 and err == ""
    texts = samples(out)
    assert len(texts) == 3
    for text in texts:
        assert text.startswith("ROMEO:")
        assert len(text) - len("ROMEO:") in (24, 25)  # one character a token, maybe a newline added
    assert len(set(texts)) > 1  # samples follow one another, not one seed each


def test_sample_streams_the_text_one_token_at_a_time(capsys, out_dir, monkeypatch):
    pieces = []
    monkeypatch.setattr(sample, "write", pieces.append)
    assert sample.main([f"--out_dir={out_dir}", "--start=To be", "--max_new_tokens=10"]) == 0
    assert pieces[0] == "To be" and len(pieces) == 1 + 10 + 1  # prompt, each token, separator
    assert all(len(p) == 1 for p in pieces[1:-1])


def test_sample_output_is_the_same_with_and_without_the_cache(capsys, out_dir):
    args = ["--start=ROMEO:", "--max_new_tokens=40", "--temperature=1.0", "--seed=5"]  # past block_size 16
    runs = [run_sample(capsys, out_dir, *args, f"--kv_cache={c}")[1] for c in ("true", "false")]
    assert runs[0] == runs[1]
    assert run_sample(capsys, out_dir, *args[:-1], "--seed=6")[1] != runs[0]


def test_sample_batches_prompts_and_each_greedy_output_equals_the_prompt_alone(capsys, out_dir, tmp_path):
    (tmp_path / "prompts.txt").write_text("ROMEO:\n   \nTo be, or\n")
    greedy = ["--temperature=0", "--max_new_tokens=6"]  # the longer prompt stays within block_size 16
    code, out, err = run_sample(capsys, out_dir, f"--prompts={tmp_path / 'prompts.txt'}", *greedy)
    assert code == 0
    batched = samples(out)
    assert len(batched) == 2  # the blank line is skipped
    for prompt, text in zip(["ROMEO:", "To be, or"], batched):
        assert text.startswith(prompt)
        assert samples(run_sample(capsys, out_dir, f"--start={prompt}", *greedy)[1]) == [text]


def test_an_empty_prompt_starts_from_a_newline(capsys, out_dir):
    code, out, _ = run_sample(capsys, out_dir, "--start=", "--max_new_tokens=5")
    assert code == 0 and out.startswith("\n")


def test_start_can_read_the_prompt_from_a_file(capsys, out_dir, tmp_path):
    (tmp_path / "prompt.txt").write_text("ROMEO:\nWhat")
    code, out, _ = run_sample(capsys, out_dir, f"--start=FILE:{tmp_path / 'prompt.txt'}", "--max_new_tokens=3")
    assert code == 0 and out.startswith("ROMEO:\nWhat")


def test_unknown_characters_are_all_named_with_where_they_are(capsys, out_dir, tmp_path):
    (tmp_path / "p.txt").write_text("ROMEO\nsay ÿ and ☃\n")
    code, out, err = run_sample(capsys, out_dir, f"--prompts={tmp_path / 'p.txt'}")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert f"'ÿ' ({tmp_path / 'p.txt'} line 2 column 5)" in err and "'☃'" in err and "--unknown=skip" in err


def test_unknown_skip_drops_the_characters_with_a_warning(capsys, out_dir):
    code, out, err = run_sample(capsys, out_dir, "--start=RO☃MEO", "--unknown=skip", "--max_new_tokens=3")
    assert code == 0 and out.startswith("ROMEO")
    assert err.startswith("warning: ") and "'☃' (--start column 3)" in err


@pytest.mark.parametrize("args,says", [
    (["--num_samples=0"], "num_samples"),
    (["--max_new_tokens=-1"], "max_new_tokens"),
    (["--top_k=0"], "top_k"),
    (["--top_p=0"], "top_p"),
    (["--top_p=1.5"], "top_p"),
    (["--temperature=-0.5"], "temperature"),
    (["--checkpoint=missing.pt"], "missing.pt"),
    (["--checkpoint=corrupt.pt"], "corrupt.pt"),
    (["--start=FILE:no/such/file.txt"], "not found"),
    (["--start=héllo"], "never saw"),
    (["--unknown=ignore"], "unknown"),
])
def test_bad_input_is_one_error_line_and_exit_code_2(capsys, out_dir, args, says):
    (out_dir / "corrupt.pt").write_bytes(b"not a checkpoint at all")
    code, out, err = run_sample(capsys, out_dir, *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err


@pytest.mark.parametrize("args", [["--temperature=1e-45"], ["--top_p=1e-300"], ["--temperature=1e-300", "--top_k=2"]])
def test_every_temperature_and_top_p_the_options_accept_gives_text(capsys, out_dir, args):
    code, out, err = run_sample(capsys, out_dir, "--start=ROMEO:", *args)
    assert code == 0 and err == "" and len(samples(out)) == 1 and samples(out)[0].startswith("ROMEO:")


def test_a_checkpoint_name_that_is_not_there_names_those_that_are(capsys, out_dir):
    code, out, err = run_sample(capsys, out_dir, "--checkpoint=nope.pt")
    assert code == 2 and out == ""
    assert err.startswith(f"error: checkpoint {out_dir / 'nope.pt'} not found; {out_dir} holds best.pt, ckpt.pt")
    assert err.endswith(": name one of those\n") and err.count("\n") == 1


def test_a_checkpoint_whose_config_does_not_match_its_weights_says_so_before_building_it(capsys, out_dir, tmp_path):
    ckpt = torch.load(out_dir / "ckpt.pt", weights_only=True)
    ckpt["model_config"]["n_embd"] = 100_000  # a model of 480 billion parameters, were it built
    torch.save(ckpt, tmp_path / "ckpt.pt")
    code, out, err = run_sample(capsys, tmp_path, "--checkpoint=ckpt.pt")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "its model_config (vocab_size, n_embd, n_layer, block_size, tokens (" in err and "100000" in err
    assert "does not match its weights and tokenizer" in err and "changed after train.py wrote it" in err


@pytest.mark.parametrize("prompts, shown", [(["ROMEO:"], False), (["ROMEO:", "JULIET:", "First Citizen:"], True)])
def test_a_batch_of_prompts_shows_its_progress_where_one_prompt_shows_its_text(capsys, out_dir, tmp_path,
                                                                                monkeypatch, prompts, shown):
    bars = []

    def bar(iterable, desc, total, unit, disable):
        bars.append((desc, total, unit, disable))
        return iterable

    monkeypatch.setattr(sample, "tqdm", bar)
    (tmp_path / "p.txt").write_text("\n".join(prompts), encoding="utf-8")
    assert run_sample(capsys, out_dir, f"--prompts={tmp_path / 'p.txt'}")[0] == 0
    assert bars == [(f"{len(prompts)} samples", 24, "token", None if shown else True)]  # None: on a terminal


def test_top_k_above_the_vocabulary_is_clamped(capsys, out_dir):
    code, out, _ = run_sample(capsys, out_dir, "--top_k=100000", "--max_new_tokens=4")
    assert code == 0 and len(samples(out)) == 1


def test_help_lists_every_option(capsys):
    assert sample.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in sample.SampleConfig.__dataclass_fields__:
        assert f"--{name}=" in out


# --- Stop sequences ----------------------------------------------------------------------------------


class PieceTokenizer:
    """Each id stands for a piece of text, as a BPE token stands for several characters."""

    def __init__(self, *pieces):
        self.pieces = pieces

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def stream_all(stream, n):
    """What a stream gives for tokens 0..n-1 pushed one at a time, then flushed."""
    return [stream.push([i]) for i in range(n)] + [stream.flush()]


def test_a_stop_sequence_that_ends_inside_a_token_cuts_the_text_there():
    tokens = PieceTokenizer("The end", " is ne", "ar. After", "wards")
    stream = TextStream(tokens, ["near."])
    assert stream_all(stream, 4) == ["The end", " is ", "", "", ""]  # "ne" waited: it could begin "near."
    assert stream.stopped


def test_text_that_only_began_like_a_stop_sequence_is_released():
    stream = TextStream(PieceTokenizer("a\n", "b\n", "\n", "c"), ["\n\n"])
    assert stream_all(stream, 4) == ["a", "\nb", "", "", ""]
    stream = TextStream(PieceTokenizer("a\n", "b\n"), ["\n\n"])
    assert stream_all(stream, 2) == ["a", "\nb", "\n"]  # the end of the sample: what waited is printed
    assert not stream.stopped


def test_the_first_stop_sequence_to_appear_ends_the_text():
    stream = TextStream(PieceTokenizer("xx ab", "c", "d yy"), ["abcd", "bc", "zzz"])
    assert stream_all(stream, 3) == ["xx ", "a", "", ""]  # "bc" is complete before "abcd" is


def test_stop_sequences_on_the_command_line_read_backslash_n_and_t():
    assert unescape(r"a\n\tb\\n") == "a\n\tb\\n"


def sampled(capsys, out_dir, *args):
    """Each sample as printed, sampled at temperature 1."""
    code, out, err = run_sample(capsys, out_dir, "--temperature=1", "--seed=3", *args)
    assert code == 0, err
    return samples(out)


def generated(prompts, printed, n):
    """The n characters generated after each prompt (one character a token)."""
    return [text[len(prompt) : len(prompt) + n] for prompt, text in zip(prompts, printed)]


def as_printed(text):
    return text if text.endswith("\n") else text + "\n"


def test_a_streamed_sample_ends_before_its_stop_sequence_and_holds_back_no_more_than_it_must(capsys, out_dir,
                                                                                         monkeypatch):
    [free] = generated(["ROMEO:"], sampled(capsys, out_dir, "--start=ROMEO:", "--max_new_tokens=40"), 40)
    stop = free[12:15]  # three characters: three tokens, so a stop split across tokens
    end = free.index(stop)
    pieces = []
    monkeypatch.setattr(sample, "write", pieces.append)
    assert sample.main([f"--out_dir={out_dir}", "--start=ROMEO:", "--max_new_tokens=40", "--temperature=1",
                        "--seed=3", f"--stop={stop}"]) == 0
    assert pieces[0] == "ROMEO:" and pieces[-1].endswith(sample.SEPARATOR + "\n")
    streamed = pieces[1:-1]
    assert "".join(streamed) == free[:end] and end > 5
    assert len(streamed) >= end - 2 and all(len(p) <= len(stop) for p in streamed)  # held back: at most the stop


def test_each_row_of_a_batch_stops_on_its_own(capsys, out_dir, tmp_path):
    (tmp_path / "prompts.txt").write_text("ROMEO:\nTo be, or\n")
    prompts = ["ROMEO:", "To be, or"]
    free = generated(prompts, sampled(capsys, out_dir, f"--prompts={tmp_path / 'prompts.txt'}", "--max_new_tokens=60"),
                     60)
    # A stop that row 0 makes and row 1 does not; row 1 ends at max_new_tokens.
    stop = next(free[0][i : i + 2] for i in range(8, 50) if free[0][i : i + 2] not in free[1])
    stopped = sampled(capsys, out_dir, f"--prompts={tmp_path / 'prompts.txt'}", "--max_new_tokens=60", f"--stop={stop}")
    assert stopped == [as_printed(prompts[0] + free[0][: free[0].index(stop)]), as_printed(prompts[1] + free[1])]


def test_generation_ends_when_every_row_has_stopped(capsys, out_dir, tmp_path, monkeypatch):
    (tmp_path / "prompts.txt").write_text("ROMEO:\nTo be, or\n")
    prompts = ["ROMEO:", "To be, or"]
    free = generated(prompts, sampled(capsys, out_dir, f"--prompts={tmp_path / 'prompts.txt'}", "--max_new_tokens=60"),
                     60)
    stops = [free[0][10:12], free[1][20:23]]  # repeated --stop: either one ends a row
    ends = [min(i for i in (text.find(s) for s in stops) if i >= 0) for text in free]
    produced = []
    real_stream = decoding.stream

    def counting_stream(*args, **kwargs):
        for token in real_stream(*args, **kwargs):
            produced.append(token)
            yield token

    monkeypatch.setattr(decoding, "stream", counting_stream)
    stopped = sampled(capsys, out_dir, f"--prompts={tmp_path / 'prompts.txt'}", "--max_new_tokens=60",
                      *(f"--stop={s}" for s in stops))
    assert stopped == [as_printed(p + text[:end]) for p, text, end in zip(prompts, free, ends)]
    # One token a character: the last row to stop did so when its stop sequence's last character came.
    last = max(end + len(next(s for s in stops if text[end:].startswith(s))) for text, end in zip(free, ends))
    assert len(produced) == last < 60


def test_a_stop_sequence_in_the_prompt_does_not_end_the_sample(capsys, out_dir):
    code, out, _ = run_sample(capsys, out_dir, "--start=ROMEO:", "--stop=ROMEO", "--max_new_tokens=10")
    assert code == 0 and len(samples(out)[0]) >= len("ROMEO:") + 10
