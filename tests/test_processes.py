"""Two processes training together (gloo, as torchrun starts them) stop together: a signal to one or to
both, a non-finite loss on one, a full disk under rank 0's checkpoint, a bad checkpoint or a locked
out_dir at the start. Every time both exit with the same code, without a traceback, one `error:` line
between them where there is one, and never wait forever (each run is bounded by a timeout that fails it)."""

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tinygpt import files

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")
STEPS = 120
# One process of two: train.main with an injected fault (INJECT), its exit code written beside the run.
WORKER = textwrap.dedent("""
    import errno, math, os, signal, sys
    sys.path.insert(0, os.getcwd())
    import torch, train
    rank, inject = int(os.environ["RANK"]), os.environ.get("INJECT", "")
    if inject == "nan" and rank == 1:  # a loss gone non-finite on one process only, at its 4th step
        real_step, calls = train.train_step, []
        def train_step(*args, **kwargs):
            loss, x, y = real_step(*args, **kwargs)
            calls.append(1)
            return (math.nan if len(calls) == 4 else loss), x, y
        train.train_step = train_step
    if inject == "enospc" and rank == 0:  # the disk fills under rank 0's ckpt.pt at the second evaluation
        real_save, saves = torch.save, []
        def save(obj, f, *args, **kwargs):
            saves.append(1)
            if len(saves) == 3:  # ckpt.pt and best.pt at step 0, then ckpt.pt at step 25
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(obj, f, *args, **kwargs)
        torch.save = save
    if inject.startswith("term:") and rank == 1:  # a SIGTERM to rank 1 alone as set-up reaches inject's function
        where, name = (train.system.Processes, "wrap") if inject == "term:wrap" else (train, inject[5:])
        real = getattr(where, name)
        def signalled(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*args, **kwargs)
        setattr(where, name, signalled)
    raise SystemExit(train.main())  # as `python train.py` ends: its argv, sys.argv[1:]
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tmp_path, out_dir, *args, inject=""):
    """Two workers of one run, each writing its output to out_dir.parent/NAME.RANK.txt."""
    port, procs = free_port(), []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "INJECT": inject}
        log = open(tmp_path / f"{Path(out_dir).name}.{rank}.txt", "w", encoding="utf-8")  # noqa: SIM115
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, *args, f"--out_dir={out_dir}"], cwd=ROOT,
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def finish(tmp_path, out_dir, procs, timeout=120):
    """Each worker's (exit code, output), once both have ended: a hang fails the test."""
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(code, (tmp_path / f"{Path(out_dir).name}.{rank}.txt").read_text(encoding="utf-8"))
            for rank, code in enumerate(codes)]


def run(tmp_path, out_dir, *args, inject=""):
    return finish(tmp_path, out_dir, start(tmp_path, out_dir, *args, inject=inject))


def steps_logged(out_dir):
    try:
        return (Path(out_dir) / "log.jsonl").read_text(encoding="utf-8").count('"loss"')
    except FileNotFoundError:
        return 0


def args_for(data_dir, *extra):
    return [TINY, f"--data_dir={data_dir}", f"--max_iters={STEPS}", "--eval_interval=25", "--log_interval=1",
            "--patience=0", *extra]


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """The weights of a run that nothing stopped."""
    tmp = tmp_path_factory.mktemp("whole")
    results = run(tmp, tmp / "whole", *args_for(data_dir))
    assert [code for code, _ in results] == [0, 0], results
    return files.load_checkpoint(tmp / "whole" / "ckpt.pt")["model"]


@pytest.mark.parametrize("trial", range(3))  # 6 stops, at steps 15 to 38: before and after an evaluation
@pytest.mark.parametrize("who", ["rank 1", "both"])
def test_a_signal_to_one_process_or_both_stops_both_at_one_step(data_dir, tmp_path, uninterrupted, who, trial):
    out = tmp_path / "run"
    procs = start(tmp_path, out, *args_for(data_dir))
    at = random.Random(f"{who}{trial}").randrange(5, STEPS - 80)  # a step to stop near, different each trial
    deadline = time.monotonic() + 120
    while steps_logged(out) < at and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.005)
    for p in procs if who == "both" else procs[1:]:
        p.send_signal(signal.SIGTERM)
    results = finish(tmp_path, out, procs)
    assert [code for code, _ in results] == [128 + signal.SIGTERM] * 2, results
    assert not any("Traceback" in output for _, output in results), results
    said = [line for line in results[0][1].splitlines() if line.startswith("stopped by SIGTERM")]
    stopped_at = files.load_checkpoint(out / "ckpt.pt")["iter"]
    assert said == [f"stopped by SIGTERM at iteration {stopped_at}; saved {out / 'ckpt.pt'} "
                    "(continue with --init_from=resume)"]
    assert steps_logged(out) == stopped_at  # rank 0 logged every step it took, and the other took as many
    resumed = run(tmp_path, out, *args_for(data_dir, "--init_from=resume"))
    assert [code for code, _ in resumed] == [0, 0], resumed
    final = files.load_checkpoint(out / "ckpt.pt")["model"]
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)


