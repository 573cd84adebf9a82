"""Nothing lost when the world misbehaves: two runs into one out_dir, a full disk, a
prepare.py killed at any moment, closed or full streams, Ctrl-C, pipes as input, and
text in another Unicode form."""

import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import unicodedata
from pathlib import Path

import ladder
import numpy as np
import pytest
import torch

import prepare
import sample
import train
from tinygpt import files, score
from tinygpt.tokenizer import tokenizer_from_meta

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")
RUN = ["--max_iters=12", "--eval_interval=4", "--log_interval=1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread, as in-process (conftest.py): the same sums


def train_args(data_dir, out_dir, *extra):
    return [TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *RUN, *extra]


def computed(out_dir):
    """What a run computed, without its timings: (iter, kind, value) per log record."""
    records = [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]
    return [(r["iter"], k, r[k]) for r in records for k in ("loss", "val_loss") if k in r]


def saved_weights(out_dir):
    return torch.load(Path(out_dir) / "ckpt.pt", weights_only=True)["model"]


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def one_error_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def start(script, *args, **kwargs):
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
    return subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, env=ENV, **kwargs)


@pytest.fixture(scope="module")
def lone(data_dir, tmp_path_factory):
    """A run alone in its out_dir, to compare the others with."""
    out = tmp_path_factory.mktemp("lone")
    assert train.main(train_args(data_dir, out)) == 0
    return out


# --- One run per out_dir ------------------------------------------------------------------


