"""python -m tinygpt.export: a model trained here, loaded by transformers and onnxruntime, computes what
model.GPT computes, its tokenizer reads text as prepare.py does, and the export reads back in.

Nothing downloads: the models are trained here in a second or two, BPE is a small local encoding
(conftest.small_gpt2), and transformers and onnxruntime are the test's references.
"""

import dataclasses
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import prepare
import sample
import train
from model import GPT, GPTConfig
from tinygpt import export, files, score
from tinygpt.tokenizer import CharTokenizer

transformers = pytest.importorskip("transformers", reason="the reference: pip install -r requirements-dev.txt")

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")
SHAKESPEARE = ROOT.parent / "shared/data/tinyshakespeare/input.txt"
BLOCK = 64
ARCHS = {"learned": "GPT2LMHeadModel", "rope": "GPTNeoXForCausalLM"}
NON_ASCII = "naïve café, 3 crème brûlées — 東京 🙂\n\tä tab\tand\r\n a line ending of Windows; Ωμέγα 1½\n"


def error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def shakespeare():
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_text(encoding="utf-8")
    return "ROMEO: What light through yonder window breaks?\nJULIET: O Romeo, Romeo!\n\n" * 3000  # a clone without it


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Tiny Shakespeare, whole, prepared as characters."""
    root = tmp_path_factory.mktemp("export_data")
    (root / "input.txt").write_text(shakespeare(), encoding="utf-8")
    assert prepare.main(["--input", str(root / "input.txt"), "--out_dir", str(root / "chars")]) == 0
    return root / "chars"


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """{pos: out_dir} of two models trained briefly: learned positions (GPT-2's), and rotary ones without biases,
    with a tanh GELU (GPT-NeoX's). In fp32 on every CPU: the greedy text they make must not hang on whether
    this CPU trains in bf16."""
    root, out = tmp_path_factory.mktemp("export_runs"), {}
    for pos, extra in (("learned", []), ("rope", ["--bias=false", "--gelu=tanh"])):
        out[pos] = root / pos
        assert train.main([TINY, f"--data_dir={data}", f"--out_dir={out[pos]}", f"--block_size={BLOCK}", f"--pos={pos}",
                           "--max_iters=200", "--eval_interval=200", "--learning_rate=1e-2", "--dtype=float32",
                           *extra]) == 0
    return out


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    """{pos: directory} of each run exported for transformers."""
    root = tmp_path_factory.mktemp("exported")
    for pos, out_dir in runs.items():
        assert export.main([f"--out_dir={out_dir}", f"--to={root / pos}"]) == 0
    return {pos: root / pos for pos in runs}


def our_model(out_dir):
    from tinygpt.weights import load_model

    return load_model("resume", str(out_dir), "", "cpu")


def save_checkpoint(out_dir, config, meta, std=0.3, seed=0):
    """A checkpoint as train.py writes one, of a random GPT whose weights are drawn wider than its own init
    (LayerNorm gains and biases too), so that any part of a mapping gone wrong moves the logits by far more
    than the tolerance."""
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(mean=1.0 if ".ln_" in f".{name}" and name.endswith(".weight") else 0.0, std=std)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(config), "meta": meta},
               out_dir / "best.pt")
    return model.eval()


def greedy_sample(capsys, *args, new=40):
    capsys.readouterr()
    assert sample.main([*args, "--start=ROMEO:", "--temperature=0", f"--max_new_tokens={new}", "--device=cpu",
                        "--dtype=float32"]) == 0
    return capsys.readouterr().out


# --- transformers computes what model.GPT computes -------------------------------------------------------


@pytest.mark.parametrize("pos", ARCHS)
def test_transformers_logits_equal_ours_at_full_block_length(runs, exported, pos):
    ours, tokenizer = our_model(runs[pos])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported[pos])
    assert type(theirs).__name__ == ARCHS[pos]
    assert theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight  # tied stays tied
    idx = torch.randint(tokenizer.vocab_size, (3, BLOCK), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(idx)[0], theirs(idx).logits
    assert a.shape == b.shape and a.abs().max() > 1  # logits of a size that a wrong mapping moves
    assert (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("pos", ARCHS)
@pytest.mark.parametrize("switches", [dict(bias=False, tie_weights=False, gelu="exact"),
                                      dict(bias=True, tie_weights=True, gelu="tanh")])
def test_every_switch_that_exports_keeps_the_logits(tmp_path, pos, switches):
    config = GPTConfig(vocab_size=64, real_vocab_size=50, block_size=24, n_layer=2, n_head=4, n_embd=32, pos=pos,
                       **switches)
    ours = save_checkpoint(tmp_path / "run", config, CharTokenizer(chr(c) for c in range(40, 90)).meta())
    assert export.main([f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert theirs.config.vocab_size == 50  # the padding rows stay behind
    idx = torch.randint(50, (2, 24))
    with torch.no_grad():
        a, b = ours(idx)[0], theirs(idx).logits
    assert a.abs().max() > 1 and (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("pos", ARCHS)
def test_pipeline_greedy_text_is_sample_py_at_temperature_0(runs, exported, pos, capsys):
    pipe = transformers.pipeline("text-generation", model=str(exported[pos]), device="cpu")
    text = pipe("ROMEO:", max_new_tokens=BLOCK - 6, do_sample=False)[0]["generated_text"]
    assert len(set(text[6:])) > 4  # more than one character repeated: the comparison means something
    expected = text + ("" if text.endswith("\n") else "\n") + sample.SEPARATOR + "\n"
    assert greedy_sample(capsys, f"--out_dir={runs[pos]}", new=BLOCK - 6) == expected


@pytest.mark.parametrize("pos", ARCHS)
def test_sample_and_score_read_the_export_back(runs, exported, pos, capsys, tmp_path):
    assert greedy_sample(capsys, f"--init_from={exported[pos]}") == greedy_sample(capsys, f"--out_dir={runs[pos]}")
    (tmp_path / "text.txt").write_text(shakespeare()[:3000], encoding="utf-8")
    losses = []
    for where in (f"--init_from={exported[pos]}", f"--out_dir={runs[pos]}"):
        assert score.main([where, f"--input={tmp_path / 'text.txt'}", "--device=cpu", "--dtype=float32"]) == 0
        losses.append(float(capsys.readouterr().out.split("loss per token: ")[1].split()[0]))
    assert losses[0] == pytest.approx(losses[1], abs=1e-4)


def test_no_character_ends_a_generation(exported):
    for directory in exported.values():
        config = json.loads((directory / "config.json").read_text())
        generation = json.loads((directory / "generation_config.json").read_text())
        assert config["eos_token_id"] is None and generation["eos_token_id"] is None  # GPT-NeoX's default 2 is '!'
        assert transformers.AutoTokenizer.from_pretrained(directory).eos_token is None


# --- The tokenizer -----------------------------------------------------------------------------------------


def prepared_ids(data_dir):
    splits = files.load_data(data_dir)[1]
    return np.concatenate([splits["train"], splits["val"]]).tolist()


def test_the_tokenizer_reads_tiny_shakespeare_as_prepare_py_does(data, exported):
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported["rope"])
    text = shakespeare()
    ids = tokenizer(text)["input_ids"]
    assert ids == prepared_ids(data)
    assert tokenizer.decode(ids) == text


def test_the_tokenizer_round_trips_non_ascii_text_and_drops_an_unknown_character(tmp_path):
    (tmp_path / "in.txt").write_text(NON_ASCII * 50, encoding="utf-8", newline="")
    assert prepare.main(["--input", str(tmp_path / "in.txt"), "--out_dir", str(tmp_path / "d")]) == 0
    assert train.main([TINY, f"--data_dir={tmp_path / 'd'}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1",
                       "--eval_iters=1"]) == 0
    assert export.main([f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = (NON_ASCII * 50).replace("\r\n", "\n")  # as prepare.py read it
    ids = tokenizer(text)["input_ids"]
    assert ids == prepared_ids(tmp_path / "d") and tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer("東€京")["input_ids"]) == "東京"  # '€' is not in the vocabulary: dropped


def test_bpe_exports_with_transformers_tokenizer_and_reads_back(small_gpt2, tmp_path, capsys):
    text = (shakespeare()[:20000] + "\n\n" + NON_ASCII) * 2
    (tmp_path / "in.txt").write_text(text, encoding="utf-8", newline="")
    assert prepare.main(["--input", str(tmp_path / "in.txt"), "--tokenizer=gpt2", "--out_dir", str(tmp_path / "d")]) \
        == 0
    assert train.main([TINY, f"--data_dir={tmp_path / 'd'}", f"--out_dir={tmp_path / 'run'}", "--pos=rope",
                       "--max_iters=2", "--eval_iters=1"]) == 0
    with pytest.MonkeyPatch.context() as m:  # BPE's tokenizer.json comes from transformers' tiktoken converter
        m.setitem(sys.modules, "transformers", None)
        assert export.main([f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}"]) == 2
    assert "pip install safetensors transformers" in error_line(capsys) and not (tmp_path / "hf").exists()
    assert export.main([f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = text.replace("\r\n", "\n")  # as prepare.py read it
    ids = tokenizer(text)["input_ids"]
    assert ids == prepared_ids(tmp_path / "d") and tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == small_gpt2 - 1
    assert greedy_sample(capsys, f"--init_from={tmp_path / 'hf'}", new=10) == \
        greedy_sample(capsys, f"--out_dir={tmp_path / 'run'}", new=10)


# --- ONNX ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", ARCHS)
def test_onnxruntime_logits_equal_ours_at_two_batch_sizes_and_lengths(runs, pos, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    assert export.main([f"--out_dir={runs[pos]}", f"--to={tmp_path / 'onnx'}", "--format=onnx"]) == 0
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"))
    ours, tokenizer = our_model(runs[pos])
    for batch, length in ((1, 7), (3, BLOCK), (3, 7), (1, BLOCK)):
        idx = torch.randint(tokenizer.vocab_size, (batch, length))
        [logits] = session.run(["logits"], {"ids": idx.numpy()})
        with torch.no_grad():
            assert np.abs(logits - ours(idx)[0].numpy()).max() < 1e-4


# --- What is refused: one error line, exit 2, nothing at the target ------------------------------------------


def refused(capsys, tmp_path, *args):
    before = sorted(os.listdir(tmp_path))
    assert export.main([*args]) == 2
    line = error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == before  # no target, no staging directory left beside it
    return line


@pytest.mark.parametrize("switch, value", [("mixer", "average"), ("mixer", "head"), ("mixer", "none"),
                                           ("feedforward", False), ("residual", False), ("layernorm", False),
                                           ("score", "additive"), ("window", 8), ("pos", "sinusoidal"),
                                           ("pos", "none")])
@pytest.mark.parametrize("fmt", ["hf", "onnx"])
def test_a_switch_no_standard_architecture_has_is_refused(tmp_path, capsys, switch, value, fmt):
    config = GPTConfig(vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=16, **{switch: value})
    save_checkpoint(tmp_path / "run", config, CharTokenizer("abcdefghijklmnopqrst").meta())
    line = refused(capsys, tmp_path, f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'x'}", f"--format={fmt}")
    assert f"{switch}={value}" in line


@pytest.mark.parametrize("case, says", [
    ("no checkpoint", "not found"),
    ("out_dir is a file", "is a file"),
    ("to exists", "--overwrite=true"),
    ("to is a file", "is a file"),
    ("no --to", "--to=DIR"),
    ("to below a file", "which is a file"),
    ("a damaged checkpoint", "pass --checkpoint=ckpt.pt if"),
    ("to is a run's out_dir", "is train.py's out_dir"),
])
def test_a_mistake_is_one_error_line_and_writes_nothing(runs, tmp_path, capsys, case, says):
    args = {"out_dir": runs["learned"], "to": tmp_path / "x"}
    if case == "no checkpoint":
        args["out_dir"] = tmp_path / "empty"
    elif case == "out_dir is a file":
        args["out_dir"] = runs["learned"] / "best.pt"
    elif case == "to exists":
        (tmp_path / "x").mkdir()
        (tmp_path / "x" / "config.json").write_text("{}")
    elif case == "to is a file":
        (tmp_path / "x").write_text("mine")
    elif case == "no --to":
        args["to"] = ""
    elif case == "to below a file":
        (tmp_path / "x").write_text("mine")
        args["to"] = tmp_path / "x" / "sub"
    elif case == "a damaged checkpoint":
        args["out_dir"] = tmp_path / "run"
        args["out_dir"].mkdir()
        (args["out_dir"] / "best.pt").write_bytes(b"PK\x03\x04 cut short")
    elif case == "to is a run's out_dir":
        args["to"], args["overwrite"] = runs["rope"], True
        before = sorted(os.listdir(runs["rope"]))
    assert says in refused(capsys, tmp_path, *(f"--{k}={v}" for k, v in args.items()))
    if case == "to is a run's out_dir":
        assert sorted(os.listdir(runs["rope"])) == before
    if case == "to exists":
        assert os.listdir(tmp_path / "x") == ["config.json"] and (tmp_path / "x" / "config.json").read_text() == "{}"


@pytest.mark.parametrize("fmt, missing", [("hf", "safetensors"), ("onnx", "onnx"), ("onnx", "onnxscript")])
def test_a_missing_optional_package_is_one_error_line(runs, tmp_path, capsys, monkeypatch, fmt, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` fail
    line = refused(capsys, tmp_path, f"--out_dir={runs['rope']}", f"--to={tmp_path / 'x'}", f"--format={fmt}")
    assert f"optional package {missing}: pip install " in line and missing in line.split("pip install ")[1].split()


def test_a_failed_write_leaves_the_old_export_whole(runs, exported, tmp_path, capsys, monkeypatch):
    target = tmp_path / "x"
    assert export.main([f"--out_dir={runs['rope']}", f"--to={target}"]) == 0
    (target / "README.md").write_text("a model card")
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_hf", full_disk)
    assert "no space left" in refused(capsys, tmp_path, f"--out_dir={runs['learned']}", f"--to={target}",
                                      "--overwrite=true")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    monkeypatch.undo()
    assert export.main([f"--out_dir={runs['learned']}", f"--to={target}", "--overwrite=true"]) == 0
    assert json.loads((target / "config.json").read_text())["model_type"] == "gpt2"
    assert (target / "README.md").read_text() == "a model card"  # what is not an export's own stays


# --- Back in: what model.GPT cannot compute is refused ------------------------------------------------------


@pytest.mark.parametrize("change, says", [
    ({"use_parallel_residual": True}, "use_parallel_residual"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"attention_bias": False}, "attention_bias"),
])
def test_a_gpt_neox_that_model_py_cannot_compute_is_one_error_line(exported, tmp_path, capsys, change, says):
    directory = tmp_path / "neox"
    directory.mkdir()
    for p in exported["rope"].iterdir():
        (directory / p.name).write_bytes(p.read_bytes())
    (directory / "config.json").write_text(json.dumps(json.loads((directory / "config.json").read_text()) | change))
    assert sample.main([f"--init_from={directory}", "--device=cpu"]) == 2
    assert says in error_line(capsys)


# --- A hostile user: edited directories, exports at once, signals, read-only targets, long inputs -------------


def leftovers(directory):
    """The hidden entries in directory: staging directories, an old export set aside."""
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("."))


def edited_copy(exported, pos, tmp_path, change):
    """A copy of an export, its config.json changed by change(config) -> what to write (any JSON)."""
    directory = tmp_path / "edited"
    shutil.copytree(exported[pos], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(change(config)))
    return directory


@pytest.mark.parametrize("pos, change, says", [
    ("rope", lambda c: c | {"num_hidden_layers": 1}, "weights its config.json has not"),
    ("rope", lambda c: c | {"num_hidden_layers": 0}, "num_hidden_layers must be a whole number from 1 to 256"),
    ("rope", lambda c: c | {"num_hidden_layers": 100_000}, "num_hidden_layers must be a whole number"),
    ("rope", lambda c: c | {"num_hidden_layers": "2"}, "num_hidden_layers must be a whole number"),
    ("rope", lambda c: c | {"num_attention_heads": True}, "num_attention_heads must be a whole number"),
    ("rope", lambda c: [c], "holds a JSON list"),
    ("rope", lambda c: c | {"model_type": "llama"}, "model_type 'llama'"),
    ("learned", lambda c: c | {"model_type": "bert"}, "model_type 'bert'"),
    ("learned", lambda c: {k: v for k, v in c.items() if k != "model_type"}, "model_type None"),
    ("learned", lambda c: [c], "holds a JSON list"),
    ("learned", lambda c: c | {"n_layer": 1}, "weights GPT-2 has not"),
])
def test_an_edited_config_json_is_one_error_line_before_a_model_of_its_size_is_made(exported, tmp_path, capsys,
                                                                                    pos, change, says):
    directory = edited_copy(exported, pos, tmp_path, change)
    assert sample.main([f"--init_from={directory}", "--device=cpu"]) == 2
    assert says in error_line(capsys)


def test_a_config_json_that_is_no_object_is_one_error_line_for_score_and_fine_tuning_too(exported, data, tmp_path,
                                                                                        capsys):
    directory = edited_copy(exported, "rope", tmp_path, lambda c: [c])
    (tmp_path / "text.txt").write_text("ROMEO: hello\n" * 20)
    assert score.main([f"--init_from={directory}", f"--input={tmp_path / 'text.txt'}"]) == 2
    assert "holds a JSON list" in error_line(capsys)
    assert train.main([f"--init_from={directory}", f"--data_dir={data}", f"--out_dir={tmp_path / 'run'}",
                       "--max_iters=1"]) == 2
    assert "holds a JSON list" in error_line(capsys)


@pytest.mark.parametrize("case", ["characters without their tokenizer.json", "another BPE than gpt2"])
def test_an_export_whose_tokens_cannot_be_read_back_says_so_without_a_download(exported, tmp_path, capsys,
                                                                             monkeypatch, case):
    import tiktoken

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: pytest.fail(f"tried to load tiktoken's {name}"))
    directory = edited_copy(exported, "rope", tmp_path, lambda c: c)
    if case == "another BPE than gpt2":
        (directory / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "merges": [["a", "b"]]}}))
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps(config | {"tiktoken_encoding": "cl100k_base"}))
    else:
        (directory / "tokenizer.json").unlink()
    assert sample.main([f"--init_from={directory}", "--device=cpu"]) == 2
    line = error_line(capsys)
    assert ("cl100k_base" if case == "another BPE than gpt2" else "no tokenizer.json of characters") in line
    assert "download" not in line


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_json_nested_past_what_the_parser_follows_is_one_error_line(exported, tmp_path, capsys, name):
    directory = edited_copy(exported, "rope", tmp_path, lambda c: c)
    (directory / name).write_text("[" * 200_000 + "]" * 200_000)
    assert sample.main([f"--init_from={directory}", "--device=cpu"]) == 2
    assert f"{name} is not valid JSON" in error_line(capsys)


def test_a_local_export_damaged_is_told_to_export_it_again_or_download_it(exported, tmp_path, capsys):
    directory = edited_copy(exported, "learned", tmp_path, lambda c: c)
    (directory / "config.json").write_text("{ cut short")
    assert sample.main([f"--init_from={directory}", "--device=cpu"]) == 2
    assert "get the model again (download it, or export it again)" in error_line(capsys)


def test_an_untrained_checkpoint_exports_with_a_warning(data, tmp_path, capsys):
    assert train.main([TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'run'}", "--max_iters=0"]) == 0
    capsys.readouterr()
    assert export.main([f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'x'}"]) == 0
    warning = capsys.readouterr().out.splitlines()[0]
    assert warning.startswith("warning: ") and "iteration 0" in warning and "untrained" in warning


def test_an_export_into_a_target_another_export_made_meanwhile_keeps_that_one(runs, tmp_path, capsys, monkeypatch):
    """Two exports into one new --to at once, neither with --overwrite: the one that swaps in second leaves
    the first's whole, and says so."""
    target, real = tmp_path / "x", export.write_hf

    def another_export_meanwhile(stage, *args):  # this export is half done: another one runs to its end
        real(stage, *args)
        command = [sys.executable, "-m", "tinygpt.export", f"--out_dir={runs['rope']}", f"--to={target}"]
        assert subprocess.run(command, cwd=ROOT, capture_output=True, timeout=300).returncode == 0

    monkeypatch.setattr(export, "write_hf", another_export_meanwhile)
    assert export.main([f"--out_dir={runs['learned']}", f"--to={target}"]) == 2
    assert "was written by another export while this one ran" in error_line(capsys)
    assert json.loads((target / "config.json").read_text())["model_type"] == "gpt_neox"  # the other's, whole
    assert leftovers(tmp_path) == []


SIGNALLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, os.getcwd())
    from tinygpt import export
    signum, real = int(sys.argv[1]), export.write_hf
    def write_hf(stage, *args):
        real(stage, *args)
        if signum:
            os.kill(os.getpid(), signum)  # half the export written
    export.write_hf = write_hf
    code = export.main(sys.argv[2:])
    if not signum:
        os.kill(os.getpid(), signal.SIGTERM)  # a stop just after the export is whole: the process ends by it
    raise SystemExit(code)
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_an_export_leaves_the_old_one_whole_and_nothing_beside_it(runs, tmp_path, signum):
    target = tmp_path / "x"
    assert export.main([f"--out_dir={runs['rope']}", f"--to={target}"]) == 0
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    command = [sys.executable, "-c", SIGNALLED, str(int(signum)), f"--out_dir={runs['learned']}", f"--to={target}",
               "--overwrite=true"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    assert (result.returncode, result.stderr) == (128 + signum, said + "\n")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before and leftovers(tmp_path) == []


def test_a_stop_just_after_an_export_is_whole_changes_nothing(runs, tmp_path):
    command = [sys.executable, "-c", SIGNALLED, "0", f"--out_dir={runs['learned']}", f"--to={tmp_path / 'x'}"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGTERM and result.stderr == ""
    assert json.loads((tmp_path / "x" / "config.json").read_text())["model_type"] == "gpt2"


def as_a_user(monkeypatch):
    """os.unlink and os.rmdir refuse an entry of a directory its owner may not write, as for any user but root
    (whom permissions do not stop, and who may be running these tests)."""
    def checked(real):
        def call(path, *, dir_fd=None):
            parent = os.fstat(dir_fd) if dir_fd is not None else os.stat(os.path.dirname(os.path.abspath(path)))
            if not parent.st_mode & stat.S_IWUSR:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return real(path, dir_fd=dir_fd)
        return call

    for name in ("unlink", "rmdir"):
        monkeypatch.setattr(os, name, checked(getattr(os, name)))


def test_overwriting_a_read_only_export_leaves_nothing_beside_it(runs, tmp_path, monkeypatch):
    target = tmp_path / "x"
    assert export.main([f"--out_dir={runs['rope']}", f"--to={target}"]) == 0
    target.chmod(0o555)
    as_a_user(monkeypatch)
    for _ in range(2):  # each overwrite swaps the old one out, read-only, and removes it
        assert export.main([f"--out_dir={runs['learned']}", f"--to={target}", "--overwrite=true"]) == 0
    assert json.loads((target / "config.json").read_text())["model_type"] == "gpt2"
    assert stat.S_IMODE(target.stat().st_mode) == 0o555 and leftovers(tmp_path) == []
    monkeypatch.undo()
    target.chmod(0o755)


def test_an_onnx_rope_model_reads_past_block_size_as_model_py_does_and_a_learned_one_refuses(runs, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    for pos in ARCHS:
        assert export.main([f"--out_dir={runs[pos]}", f"--to={tmp_path / pos}", "--format=onnx"]) == 0
    ours, tokenizer = our_model(runs["rope"])
    idx = torch.randint(tokenizer.vocab_size, (2, 3 * BLOCK + 5))
    [logits] = ort.InferenceSession(str(tmp_path / "rope" / "model.onnx")).run(["logits"], {"ids": idx.numpy()})
    with torch.no_grad():
        assert np.abs(logits - ours(idx)[0].numpy()).max() < 1e-4  # each query: its block_size newest keys
    with pytest.raises(Exception, match=f"{BLOCK} by {3 * BLOCK + 5}"):  # onnxruntime: the table has BLOCK rows
        ort.InferenceSession(str(tmp_path / "learned" / "model.onnx")).run(["logits"], {"ids": idx.numpy()})


def test_the_readmes_exports_directory_is_ignored_by_git():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert subprocess.run(["git", "check-ignore", "-q", "exports/notes/config.json"], cwd=ROOT).returncode == 0
