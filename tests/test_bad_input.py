"""The bad-input catalogue: every user mistake is one `error:` line, exit 2, no
traceback, and nothing already on disk is changed.

Each case names a script, sets up the mistake in a scratch copy of a small
prepared data set and trained checkpoint, and gives a fragment the message must
contain (the thing it names, or the fix it suggests).
"""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import prepare
import sample
import train
from tinygpt import files

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")
SCRIPTS = {"prepare": prepare.main, "train": train.main, "sample": sample.main}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """data/ (prepared), out/ (a trained tiny checkpoint): the state mistakes must not damage."""
    root = tmp_path_factory.mktemp("ws")
    (root / "input.txt").write_text("".join(f"row {i}: some plain text here.\n" for i in range(500)))
    assert prepare.main(["--input", str(root / "input.txt"), "--out_dir", str(root / "data")]) == 0
    assert train.main([TINY, f"--data_dir={root / 'data'}", f"--out_dir={root / 'out'}", "--max_iters=2"]) == 0
    return root


def snapshot(root):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def write(path, content):
    Path(path).write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def truncate_checkpoint(ws, name="ckpt.pt"):
    data = (ws / "out" / name).read_bytes()
    write(ws / "out" / name, data[: len(data) // 2])


def newer_checkpoint(ws, name="best.pt"):  # best.pt: what sample.py reads when it exists
    ckpt = torch.load(ws / "out" / name, weights_only=True)
    torch.save({**ckpt, "format": files.CHECKPOINT_FORMAT + 1}, ws / "out" / name)


def edit_checkpoint(change, name="best.pt"):
    """A setup that changes a checkpoint as a hand edit might: change(ckpt) edits it in place."""
    def setup(ws):
        ckpt = torch.load(ws / "out" / name, weights_only=True)
        change(ckpt)
        torch.save(ckpt, ws / "out" / name)
    return setup


def vocab_of_100(ckpt):
    ckpt["meta"]["vocab"], ckpt["meta"]["vocab_size"] = [chr(0x100 + i) for i in range(100)], 100


def mismatched_bins(ws):
    data = (ws / "data" / "train.bin").read_bytes()
    write(ws / "data" / "train.bin", data[:-10])


def edit_meta(change):
    """A setup that changes data/meta.json as a hand edit, or another tool, might."""
    def setup(ws):
        meta = json.loads((ws / "data" / "meta.json").read_text())
        write(ws / "data" / "meta.json", json.dumps(change(meta)))
    return setup


def id_past_the_vocabulary(ws):
    vocab_size = json.loads((ws / "data" / "meta.json").read_text())["vocab_size"]
    ids = np.fromfile(ws / "data" / "train.bin", dtype=np.uint16)
    ids[100] = vocab_size
    ids.tofile(ws / "data" / "train.bin")


def train_args(ws, *extra):
    return [TINY, f"--data_dir={ws / 'data'}", f"--out_dir={ws / 'new_out'}", "--max_iters=2", *extra]


AGAIN = "holds no data set as prepare.py writes it (meta.json, train.bin and val.bin, unchanged); prepare it again"

# (case, script, setup(ws) -> None, args(ws) -> list, fragment the message contains)
CASES = [
    ("empty text file", "prepare", lambda ws: write(ws / "empty.txt", ""),
     lambda ws: ["--input", str(ws / "empty.txt"), "--out_dir", str(ws / "data")], "is empty"),
    ("binary file", "prepare", lambda ws: write(ws / "blob.bin", bytes(range(256)) * 4),
     lambda ws: ["--input", str(ws / "blob.bin"), "--out_dir", str(ws / "data")], "binary"),
    ("non-UTF-8 text", "prepare", lambda ws: write(ws / "latin1.txt", "caf\xe9 au lait".encode("latin-1")),
     lambda ws: ["--input", str(ws / "latin1.txt"), "--out_dir", str(ws / "data")], "offset 3"),
    ("missing input file", "prepare", None,
     lambda ws: ["--input", str(ws / "nope.txt"), "--out_dir", str(ws / "data")], "not found"),
    ("val_fraction outside (0, 1)", "prepare", None,
     lambda ws: ["--input", str(ws / "input.txt"), "--out_dir", str(ws / "data"), "--val_fraction=1"], "val_fraction"),
    ("text shorter than block_size + 1 in a split", "train", None,
     lambda ws: train_args(ws, "--block_size=5000"), "block_size"),
    ("data dir without meta.json", "train", lambda ws: (ws / "nodata").mkdir(exist_ok=True),
     lambda ws: [TINY, f"--data_dir={ws / 'nodata'}", f"--out_dir={ws / 'new_out'}"], "meta.json not found"),
    ("bins that do not match meta.json", "train", mismatched_bins, lambda ws: train_args(ws), "prepare it again"),
    ("unknown config key", "train", None, lambda ws: train_args(ws, "--n_layers=2"), "did you mean n_layer"),
    ("ill-typed config value", "train", None, lambda ws: train_args(ws, "--batch_size=big"), "batch_size must be int"),
    ("TOML syntax error", "train", lambda ws: write(ws / "bad.toml", "n_layer = 2\nn_head = = 4\n"),
     lambda ws: [str(ws / "bad.toml")], "line 2"),
    ("unknown key in a TOML preset", "train", lambda ws: write(ws / "typo.toml", "learning_rat = 0.1\n"),
     lambda ws: [str(ws / "typo.toml")], "did you mean learning_rate"),
    ("out_dir not writable", "train", lambda ws: write(ws / "a_file", "x"),
     lambda ws: [TINY, f"--data_dir={ws / 'data'}", f"--out_dir={ws / 'a_file' / 'out'}"], "pick another --out_dir"),
    ("truncated checkpoint (resume)", "train", truncate_checkpoint,
     lambda ws: [TINY, f"--data_dir={ws / 'data'}", f"--out_dir={ws / 'out'}", "--init_from=resume"], "truncated"),
    ("truncated checkpoint (sample)", "sample", lambda ws: truncate_checkpoint(ws, "best.pt"),
     lambda ws: [f"--out_dir={ws / 'out'}", "--max_new_tokens=5"], "truncated"),
    ("a file that is not a checkpoint", "sample", lambda ws: write(ws / "out" / "best.pt", "hello, world\n"),
     lambda ws: [f"--out_dir={ws / 'out'}", "--max_new_tokens=5"], "is not a checkpoint (torch.save writes a zip"),
    ("a checkpoint from a newer format", "sample", newer_checkpoint,
     lambda ws: [f"--out_dir={ws / 'out'}", "--max_new_tokens=5"], "newer than this code"),
    ("missing checkpoint", "sample", None,
     lambda ws: [f"--out_dir={ws / 'no_such_run'}", "--max_new_tokens=5"], "not found"),
    ("prompt with unknown characters", "sample", None,
     lambda ws: [f"--out_dir={ws / 'out'}", "--start=row 1: ZEBRA", "--max_new_tokens=5"], "Z"),
    ("temperature below 0", "sample", None, lambda ws: [f"--out_dir={ws / 'out'}", "--temperature=-1"], "temperature"),
    ("top_k below 1", "sample", None, lambda ws: [f"--out_dir={ws / 'out'}", "--top_k=0"], "top_k"),
    ("top_p outside (0, 1]", "sample", None, lambda ws: [f"--out_dir={ws / 'out'}", "--top_p=1.5"], "top_p"),
    ("num_samples below 1", "sample", None, lambda ws: [f"--out_dir={ws / 'out'}", "--num_samples=0"], "num_samples"),
    ("max_new_tokens below 0", "sample", None,
     lambda ws: [f"--out_dir={ws / 'out'}", "--max_new_tokens=-3"], "max_new_tokens"),
    ("prompt file that does not exist", "sample", None,
     lambda ws: [f"--out_dir={ws / 'out'}", f"--start=FILE:{ws / 'nope.txt'}"], "not found"),
    # Every option's range, before anything is built or written
    *[(f"--{arg} out of range", "train", None, lambda ws, arg=arg: train_args(ws, f"--{arg}"), arg.split("=")[0])
      for arg in ("n_head=0", "batch_size=0", "eval_interval=0", "log_interval=0", "grad_accum=0", "dropout=1.5",
                  "learning_rate=-1", "n_layer=-1", "max_iters=-5", "warmup=-1", "beta2=1", "seed=-1",
                  "mixer=attention", "optimizer=sgd", "dtype=float8")],
    ("a device this machine does not have", "train", None, lambda ws: train_args(ws, "--device=cuda:99"), "cuda:99"),
    ("a model too large for this machine", "train", None, lambda ws: train_args(ws, "--n_layer=100000000"),
     "needs at least"),
    ("--overwrite=true with a config then rejected", "train", None,
     lambda ws: [TINY, f"--data_dir={ws / 'data'}", f"--out_dir={ws / 'out'}", "--overwrite=true", "--n_head=3"],
     "divisible"),
    ("sample option out of range", "sample", None, lambda ws: [f"--out_dir={ws / 'out'}", "--seed=-1"], "seed"),
    ("prepare into an out_dir that is a file", "prepare", lambda ws: write(ws / "a_file", "x"),
     lambda ws: ["--input", str(ws / "input.txt"), "--out_dir", str(ws / "a_file")], "is a file"),
    # meta.json and the bins, as prepare.py wrote them or not at all
    ("meta.json with another dtype", "train", edit_meta(lambda m: {**m, "dtype": "float32"}), train_args, AGAIN),
    ("meta.json with a dtype of no bytes", "train", edit_meta(lambda m: {**m, "dtype": []}), train_args, AGAIN),
    ("meta.json with a string format", "train", edit_meta(lambda m: {**m, "format": "1"}), train_args, AGAIN),
    ("meta.json holding a list", "train", edit_meta(lambda m: [m]), train_args, AGAIN),
    ("meta.json from newer code", "train", edit_meta(lambda m: {**m, "format": 2}), train_args, AGAIN),
    ("meta.json with a vocab shorter than vocab_size", "train", edit_meta(lambda m: {**m, "vocab": m["vocab"][:-1]}),
     train_args, AGAIN),
    ("meta.json without its vocab", "train", edit_meta(lambda m: {k: v for k, v in m.items() if k != "vocab"}),
     train_args, AGAIN),
    ("meta.json with a negative token count", "train", edit_meta(lambda m: {**m, "val_tokens": -1}), train_args,
     AGAIN),
    ("a token id at or past vocab_size", "train", id_past_the_vocabulary, train_args, AGAIN),
    # Texts in other encodings, and paths no data set can go to
    ("UTF-16 text without a byte order mark", "prepare", lambda ws: write(ws / "u16.txt", "text\n".encode("utf-16-le")),
     lambda ws: ["--input", str(ws / "u16.txt"), "--out_dir", str(ws / "data")], "is UTF-16LE text"),
    ("text in Windows' encoding", "prepare", lambda ws: write(ws / "w.txt", "\u201cquoted\u201d".encode("cp1252")),
     lambda ws: ["--input", str(ws / "w.txt"), "--out_dir", str(ws / "data")], "iconv -f cp1252 -t utf-8"),
    ("prepare into /", "prepare", None, lambda ws: ["--input", str(ws / "input.txt"), "--out_dir", "/"],
     "/ holds the directory this runs in"),
    # A checkpoint edited by hand: each is named, before a model of the size it says is built
    *[(f"a checkpoint {what}", "sample", edit_checkpoint(change), lambda ws: [f"--out_dir={ws / 'out'}"], says)
      for what, change, says in [
          ("whose model_config is a list", lambda c: c.update(model_config=[1]), "is not a checkpoint written by"),
          ("whose format is a string", lambda c: c.update(format="1"), "is not a checkpoint written by"),
          ("whose weights hold a number", lambda c: c["model"].update({"wte.weight": 5}), "is not a checkpoint"),
          ("whose meta is None", lambda c: c.update(meta=None), "holds no tokenizer (meta)"),
          ("whose meta lacks its vocab", lambda c: c["meta"].pop("vocab"), "vocab must be a list"),
          ("whose block_size was raised", lambda c: c["model_config"].update(block_size=10**12),
           "does not match its weights and tokenizer"),
          ("without real_vocab_size", lambda c: c["model_config"].pop("real_vocab_size"),
           "does not match its weights and tokenizer"),
          ("whose vocabulary is larger than its model's", vocab_of_100, "does not match its weights and tokenizer"),
          ("missing a tensor", lambda c: c["model"].pop("ln_f.weight"),
           'Missing key(s) in state_dict: "ln_f.weight"'),
      ]],
]


@pytest.mark.parametrize("case, script, setup, args, fragment", CASES, ids=[c[0] for c in CASES])
def test_user_mistake_is_one_error_line_and_changes_nothing(workspace, tmp_path, capsys,
                                                            case, script, setup, args, fragment):
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws)
    if setup:
        setup(ws)
    before = snapshot(ws)
    capsys.readouterr()
    assert SCRIPTS[script](args(ws)) == 2, capsys.readouterr()
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.out + captured.err
    assert fragment in lines[0], lines[0]
    assert snapshot(ws) == before, "a mistake changed files already on disk"
