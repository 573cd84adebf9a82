"""Nothing lost: kills, signals, non-finite losses, and files that would run code."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import prepare
import sample
import train
from tinygpt import files

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")
RUN = ["--max_iters=30", "--eval_interval=5", "--log_interval=1", "--dropout=0.1"]

# Runs train.py, but SIGKILLs itself halfway through the Nth torch.save: the
# checkpoint file being written is left truncated, as a power cut would leave it.
DIE_INSIDE_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, os.getcwd())
import train
real_save, calls = torch.save, 0
def save(obj, f, *args, **kwargs):
    global calls
    calls += 1
    if calls == int(os.environ["KILL_AT_SAVE"]):
        f.write(b"PK\\x03\\x04 half a checkpoint")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(obj, f, *args, **kwargs)
torch.save = save
sys.exit(train.main())
"""



@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out}", *RUN]) == 0
    return losses(out)


def losses(out_dir):
    """What a run computed, without its timings: (iter, kind, value) per log record."""
    records = [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]
    return [(r["iter"], k, r[k]) for r in records for k in ("loss", "val_loss") if k in r]


def start(data_dir, out_dir, *extra, script=None, env=None):
    """train.py in a subprocess, on one thread like the in-process runs (conftest.py):
    a different thread count sums floats in another order, and losses would differ."""
    cmd = [sys.executable, "-c", script, TINY] if script else [sys.executable, str(ROOT / "train.py"), TINY]
    return subprocess.Popen(cmd + [f"--data_dir={data_dir}", f"--out_dir={out_dir}", *RUN, *extra], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_iter(out_dir, it, proc, timeout=120):
    """Blocks until the run has logged iteration `it`."""
    deadline = time.time() + timeout
    log = Path(out_dir) / "log.jsonl"
    while time.time() < deadline:
        if log.exists() and any(json.loads(line)["iter"] >= it for line in log.read_text().splitlines() if line):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise TimeoutError(f"no iteration {it} within {timeout}s")


def resume_to_the_end(data_dir, out_dir):
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *RUN, "--init_from=resume"]) == 0


@pytest.mark.parametrize("kill_at_save", [1, 4, 7])
def test_sigkill_inside_a_checkpoint_write_leaves_one_that_loads(data_dir, uninterrupted, tmp_path, kill_at_save):
    proc = start(data_dir, tmp_path, script=DIE_INSIDE_SAVE, env={"KILL_AT_SAVE": str(kill_at_save)})
    proc.communicate(timeout=180)
    assert proc.returncode == -signal.SIGKILL
    if kill_at_save == 1:  # died writing the very first checkpoint: none to resume from
        assert not (tmp_path / "ckpt.pt").exists()
        return
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")  # the previous one, whole
    assert saved["iter"] > 0
    assert list(tmp_path.glob("*.tmp"))  # the half-written one (ckpt.pt.tmp or best.pt.tmp)...
    resume_to_the_end(data_dir, tmp_path)
    assert losses(tmp_path) == uninterrupted
    assert not list(tmp_path.glob("*.tmp"))  # ...removed by the next run


@pytest.mark.parametrize("after_iter", [7, 16])
def test_sigkill_at_any_moment_then_resume_finishes_like_an_uninterrupted_run(
        data_dir, uninterrupted, tmp_path, after_iter):
    proc = start(data_dir, tmp_path)
    wait_for_iter(tmp_path, after_iter, proc)
    proc.kill()
    proc.communicate(timeout=60)
    files.load_checkpoint(tmp_path / "ckpt.pt")
    resume_to_the_end(data_dir, tmp_path)
    assert losses(tmp_path) == uninterrupted


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signal_finishes_the_step_saves_and_exits(data_dir, uninterrupted, tmp_path, signum, code):
    proc = start(data_dir, tmp_path)
    wait_for_iter(tmp_path, 8, proc)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")
    assert f"stopped by {signal.Signals(signum).name} at iteration {saved['iter']}" in out
    assert str(tmp_path / "ckpt.pt") in out
    resume_to_the_end(data_dir, tmp_path)
    assert losses(tmp_path) == uninterrupted


