"""The "nothing lost" claims, run at full size and printed, for a reviewer to watch
(the test suite runs small versions of each; this is not part of it).

    python tests/demo_robustness.py kills --n=20        # kill -9 a 50 MB prepare.py at 20 random moments
    python tests/demo_robustness.py two_runs --n=10     # two train.py into one out_dir at once, 10 times
    python tests/demo_robustness.py disk_full           # a checkpoint write on a full tmpfs (needs root)

Each prints what it saw, one line per trial, and exits 1 if any trial went wrong.
"""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's modules

from config import UserError, load_config, option  # noqa: E402
from tinygpt import files  # noqa: E402
from tinygpt.system import cli  # noqa: E402
from tinygpt.tokenizer import tokenizer_from_meta  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
TINY = str(ROOT / "config" / "tiny.toml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@dataclass
class DemoConfig:
    n: int = option(0, "trials (0: 20 kills, 10 pairs of runs)", low=0)
    megabytes: int = option(50, "size of the text prepare.py is killed in", low=1)
    work: str = option("", "where to work (empty: a new temporary directory, removed at the end)")
    seed: int = option(0, "random seed for the kill moments", low=0)


def script(name, *args, **kwargs):
    return subprocess.Popen([sys.executable, str(ROOT / name), *map(str, args)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def text_of(megabytes):
    base = SHAKESPEARE.read_text() if SHAKESPEARE.is_file() else "".join(f"line {i} of a text.\n" for i in range(5000))
    return base * (megabytes * 1_000_000 // len(base) + 1)


def which_data_set(out, texts):
    """'old' or 'new' if out holds that data set, complete (meta.json, bins, ids); else why not."""
    try:
        meta, splits = files.load_data(out)
    except UserError as e:
        return f"INCOMPLETE ({e})"
    name = texts.get(meta["sha256"])
    head = tokenizer_from_meta(meta).decode(splits["train"][:100].tolist())
    return name if name and head == texts[name + "_head"] else "UNKNOWN"


def stray_files(data):
    """What is in data/ besides the data sets: a killed run's staging directory, say."""
    return sorted(p.name for p in data.iterdir() if p.name.startswith(".")) + [
        str(p.relative_to(data)) for p in data.rglob("*.tmp")]


def kills(cfg, work):
    old, new = "".join(f"the old text, line {i}\n" for i in range(20000)), text_of(cfg.megabytes)
    texts = {}
    for name, text in (("old", old), ("new", new)):
        (work / f"{name}.txt").write_text(text)
        texts[hashlib.sha256(text.encode()).hexdigest()] = name
        texts[name + "_head"] = text[:100]
    out = work / "data" / "set"
    script("prepare.py", "--input", work / "old.txt", "--out_dir", out).communicate()
    t0 = time.perf_counter()
    script("prepare.py", "--input", work / "new.txt", "--out_dir", work / "data" / "whole").communicate()
    duration = time.perf_counter() - t0
    print(f"a whole prepare.py of {len(new) / 1e6:.0f} MB runs {duration:.1f} s here; killing it at random moments")
    rng, failures, n = random.Random(cfg.seed), 0, 0
    while n < (cfg.n or 20):
        proc = script("prepare.py", "--input", work / "new.txt", "--out_dir", out)
        moment = rng.uniform(0, duration)
        time.sleep(moment)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        found = which_data_set(out, texts)
        failures += found not in ("old", "new")
        if proc.returncode != -signal.SIGKILL:  # it finished first: not a kill, draw another moment
            print(f"        at {moment:4.1f} s it had finished: the {found} data set")
            continue
        n += 1
        print(f"kill {n:2d} at {moment:4.1f} s: data/set holds the {found} data set; "
              f"left for the next run to clean: {stray_files(out.parent) or 'nothing'}")
    proc = script("prepare.py", "--input", work / "new.txt", "--out_dir", out)
    proc.communicate()
    stray = stray_files(out.parent)
    failures += bool(stray) + (which_data_set(out, texts) != "new")
    print(f"rerun (exit {proc.returncode}): the {which_data_set(out, texts)} data set; "
          f"temporary files left: {stray or 'none'}")
    return failures


def losses(out):
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [(r["iter"], k, r[k]) for r in records for k in ("loss", "val_loss") if k in r]


def two_runs(cfg, work):
    import torch

    data = work / "data"
    (work / "input.txt").write_text(text_of(1))
    script("prepare.py", "--input", work / "input.txt", "--out_dir", data).communicate()
    run = [TINY, f"--data_dir={data}", "--max_iters=200", "--eval_interval=50"]
    script("train.py", *run, f"--out_dir={work / 'lone'}").communicate()
    lone = torch.load(work / "lone" / "ckpt.pt", weights_only=True)["model"]
    failures = 0
    for n in range(1, (cfg.n or 10) + 1):
        out = work / f"pair{n}"
        procs = [script("train.py", *run, f"--out_dir={out}") for _ in range(2)]
        results = [(p.communicate()[1], p.returncode) for p in procs]
        codes = sorted(code for _, code in results)
        loser = next((err.strip() for err, code in results if code == 2), "")
        same_log = losses(out) == losses(work / "lone")
        weights = torch.load(out / "ckpt.pt", weights_only=True)["model"]
        same_ckpt = all(torch.equal(weights[k], lone[k]) for k in lone)
        failures += codes != [0, 2] or not same_log or not same_ckpt
        print(f"pair {n:2d}: exit codes {codes}; the survivor's log and checkpoint match a lone run: "
              f"{same_log and same_ckpt}; the other said: {loser}")
    return failures


def disk_full(cfg, work):
    if os.geteuid() != 0:
        raise UserError("disk_full mounts a small tmpfs, which needs root; run it as root, or see the tests' "
                        "injected ENOSPC (tests/test_robustness.py)")
    data, mount = work / "data", work / "small_disk"
    (work / "input.txt").write_text(text_of(1))
    script("prepare.py", "--input", work / "input.txt", "--out_dir", data).communicate()
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    try:
        out = mount / "out"
        run = [TINY, f"--data_dir={data}", f"--out_dir={out}", "--max_iters=30", "--eval_interval=10",
               "--log_interval=1"]
        print("train to iteration 10:", script("train.py", *run, "--max_iters=10").communicate()[0].splitlines()[-1])
        before = hashlib.sha256((out / "ckpt.pt").read_bytes()).hexdigest()
        free = shutil.disk_usage(mount).free
        (mount / "filler").write_bytes(b"\0" * (free - 24 * 1024))  # leaves room for log lines, not a checkpoint
        print(f"filled the 2 MB disk: {shutil.disk_usage(mount).free // 1024} KB free")
        proc = script("train.py", *run, "--init_from=resume")
        _, err = proc.communicate()
        kept = hashlib.sha256((out / "ckpt.pt").read_bytes()).hexdigest() == before
        print(f"resume to 30: exit {proc.returncode}; stderr: {err.strip()}")
        print(f"ckpt.pt unchanged: {kept}; files in out_dir: {sorted(p.name for p in out.iterdir())}")
        (mount / "filler").unlink()
        proc = script("train.py", *run, "--init_from=resume")
        last = proc.communicate()[0].strip().splitlines()[-1]
        print(f"space freed, resume again: exit {proc.returncode}: {last}")
        return (proc.returncode != 0) + (not kept) + ("no space left on device" not in err)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@cli
def main(argv):
    if not argv or argv[0] not in ("kills", "two_runs", "disk_full"):
        raise UserError("say what to show: kills, two_runs or disk_full (python tests/demo_robustness.py --help)")
    cfg = load_config(DemoConfig, argv[1:], "tests/demo_robustness.py " + argv[0], __doc__)
    work = Path(cfg.work or tempfile.mkdtemp(prefix="tinygpt-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        failures = {"kills": kills, "two_runs": two_runs, "disk_full": disk_full}[argv[0]](cfg, work)
    finally:
        if not cfg.work:
            shutil.rmtree(work, ignore_errors=True)
    print("all as claimed" if not failures else f"{failures} trial(s) went wrong")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
