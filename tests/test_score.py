"""score.py: bits per character of a text file, the figure the trainer logs for its val split."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from model import GPT, GPTConfig
from tinygpt import files, score
from tinygpt.tokenizer import tokenizer_from_meta

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    """config/tiny.toml trained briefly, its val split evaluated whole (eval_iters=0)."""
    out = tmp_path_factory.mktemp("scored")
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=20", "--eval_interval=20",
                       "--eval_iters=0", "--learning_rate=3e-3"]) == 0
    return out


def run_score(capsys, *args):
    capsys.readouterr()
    code = score.main([*args, "--device=cpu"])
    out, err = capsys.readouterr()
    return code, dict(line.split(": ", 1) for line in out.splitlines()[1:]), err


def test_the_val_split_scores_what_the_trainer_logged(run, data_dir, tmp_path, capsys):
    meta, splits = files.load_data(data_dir)
    val = splits["val"]
    assert (len(val) - 1) % 16 != 0  # the last window is a short one: every token is scored
    (tmp_path / "val.txt").write_text(tokenizer_from_meta(meta).decode(val), encoding="utf-8")
    code, printed, _ = run_score(capsys, f"--out_dir={run}", f"--input={tmp_path / 'val.txt'}")
    assert code == 0
    logged = [json.loads(line) for line in open(run / "log.jsonl") if "val_loss" in line][-1]
    assert float(printed["bits per character"]) == pytest.approx(logged["val_bpc"], abs=1e-4)
    assert printed["bits per token"] == printed["bits per character"]  # one token a character
    assert float(printed["loss per token"].split()[0]) == pytest.approx(logged["val_loss"], abs=1e-4)
    assert logged["val_bpc"] < math.log2(meta["vocab_size"]) - 0.5  # better than a uniform guess: a model that learned


def test_with_no_out_dir_it_scores_the_run_train_py_makes_with_none(run, tmp_path, monkeypatch, capsys):
    shutil.copytree(run, tmp_path / "out" / "shakespeare_char")  # where python train.py, given nothing, writes
    (tmp_path / "text.txt").write_text("the cat sat on the mat.\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    code, printed, _ = run_score(capsys, "--input=text.txt")
    assert code == 0 and float(printed["bits per character"]) > 0


def test_mean_loss_predicts_every_token_once_from_its_window():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)).eval()
    ids = np.random.default_rng(0).integers(0, 11, size=30)  # 29 predictions: 3 windows of 8 and one of 5
    total = 0.0
    for start in range(0, 29, 8):
        window = torch.from_numpy(ids[start : start + 9]).long()
        logits, _ = model(window[None, :-1])
        total += F.cross_entropy(logits[0], window[1:], reduction="sum").item()
    for batch_size in (1, 3, 16):
        assert score.mean_loss(model, ids, 8, batch_size, "cpu") == pytest.approx(total / 29, rel=1e-6)


def test_unknown_characters_are_named_or_skipped(run, tmp_path, capsys):
    (tmp_path / "t.txt").write_text("the cat sat\non the ☃ mat.\n" * 3)
    code, printed, err = run_score(capsys, f"--out_dir={run}", f"--input={tmp_path / 't.txt'}")
    assert code == 2 and err.count("\n") == 1
    assert f"'☃' ({tmp_path / 't.txt'} line 2 column 8)" in err and "--unknown=skip" in err
    code, printed, err = run_score(capsys, f"--out_dir={run}", f"--input={tmp_path / 't.txt'}", "--unknown=skip")
    assert code == 0 and err.startswith("warning: dropped") and float(printed["bits per character"]) > 0


def test_a_run_directory_as_init_from_scores_its_best_checkpoint(run, tmp_path, capsys):
    assert (run / "best.pt").is_file()
    shutil.copy(run / "best.pt", tmp_path / "best.pt")
    (tmp_path / "ckpt.pt").write_bytes(b"not the checkpoint to take")  # best.pt, when it exists, as sample.py
    (tmp_path / "t.txt").write_text("the cat sat on the mat.\n" * 3)
    code, printed, err = run_score(capsys, f"--init_from={tmp_path}", f"--input={tmp_path / 't.txt'}")
    assert (code, err) == (0, "")
    assert printed == run_score(capsys, f"--out_dir={run}", "--checkpoint=best.pt", f"--input={tmp_path / 't.txt'}")[1]


@pytest.mark.parametrize("args,says", [
    ([], "--input=FILE"),
    (["--input=no/such.txt"], "not found"),
    (["--input=BINARY"], "not UTF-8"),
    (["--input=ONE"], "needs 2 or more"),
    (["--input=ONE", "--checkpoint=missing.pt"], "missing.pt"),
    (["--input=ONE", "--unknown=ignore"], "unknown"),
    (["--input=ONE", "--batch_size=0"], "batch_size"),
])
def test_bad_input_is_one_error_line(run, tmp_path, capsys, args, says):
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00text")
    (tmp_path / "one").write_text("t")
    args = [a.replace("BINARY", str(tmp_path / "binary")).replace("ONE", str(tmp_path / "one")) for a in args]
    code, _, err = run_score(capsys, f"--out_dir={run}", *args)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and says in err