# Runs train.py, but sends itself SIGTERM while the first evaluation draws its 20th batch.
TERM_IN_EVALUATION = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
import train
real_get_batch, calls = train.get_batch, 0
def get_batch(*args, **kwargs):
    global calls
    calls += 1
    if calls == 21:  # the first is the loop's first training batch
        os.kill(os.getpid(), signal.SIGTERM)
    return real_get_batch(*args, **kwargs)
train.get_batch = get_batch
sys.exit(train.main())
"""


def test_a_signal_ends_an_evaluation_between_two_batches_and_the_run_resumes_exactly(data_dir, uninterrupted,
                                                                                       tmp_path):
    proc = start(data_dir, tmp_path, "--eval_iters=1000000", script=TERM_IN_EVALUATION)  # hours, if not stopped
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert f"stopped by SIGTERM at iteration 0; saved {tmp_path / 'ckpt.pt'}" in out
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["val_loss"] is None  # the evaluation was not finished
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", *RUN, "--init_from=resume"]
    assert train.main(args + ["--eval_iters=2"]) == 0  # tiny.toml's, as the uninterrupted run's
    assert losses(tmp_path) == uninterrupted


def test_two_signals_in_a_long_evaluation_end_the_run_within_seconds_with_one_line(data_dir, tmp_path):
    proc = start(data_dir, tmp_path, "--eval_iters=1000000")
    while "params" not in proc.stdout.readline():  # the last line before the loop and its first evaluation
        assert proc.poll() is None, proc.communicate()
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    # The first may have ended the run already: the second then meets Python's exit, whose default action
    # ends the process by the signal, which a shell reports as 143 too.
    assert proc.returncode in (143, -signal.SIGTERM) and "Traceback" not in err, err
    said = [line for line in (out + err).splitlines() if line.startswith("stopped by")]
    assert len(said) == 1, out + err


def test_non_finite_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint(data_dir, tmp_path, capsys):
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=50", "--eval_interval=50"]
    assert train.main(args + ["--learning_rate=1e30", "--warmup=0", "--grad_clip=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: loss is ") and "at iteration" in err[0]
    assert "lower --learning_rate" in err[0]
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")
    assert saved["iter"] == 0 and all(torch.isfinite(t).all() for t in saved["model"].values())


def test_scratch_run_refuses_to_replace_an_existing_checkpoint(data_dir, tmp_path, capsys):
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=2"]
    assert train.main(args) == 0
    before = (tmp_path / "ckpt.pt").read_bytes()
    capsys.readouterr()
    assert train.main(args) == 2
    assert "--init_from=resume" in capsys.readouterr().err
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    assert train.main(args + ["--overwrite=true"]) == 0


def test_resume_against_data_with_another_tokenizer_says_so(data_dir, tmp_path, capsys):
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2"]) == 0
    (tmp_path / "other.txt").write_text("".join(f"LINE {i}: A DIFFERENT ALPHABET!\n" for i in range(800)))
    assert prepare.main(["--input", str(tmp_path / "other.txt"), "--out_dir", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    code = train.main([TINY, f"--data_dir={tmp_path / 'other'}", f"--out_dir={tmp_path / 'out'}",
                       "--max_iters=4", "--init_from=resume"])
    assert code == 2
    err = capsys.readouterr().err
    assert "the data set changed" in err


class RunsCode:
    """Unpickling this calls os.system: a checkpoint-shaped file that runs code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_checkpoint_that_would_run_code_is_refused_and_never_runs(data_dir, tmp_path, capsys):
    marker = tmp_path / "code_ran"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    evil = {"format": 1, "model": {}, "model_config": {}, "payload": RunsCode(marker)}
    with open(out_dir / "ckpt.pt", "wb") as f:  # a bare pickle: no checkpoint train.py writes, and refused as one
        pickle.dump(evil, f)
    with pytest.raises(train.UserError, match="is not a checkpoint"):
        files.load_checkpoint(out_dir / "ckpt.pt")
    code = train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--init_from=resume"])
    assert code == 2 and "is not a checkpoint" in capsys.readouterr().err
    assert sample.main([f"--out_dir={out_dir}", "--max_new_tokens=3"]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
    torch.save(evil, out_dir / "ckpt.pt")  # the same, in torch's own zip format
    with pytest.raises(train.UserError, match="could run code"):
        files.load_checkpoint(out_dir / "ckpt.pt")
    assert not marker.exists()