def test_a_run_into_an_out_dir_in_use_exits_2_and_writes_nothing(data_dir, tmp_path, capsys):
    holder = files.RunLock(tmp_path)
    holder.acquire()
    try:
        assert train.main(train_args(data_dir, tmp_path)) == 2
    finally:
        holder.release()
    assert f"{tmp_path} is in use by another run; wait for it to end" in one_error_line(capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["lock"]
    assert train.main(train_args(data_dir, tmp_path)) == 0  # let go of: the next run goes ahead


def test_a_lock_left_by_a_killed_run_is_taken_over(data_dir, tmp_path):
    die_holding_it = ("import os, sys; from tinygpt import files; "
                      "files.RunLock(sys.argv[1]).acquire(); os.kill(os.getpid(), 9)")
    dead = subprocess.Popen([sys.executable, "-c", die_holding_it, str(tmp_path)], cwd=ROOT, env=ENV)
    assert dead.wait(timeout=60) == -signal.SIGKILL
    assert (tmp_path / "lock").exists()  # left by the dead run
    assert train.main(train_args(data_dir, tmp_path)) == 0


def test_two_runs_started_at_once_into_one_out_dir_one_trains_the_other_exits_2(data_dir, lone, tmp_path):
    procs = [start("train.py", *train_args(data_dir, tmp_path)) for _ in range(2)]
    results = [(p.communicate(timeout=300)[1], p.returncode) for p in procs]
    assert sorted(code for _, code in results) == [0, 2], results
    err = next(err for err, code in results if code == 2)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    # Still training (the lock), or already done (its checkpoint): either way, nothing of the other's is touched.
    assert "is in use by another run" in err or "exists; continue it with --init_from=resume" in err
    assert computed(tmp_path) == computed(lone)
    assert same_weights(saved_weights(tmp_path), saved_weights(lone))


# --- A full disk --------------------------------------------------------------------------


class FullDisk:
    """Files opened for writing through files.py, on a disk with `free` bytes left: a write
    past them writes what fits, then fails with ENOSPC, as a full file system does."""

    def __init__(self, free):
        self.free = free

    def open(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return Filling(f, self) if "w" in mode or "a" in mode else f


class Filling:
    def __init__(self, f, disk):
        self.f, self.disk = f, disk

    def write(self, data):
        fits = min(len(data), self.disk.free)
        if fits:
            self.f.write(bytes(memoryview(data)[:fits]))
            self.disk.free -= fits
        if fits < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fits

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_checkpoint_write_on_a_full_disk_exits_2_keeps_the_previous_one_and_resumes(
        data_dir, lone, tmp_path, monkeypatch, capsys, stop_at):
    stop_at(4)  # a run stopped at iteration 4, to be resumed
    assert train.main(train_args(data_dir, tmp_path)) == 128 + signal.SIGTERM
    before = (tmp_path / "ckpt.pt").read_bytes()
    monkeypatch.setattr(files, "open", FullDisk(free=20_000).open, raising=False)  # log lines fit, a checkpoint not
    capsys.readouterr()
    assert train.main(train_args(data_dir, tmp_path, "--init_from=resume")) == 2
    err = one_error_line(capsys)
    assert f"no space left on device writing {tmp_path / 'ckpt.pt'}; the previous checkpoint is kept" in err
    assert "--init_from=resume" in err
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "ckpt.pt", "lock", "log.jsonl"]  # no .tmp
    monkeypatch.undo()  # space freed
    assert train.main(train_args(data_dir, tmp_path, "--init_from=resume")) == 0
    assert computed(tmp_path) == computed(lone)


def test_a_log_line_on_a_full_disk_is_not_written_in_part_and_the_run_resumes(
        data_dir, lone, tmp_path, monkeypatch, capsys, stop_at):
    stop_at(4)  # a run stopped at iteration 4, to be resumed
    assert train.main(train_args(data_dir, tmp_path)) == 128 + signal.SIGTERM
    log = (tmp_path / "log.jsonl").read_bytes()
    # Room for the log as it is (a resume rewrites it) and one line and a half more.
    monkeypatch.setattr(files, "open", FullDisk(free=len(log) + 200).open, raising=False)
    capsys.readouterr()
    assert train.main(train_args(data_dir, tmp_path, "--init_from=resume")) == 2
    assert f"no space left on device writing {tmp_path / 'log.jsonl'}" in one_error_line(capsys)
    text = (tmp_path / "log.jsonl").read_text()
    assert text.endswith("\n") and len(text) > len(log)
    assert all(json.loads(line) for line in text.splitlines())  # whole lines only
    monkeypatch.undo()
    assert train.main(train_args(data_dir, tmp_path, "--init_from=resume")) == 0
    assert computed(tmp_path) == computed(lone)


def test_a_resume_drops_a_last_log_line_cut_short(data_dir, lone, tmp_path, stop_at):
    stop_at(4)  # a run stopped at iteration 4, to be resumed
    assert train.main(train_args(data_dir, tmp_path)) == 128 + signal.SIGTERM
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('{"iter": 5, "loss": 3.14')  # as a power cut leaves it
    assert train.main(train_args(data_dir, tmp_path, "--init_from=resume")) == 0
    assert computed(tmp_path) == computed(lone)


def test_a_damaged_line_inside_the_log_is_named_on_resume(data_dir, tmp_path, capsys, stop_at):
    stop_at(4)  # a run stopped at iteration 4, to be resumed
    assert train.main(train_args(data_dir, tmp_path)) == 128 + signal.SIGTERM
    lines = (tmp_path / "log.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "log.jsonl").write_text("".join([lines[0], "not json\n", *lines[1:]]))
    capsys.readouterr()
    assert train.main(train_args(data_dir, tmp_path, "--init_from=resume")) == 2
    assert "log.jsonl line 2 is not a log record" in one_error_line(capsys)


# --- prepare.py replaces a data set whole -------------------------------------------------


def text_of(n_lines, word):
    return "".join(f"{word} line {i}: the quick brown fox, {i % 7} times.\n" for i in range(n_lines))


def prepared_sha(out):
    """The sha256 of the text the complete data set in out was made from (else an error)."""
    meta, splits = files.load_data(out)  # meta.json and the bins, all checked
    head = tokenizer_from_meta(meta).decode(splits["train"][:40].tolist())
    return meta["sha256"], head


def leftovers(parent):
    return sorted(p.name for p in Path(parent).iterdir() if p.name.startswith("."))


def test_prepare_killed_at_any_moment_leaves_the_old_data_set_or_the_new_one(tmp_path):
    old, new = text_of(2000, "old"), text_of(400_000, "new")  # the new one takes a while: ~20 MB
    (tmp_path / "old.txt").write_text(old)
    (tmp_path / "new.txt").write_text(new)
    out = tmp_path / "data" / "set"
    assert prepare.main(["--input", str(tmp_path / "old.txt"), "--out_dir", str(out)]) == 0
    shas = {hashlib.sha256(t.encode()).hexdigest(): t for t in (old, new)}
    t0 = time.perf_counter()
    whole = start("prepare.py", "--input", tmp_path / "new.txt", "--out_dir", tmp_path / "elsewhere")
    whole.communicate(timeout=300)
    duration = time.perf_counter() - t0
    rng = random.Random(14)
    for _ in range(3):
        proc = start("prepare.py", "--input", tmp_path / "new.txt", "--out_dir", out)
        time.sleep(rng.uniform(0, duration))
        proc.kill()
        proc.communicate(timeout=60)
        sha, head = prepared_sha(out)
        assert sha in shas and shas[sha].startswith(head)
        assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert prepare.main(["--input", str(tmp_path / "new.txt"), "--out_dir", str(out)]) == 0
    assert shas[prepared_sha(out)[0]] == new
    assert leftovers(out.parent) == []  # what the kills left behind is gone


@pytest.mark.parametrize("signum, said", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM"),
                                           (signal.SIGHUP, "stopped by SIGHUP")])
def test_ctrl_c_during_prepare_keeps_the_old_data_set_and_leaves_nothing_behind(tmp_path, signum, said):
    """And SIGTERM or SIGHUP alike: each ends the work as Ctrl-C does, so its staging directory goes with it."""
    if signal.getsignal(signum) == signal.SIG_IGN:  # as under nohup: the child starts ignoring it, and keeps that
        pytest.skip(f"{signum.name} is ignored here, so in the child too (tinygpt.system leaves it so)")
    (tmp_path / "old.txt").write_text(text_of(200, "old"))
    out = tmp_path / "data" / "set"
    assert prepare.main(["--input", str(tmp_path / "old.txt"), "--out_dir", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    os.mkfifo(tmp_path / "fifo")
    proc = start("prepare.py", "--input", tmp_path / "fifo", "--out_dir", out)
    fd = os.open(tmp_path / "fifo", os.O_WRONLY)  # returns once prepare.py reads it: it is at work
    os.write(fd, text_of(100, "new").encode())
    proc.send_signal(signum)
    os.close(fd)  # an end to the input: a Ctrl-C that came just before a read waits for it to return
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (128 + signum, f"{said}\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(out.parent) == []


def test_a_failed_swap_keeps_the_old_data_set_and_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    (tmp_path / "old.txt").write_text(text_of(200, "old"))
    (tmp_path / "new.txt").write_text(text_of(300, "new"))
    out = tmp_path / "set"
    assert prepare.main(["--input", str(tmp_path / "old.txt"), "--out_dir", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(prepare, "swap_in", no_space)
    capsys.readouterr()
    assert prepare.main(["--input", str(tmp_path / "new.txt"), "--out_dir", str(out)]) == 2
    assert "no space left on device writing" in one_error_line(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path) == []


def test_files_in_out_dir_that_prepare_did_not_write_are_kept(tmp_path):
    out = tmp_path / "set"
    (out / "notes").mkdir(parents=True)
    (out / "input.txt").write_text(text_of(300, "mine"))
    (out / "notes" / "todo.md").write_text("train it")
    (out / "latest").symlink_to("input.txt")
    for _ in range(2):
        assert prepare.main(["--input", str(out / "input.txt"), "--out_dir", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["input.txt", "latest", "meta.json", "notes", "train.bin",
                                                     "val.bin"]
    assert (out / "input.txt").read_text() == text_of(300, "mine")
    assert (out / "notes" / "todo.md").read_text() == "train it"
    assert os.readlink(out / "latest") == "input.txt"
    assert leftovers(tmp_path) == []


def test_without_rename_exchange_a_kill_between_the_two_renames_is_undone(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "exchange", lambda a, b: False)  # a system without RENAME_EXCHANGE
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(text_of(200, name))
    out = tmp_path / "set"
    assert prepare.main(["--input", str(tmp_path / "a.txt"), "--out_dir", str(out)]) == 0
    assert prepare.main(["--input", str(tmp_path / "b.txt"), "--out_dir", str(out)]) == 0
    b = prepared_sha(out)
    os.rename(out, tmp_path / ".set.old")  # killed after the first rename: no data set at out
    files.remove_stale(out)  # what the next run does first
    assert prepared_sha(out) == b and leftovers(tmp_path) == []


def test_an_input_whose_name_is_not_utf8_replaces_the_data_set(tmp_path):
    out = tmp_path / "set"
    (tmp_path / "good.txt").write_text(text_of(200, "good"))
    assert prepare.main(["--input", str(tmp_path / "good.txt"), "--out_dir", str(out)]) == 0
    try:
        odd = tmp_path / os.fsdecode(b"caf\xe9.txt")
        odd.write_text(text_of(300, "odd"))
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes UTF-8 names only")
    assert prepare.main(["--input", str(odd), "--out_dir", str(out)]) == 0
    meta = files.load_data(out)[0]
    assert meta["source"] == "caf\ufffd.txt"
    assert meta["sha256"] == hashlib.sha256(text_of(300, "odd").encode()).hexdigest()


# --- Pipes as input -------------------------------------------------------------------------


def test_a_fifo_is_read_as_a_stream_not_taken_for_empty(tmp_path):
    text = text_of(300, "piped")
    os.mkfifo(tmp_path / "fifo")

    def feed():
        with open(tmp_path / "fifo", "w") as f:
            f.write(text)

    writer = threading.Thread(target=feed)
    writer.start()
    assert prepare.main(["--input", str(tmp_path / "fifo"), "--out_dir", str(tmp_path / "set")]) == 0
    writer.join()
    meta, splits = files.load_data(tmp_path / "set")
    tokenizer = tokenizer_from_meta(meta)
    assert tokenizer.decode(np.concatenate([splits["train"], splits["val"]]).tolist()) == text
    assert sorted(p.name for p in (tmp_path / "set").iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_a_data_set_it_may_not_read_says_to_check_permissions_not_to_prepare_it_again(data_dir, monkeypatch):
    def refuse(path, *args, **kwargs):  # as for a data set another user prepared (root reads anything)
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(Path, "read_text", refuse)
    why = r"^cannot read .*meta\.json \(Permission denied\); check its permissions$"
    with pytest.raises(train.UserError, match=why):
        files.load_data(data_dir)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_a_proc_file_reads_as_text(tmp_path):
    assert prepare.main(["--input", "/proc/self/status", "--out_dir", str(tmp_path / "set")]) == 0
    assert files.load_data(tmp_path / "set")[0]["train_tokens"] > 100


# --- Streams and signals ----------------------------------------------------------------------


def test_a_closed_or_full_stdout_stops_the_printing_not_the_training(data_dir, tmp_path):
    full = Path("/dev/full")  # every write fails with ENOSPC
    with open(full if full.exists() else os.devnull, "w") as full_device:
        closed = start("train.py", *train_args(data_dir, tmp_path / "closed", "--eval_interval=1"))
        closed.stdout.close()  # the reader is gone before the first line (| head -1)
        filled = start("train.py", *train_args(data_dir, tmp_path / "full", "--eval_interval=1"), stdout=full_device)
        results = [(proc.communicate(timeout=300)[1], proc.returncode) for proc in (closed, filled)]
    assert results == [("", 0), ("", 0)]  # no traceback, no "Exception ignored"
    for out in ("closed", "full"):
        assert files.load_checkpoint(tmp_path / out / "ckpt.pt")["iter"] == 12


def test_sample_stops_when_its_reader_goes_away(lone):
    proc = start("sample.py", f"--out_dir={lone}", "--max_new_tokens=2000", "--num_samples=50")
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert (proc.returncode, err) == (141, "")


# --- Ladder, and text in another Unicode form ------------------------------------------------------


def test_ladder_checks_every_rungs_whole_config_before_training_any(data_dir, tmp_path, capsys):
    args = [f"--out={tmp_path / 'ladder'}", f"--data_dir={data_dir}", "--n_head=3", "--max_iters=2"]
    assert ladder.main(args) == 2
    err = one_error_line(capsys)
    assert "rung 04_multihead: model config: n_embd (128) must be divisible by n_head (3)" in err
    assert not (tmp_path / "ladder").exists()  # rungs 1 to 3 did not train first


@pytest.fixture(scope="module")
def cafe(tmp_path_factory):
    """A tiny model of a text with an accented letter, stored composed (NFC)."""
    root = tmp_path_factory.mktemp("cafe")
    (root / "cafe.txt").write_text("un café au lait, merci. " * 300)
    assert prepare.main(["--input", str(root / "cafe.txt"), "--out_dir", str(root / "data")]) == 0
    assert train.main([TINY, f"--data_dir={root / 'data'}", f"--out_dir={root / 'out'}", "--max_iters=2"]) == 0
    return root / "out"


def test_a_prompt_in_decomposed_unicode_is_read_in_the_form_the_model_knows(cafe, capsys):
    typed = unicodedata.normalize("NFD", "un café")  # e + a combining accent, as some keyboards send it
    assert sample.main([f"--out_dir={cafe}", f"--start={typed}", "--max_new_tokens=3", "--temperature=0"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("un café") and "Unicode form NFC" in err


def test_score_notes_the_unicode_form_its_input_is_read_in(cafe, tmp_path, capsys):
    (tmp_path / "nfd.txt").write_text(unicodedata.normalize("NFD", "un café au lait"), encoding="utf-8")
    assert score.main([f"--out_dir={cafe}", f"--input={tmp_path / 'nfd.txt'}"]) == 0
    err = capsys.readouterr().err
    assert err == f"note: --input {tmp_path / 'nfd.txt'} is read in Unicode form NFC, whose characters the model " \
                  "knows\n"


def test_an_accent_the_model_knows_in_no_form_is_named_with_a_hint(cafe, capsys):
    typed = unicodedata.normalize("NFD", "un crème")  # è: neither composed nor decomposed in the text
    assert sample.main([f"--out_dir={cafe}", f"--start={typed}", "--max_new_tokens=3"]) == 2
    err = one_error_line(capsys)
    assert "'\u0300'" in err and "separate marks" in err
