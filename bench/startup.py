"""Set-up: the seconds from a train.py process's start to its first step, median of several runs.

    python bench/startup.py --max_time=1m                  # Tiny Shakespeare, no preset, five runs
    python bench/startup.py --max_time=20s --args="--data_dir=data/notes_char"

Each run is `python train.py --max_time=... ARGS` in its own process, into a directory of its own, stopped
once it says its first step is next (the line with its parameters, which ends the set-up: imports, the
data, and the sizing, which times a few real steps of the models it considers). Nothing carries over from
one run to the next. Time it on an otherwise idle machine.
"""

import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's modules

from config import UserError, load_config, option  # noqa: E402
from tinygpt import system  # noqa: E402


@dataclass
class BenchConfig:
    max_time: str = option("1m", "the time budget of every run")
    runs: int = option(5, "how many runs", low=1)
    args: str = option("", "more train.py arguments, as one string")


def set_up_seconds(args):
    """(seconds from the start to the first step, the lines said by then) of one train.py run."""
    with tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "train.py", *args, f"--out_dir={work}/out"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))
            if " params, " in line or line.startswith("error:"):
                break
        proc.kill()
        proc.wait()
    if not lines or " params, " not in lines[-1][1]:
        raise UserError(f"train.py {' '.join(args)} did not reach its first step: {lines[-1][1] if lines else ''}")
    return lines[-1][0], lines


@system.cli
def main(argv):
    cfg = load_config(BenchConfig, argv, "bench/startup.py", __doc__.strip().splitlines()[0])
    args = [f"--max_time={cfg.max_time}", *shlex.split(cfg.args)]
    seconds = []
    for i in range(cfg.runs):
        took, lines = set_up_seconds(args)
        seconds.append(took)
        chosen = next((text.split(" (sized")[0] for _, text in lines if text.startswith("auto: ")), "a preset")
        print(f"run {i + 1}: {took:.2f} s to the first step; {chosen}", flush=True)
    print(f"median {statistics.median(seconds):.2f} s (min {min(seconds):.2f}, max {max(seconds):.2f}) of "
          f"{cfg.runs} runs, python train.py {' '.join(args)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