def start_nodes(tmp_path, out_dir, *args):
    """Two torchrun launchers, as two machines of one process each would run them: a c10d rendezvous
    (here on this machine), gloo. Each writes its output to out_dir.parent/NAME.NODE.txt."""
    port, procs = free_port(), []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=nodes",
               str(ROOT / "train.py"), *args, f"--out_dir={out_dir}"]
        log = open(tmp_path / f"{Path(out_dir).name}.{node}.txt", "w", encoding="utf-8")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def test_two_nodes_stop_on_a_signal_to_one_launcher_and_resume_to_the_same_weights(data_dir, tmp_path,
                                                                                  uninterrupted):
    out = tmp_path / "nodes"
    procs = start_nodes(tmp_path, out, *args_for(data_dir))
    deadline = time.monotonic() + 120
    while steps_logged(out) < 30 and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.005)
    procs[1].send_signal(signal.SIGTERM)  # one machine's launcher, as a scheduler ending that machine's job would
    results = finish(tmp_path, out, procs)
    stopped_at = files.load_checkpoint(out / "ckpt.pt")["iter"]
    said = [line for _, output in results for line in output.splitlines() if line.startswith("stopped by SIGTERM")]
    assert said == [f"stopped by SIGTERM at iteration {stopped_at}; saved {out / 'ckpt.pt'} "
                    "(continue with --init_from=resume)"], results
    assert 30 <= stopped_at < STEPS and steps_logged(out) == stopped_at
    # torchrun's own report of it: exit 1, the other launcher's ChildFailedError block naming exit code 143
    assert [code for code, _ in results] == [1, 1] and any("exitcode  : 143" in output for _, output in results)
    resumed = finish(tmp_path, out, start_nodes(tmp_path, out, *args_for(data_dir, "--init_from=resume")))
    assert [code for code, _ in resumed] == [0, 0], resumed
    final = files.load_checkpoint(out / "ckpt.pt")["model"]
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)


def one_error_line(results):
    """The single error line of both processes' output (both exited 2, neither with a traceback)."""
    assert [code for code, _ in results] == [2, 2], results
    assert not any("Traceback" in output for _, output in results), results
    lines = [line for _, output in results for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, results
    return lines[0]


def test_a_non_finite_loss_on_one_process_stops_both(data_dir, tmp_path):
    line = one_error_line(run(tmp_path, tmp_path / "run", *args_for(data_dir), inject="nan"))
    assert "not finite on another process by iteration 10" in line  # the processes agree every 10 steps


def test_a_full_disk_under_rank_0s_checkpoint_stops_both(data_dir, tmp_path):
    line = one_error_line(run(tmp_path, tmp_path / "run", *args_for(data_dir), inject="enospc"))
    assert "no space left on device" in line and "the previous checkpoint is kept" in line
    assert files.load_checkpoint(tmp_path / "run" / "ckpt.pt")["iter"] == 0  # the first, whole


def test_a_corrupt_checkpoint_at_resume_stops_both_with_one_line(data_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(b"PK\x03\x04 not the rest of a checkpoint")
    line = one_error_line(run(tmp_path, tmp_path / "run", *args_for(data_dir, "--init_from=resume")))
    assert "is truncated or damaged" in line


def test_a_locked_out_dir_stops_both_with_one_line(data_dir, tmp_path):
    holder = files.RunLock(tmp_path / "run")
    holder.acquire()  # another run, this test's process, writes there
    try:
        line = one_error_line(run(tmp_path, tmp_path / "run", *args_for(data_dir)))
    finally:
        holder.release()
    assert "is in use by another run" in line


@pytest.mark.parametrize("where", ["term:build", "term:measure", "term:wrap"])
def test_a_signal_to_one_process_while_starting_stops_both_with_one_line(data_dir, tmp_path, where):
    sized = ["--max_time=10m", "--dropout=auto"]  # the sizing times a model: where start-up spends its time
    results = run(tmp_path, tmp_path / "run", *args_for(data_dir, *sized), inject=where)
    assert results[1] == (143, "")  # rank 1, signalled: under torchrun rank 0 alone speaks
    code, out = results[0]
    assert code == 2 and "Traceback" not in out, out
    assert out.splitlines()[-1].startswith("error: lost another process of this run ("), out
    assert "by peer" in out.splitlines()[-1], out  # gloo: connection closed, or reset, by peer
