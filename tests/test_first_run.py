"""A new user's first commands on a fresh clone: `python train.py`, then `python sample.py`, with no options."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import prepare
import train

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def fresh_clone(where):
    """What a clone holds that the commands run: the four files, config/ and the package."""
    for name in ("model.py", "train.py", "sample.py", "prepare.py"):
        shutil.copy(ROOT / name, where / name)
    for name in ("config", "tinygpt"):
        shutil.copytree(ROOT / name, where / name, ignore=shutil.ignore_patterns("__pycache__"))


def test_two_bare_commands_on_a_fresh_clone_train_and_then_sample(tmp_path):
    fresh_clone(tmp_path)
    # Where prepare.py's download would have left it (this machine is offline), which prepare.py then reads as
    # it would the download; without the file at hand, a text of its shape.
    (tmp_path / "data" / "shakespeare_char").mkdir(parents=True)
    text = SHAKESPEARE.read_text(encoding="utf-8") if SHAKESPEARE.is_file() else "First Citizen:\nSpeak.\n\n" * 5000
    (tmp_path / "data" / "shakespeare_char" / "input.txt").write_text(text, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trained = subprocess.run([sys.executable, "train.py", "--max_iters=20"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=900)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "data/shakespeare_char is not there yet: preparing it first" in trained.stdout
    assert "-> data/shakespeare_char" in trained.stdout  # prepare.py's own line
    assert (tmp_path / "out" / "shakespeare_char" / "best.pt").is_file()
    sampled = subprocess.run([sys.executable, "sample.py", "--max_new_tokens=50"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=900)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert len(sampled.stdout.strip()) >= 40  # 50 characters of Shakespeare's, a newline or two among them


@pytest.mark.parametrize("data_dir, command", [
    ("data/notes_char", "python prepare.py --input FILE --out_dir data/notes_char"),
    ("data/shakespeare_gpt2", "python prepare.py --tokenizer gpt2"),
])
def test_a_data_set_other_than_the_default_is_never_prepared_behind_the_users_back(
        tmp_path, monkeypatch, capsys, data_dir, command):
    monkeypatch.chdir(tmp_path)
    assert train.main([f"--data_dir={data_dir}", "--max_iters=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {data_dir}/meta.json not found; run: {command}"]
    assert not (tmp_path / "data").exists() and not (tmp_path / "out").exists()  # no data set, no run, no out/


def test_without_data_under_torchrun_the_processes_do_not_race_to_prepare_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    prepare.make_default("data/shakespeare_char", 2)  # rank 0 of 2
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr() == ("", "")
