"""GPT-2 in the Hugging Face hub's layout loads into model.GPT and computes what the
reference implementation (transformers, installed for tests only) computes.

Nothing downloads: the model is a small random GPT-2 made by transformers and saved
with save_pretrained, and tiktoken's gpt2 is replaced by a small local encoding
(conftest.small_gpt2) whose vocabulary the model shares.
"""

import json
import sys

import numpy as np
import pytest
import torch

import prepare
import sample
import train
from tinygpt import export, files, gpt2, score
from tinygpt.tokenizer import TiktokenTokenizer, tokenizer_from_meta

transformers = pytest.importorskip("transformers", reason="the reference GPT-2: pip install -r requirements-dev.txt")

N_POSITIONS = 64


def error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def reference_gpt2(vocab_size, seed=0, **overrides):
    """A small random GPT2LMHeadModel. Its weights are drawn wider than GPT-2's own init
    (std 0.02), LayerNorm gains and biases included, so that every part of the mapping,
    GELU's approximation included, moves the logits by far more than the tolerance."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=N_POSITIONS, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, **overrides)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied head is the embedding: drawn once
            p.normal_(mean=1.0 if ".ln_" in name and name.endswith(".weight") else 0.0, std=0.3)
    return model


@pytest.fixture
def hub_dir(tmp_path, small_gpt2):
    """(directory in the hub's layout, the reference model in it)."""
    model = reference_gpt2(small_gpt2)
    model.save_pretrained(tmp_path / "gpt2-small-random")
    assert (tmp_path / "gpt2-small-random" / "model.safetensors").is_file()
    return tmp_path / "gpt2-small-random", model


def test_gpt2_in_the_hub_layout_gives_the_reference_logits(hub_dir, small_gpt2):
    directory, reference = hub_dir
    config, state, meta = export.load(str(directory))
    assert (config.gelu, config.bias, config.block_size, config.tie_weights) == ("tanh", True, N_POSITIONS, True)
    assert meta == {"tokenizer": "tiktoken", "encoding": "gpt2", "vocab_size": small_gpt2}
    model = gpt2.build(config, state)
    idx = torch.randint(small_gpt2, (3, N_POSITIONS))
    ours, _ = model(idx)
    theirs = reference(idx).logits
    assert ours.shape == theirs.shape and theirs.abs().max() > 1  # logits of a size that a wrong mapping moves
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_the_exact_gelu_would_not_match(hub_dir, small_gpt2):
    # The tolerance above is tight enough to tell GPT-2's tanh GELU from the exact one.
    directory, reference = hub_dir
    config, state, _ = export.load(str(directory))
    config.gelu = "exact"
    idx = torch.randint(small_gpt2, (2, 32))
    assert (gpt2.build(config, state)(idx)[0] - reference(idx).logits).abs().max() > 1e-4


def test_a_pytorch_model_bin_loads_the_same_as_safetensors(hub_dir, tmp_path):
    directory, reference = hub_dir
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text((directory / "config.json").read_text())
    state = reference.state_dict()
    state = {"transformer." + k if not k.startswith(("transformer.", "lm_head")) else k: v for k, v in state.items()}
    state["transformer.h.0.attn.bias"] = torch.ones(1, 1, 4, 4)  # the causal mask older files keep as a buffer
    torch.save(state, legacy / "pytorch_model.bin")
    a, b = export.load(str(directory))[1], export.load(str(legacy))[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sample_greedy_tokens_are_the_reference_greedy_generate(hub_dir, capsys):
    directory, reference = hub_dir
    prompt = "the cat and the hat"
    tokenizer = TiktokenTokenizer("gpt2")
    ids = tokenizer.encode(prompt)
    new = N_POSITIONS - len(ids)  # within the context: the reference cannot go past it
    expected = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert len(set(expected.tolist())) > 3  # not one token repeated: the comparison means something
    assert sample.main([f"--init_from={directory}", f"--start={prompt}", "--temperature=0",
                        f"--max_new_tokens={new}", "--device=cpu"]) == 0
    out = capsys.readouterr().out
    assert out == prompt + tokenizer.decode(expected.tolist()) + "\n" + sample.SEPARATOR + "\n"


def test_score_reads_gpt2_too(hub_dir, tmp_path, capsys):
    directory, reference = hub_dir
    (tmp_path / "text.txt").write_text("the theatre and the hand: then there, in the end. " * 2)
    assert score.main([f"--init_from={directory}", f"--input={tmp_path / 'text.txt'}", "--device=cpu"]) == 0
    printed = dict(line.split(": ") for line in capsys.readouterr().out.splitlines()[1:])
    ids = torch.tensor([tokenizer_from_meta(export.load(str(directory))[2]).encode(
        (tmp_path / "text.txt").read_text())])
    assert ids.size(1) <= N_POSITIONS  # one window: the reference's own loss is the figure
    loss = reference(ids, labels=ids).loss.item()
    assert float(printed["loss per token"].split()[0]) == pytest.approx(loss, abs=1e-4)


# --- Fine-tuning GPT-2 -----------------------------------------------------------------------------


def test_finetuning_gpt2_starts_from_its_weights(hub_dir, tmp_path, capsys):
    directory, reference = hub_dir
    (tmp_path / "in.txt").write_text("the other hand and the theatre then. " * 80)
    assert prepare.main(["--input", str(tmp_path / "in.txt"), "--tokenizer", "gpt2",
                         "--out_dir", str(tmp_path / "d")]) == 0
    args = [f"--init_from={directory}", f"--data_dir={tmp_path / 'd'}", f"--out_dir={tmp_path / 'out'}",
            f"--block_size={N_POSITIONS}", "--batch_size=4", "--max_iters=3", "--eval_interval=3",
            "--eval_iters=0", "--dropout=0", "--device=cpu", "--learning_rate=1e-3"]
    assert train.main(args) == 0
    log = [json.loads(line) for line in open(tmp_path / "out" / "log.jsonl")]
    assert [r["iter"] for r in log if "val_loss" in r] == [0, 3]
    # The first evaluation is GPT-2's own loss on the val split, windowed as score.py does.
    val = np.memmap(tmp_path / "d" / "val.bin", dtype=np.uint16, mode="r")
    model = gpt2.build(*export.load(str(directory))[:2])
    expected = score.mean_loss(model, val, N_POSITIONS, 8, "cpu")
    assert log[0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    ckpt = files.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert (ckpt["model_config"]["gelu"], ckpt["model_config"]["bias"], ckpt["iter"]) == ("tanh", True, 3)
    assert "fine-tuning" in capsys.readouterr().out


def test_finetuning_gpt2_on_a_shorter_block_keeps_the_first_positions(hub_dir, tmp_path):
    directory, _ = hub_dir
    (tmp_path / "in.txt").write_text("the hand and the theatre. " * 40)
    assert prepare.main(["--input", str(tmp_path / "in.txt"), "--tokenizer", "gpt2",
                         "--out_dir", str(tmp_path / "d")]) == 0
    assert train.main([f"--init_from={directory}", f"--data_dir={tmp_path / 'd'}", f"--out_dir={tmp_path / 'o'}",
                       "--block_size=16", "--batch_size=2", "--max_iters=0", "--eval_iters=1", "--device=cpu"]) == 0
    wpe = files.load_checkpoint(tmp_path / "o" / "ckpt.pt")["model"]["wpe.weight"]
    assert torch.equal(wpe, export.load(str(directory))[1]["wpe.weight"][:16])


def test_finetuning_gpt2_on_character_data_is_one_error_line(hub_dir, data_dir, tmp_path, capsys):
    directory, _ = hub_dir
    assert train.main([f"--init_from={directory}", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'o'}",
                       "--block_size=16", "--device=cpu"]) == 2
    assert "--tokenizer=gpt2" in error_line(capsys)
    assert not (tmp_path / "o").exists()


# --- What cannot load: one error line -----------------------------------------------------------------


def test_without_huggingface_hub_the_download_is_one_error_line(small_gpt2, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes `import huggingface_hub` fail
    assert sample.main(["--init_from=gpt2", "--device=cpu"]) == 2
    assert "pip install huggingface_hub safetensors" in error_line(capsys)


def test_offline_without_cached_weights_is_one_error_line(small_gpt2, tmp_path, monkeypatch, capsys):
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets: no network at all
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert sample.main(["--init_from=gpt2-medium", "--device=cpu"]) == 2
    line = error_line(capsys)
    assert "openai-community/gpt2-medium" in line and "cache" in line and "--init_from=DIR" in line


def test_without_safetensors_a_directory_is_one_error_line(hub_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert sample.main([f"--init_from={hub_dir[0]}", "--device=cpu"]) == 2
    assert "pip install safetensors" in error_line(capsys)


class RunsCode:
    def __reduce__(self):
        return (print, ("this ran",))


@pytest.mark.parametrize("damage,says", [
    (lambda d: (d / "model.safetensors").write_bytes(b"not tensors"), "not a readable safetensors"),
    (lambda d: (d / "model.safetensors").unlink(), "neither model.safetensors nor pytorch_model.bin"),
    (lambda d: (d / "config.json").unlink(), "config.json not found"),
    (lambda d: (d / "config.json").write_text("{"), "not valid JSON"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "model_type": "llama"})), "model_type 'llama'"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "vocab_size": 50257})), "vocabulary of 50257"),
])
def test_a_directory_that_is_not_gpt2_is_one_error_line(hub_dir, capsys, damage, says):
    damage(hub_dir[0])
    assert sample.main([f"--init_from={hub_dir[0]}", "--device=cpu"]) == 2
    assert says in error_line(capsys)


def test_a_pytorch_model_bin_that_would_run_code_is_refused(hub_dir, capsys):
    directory, _ = hub_dir
    (directory / "model.safetensors").unlink()
    torch.save({"x": RunsCode()}, directory / "pytorch_model.bin")
    assert sample.main([f"--init_from={directory}", "--device=cpu"]) == 2
    out, err = capsys.readouterr()
    assert "this ran" not in out and "refused" in err and err.count("\n") == 1


def test_sample_init_from_something_else_is_one_error_line(capsys):
    assert sample.main(["--init_from=gpt3", "--device=cpu"]) == 2
    assert "gpt2-xl" in error_line(capsys)
