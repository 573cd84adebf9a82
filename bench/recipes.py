"""The recipe ablation: val loss and time to a target loss, classic against fast.

    python bench/recipes.py --jobs=3 --threads=1              # the ablation: losses, 2000 iterations each
    python bench/recipes.py --runs=classic --runs=fast --iters=0 --seeds=1337   # the timing, on an idle CPU
    python bench/recipes.py --runs="lr3e-3=config/shakespeare_char_cpu.toml --learning_rate=3e-3"
    python bench/recipes.py --report_only=true                # reprint the table from the logs

Each run is `python train.py PRESET --key=value ...` in its own process, with the
whole val split evaluated every eval_interval steps (eval_iters=0, so the losses
are exact, not estimates), and the schedule stretched over --iters (0: each
preset's own). Seconds to the target are the sum of the logged per-step times
(forward, backward, optimizer step, next batch) up to the first evaluation at
or below the target: evaluation and checkpoint time is left out, as it would be
the same for any recipe. Losses do not depend on how busy the CPU is;
milliseconds do, so time the classic and fast runs one after the other on an
otherwise idle machine, one run at a time with torch's default threads.
"""

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's modules

from config import UserError, load_config, option
from tinygpt import system  # noqa: E402

CPU = "config/shakespeare_char_cpu.toml"
NANOGPT = [CPU, "--learning_rate=1e-3"]  # the classic preset with nanoGPT's learning rate
VARIANTS = {  # nanoGPT's recipe, each change alone, then together
    "nanogpt": NANOGPT,
    "classic": [CPU],  # the learning rate alone, 4e-3
    "batch24": [*NANOGPT, "--batch_size=24"],
    "rope": [*NANOGPT, "--pos=rope"],
    "muon": [*NANOGPT, "--optimizer=muon"],
    "muon_rope": [*NANOGPT, "--optimizer=muon", "--pos=rope"],
    "fast": ["config/shakespeare_char_cpu_fast.toml"],
}
CHECKPOINTS = (500, 1000, 2000)  # iterations whose val loss the table shows


@dataclass
class BenchConfig:
    runs: list[str] = option(list(VARIANTS), "what to run: a name from VARIANTS, or 'NAME=PRESET --key=value ...'")
    seeds: list[str] = option(["1337", "1"], "random seeds; every run once per seed")
    iters: int = option(2000, "training steps per run, the learning-rate schedule ending there (0: the preset's)")
    eval_interval: int = option(50, "evaluate every this many steps: the resolution of the time to target")
    target: float = option(1.886, "val loss to reach (nanoGPT's CPU config after 2000 iterations)")
    out_dir: str = option("out/bench_recipe", "where the runs' logs go, one directory per run and seed")
    jobs: int = option(1, "runs at once (more than 1 only for losses: they share the CPU)")
    threads: int = option(0, "torch threads per run (0: torch's default)")
    report_only: bool = option(False, "print the table from the logs in out_dir, training nothing")


def parse_run(spec):
    """'name' or 'name=PRESET --key=value ...' -> (name, train.py arguments)."""
    name, has_args, args = spec.partition("=")
    if has_args:
        return name.strip(), args.split()
    if name not in VARIANTS:
        raise UserError(f"unknown run {name!r}: pick one of {', '.join(VARIANTS)} or write NAME=PRESET --key=value")
    return name, VARIANTS[name]


def train(args, run_dir, cfg):
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    schedule = [f"--max_iters={cfg.iters}"] if cfg.iters else []  # the schedule decays over max_iters
    cmd = [sys.executable, "train.py", *args, *schedule, "--eval_iters=0", f"--eval_interval={cfg.eval_interval}",
           "--log_interval=1", f"--out_dir={run_dir}"]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(cfg.threads)} if cfg.threads else {})}
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n", encoding="utf-8")
    with open(run_dir / "stdout.txt", "w", encoding="utf-8") as out:
        code = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise UserError(f"{' '.join(cmd)} failed (exit {code}); see {run_dir / 'stdout.txt'}")


def summarize(run_dir, target):
    """The table's numbers for one run, from its log.jsonl."""
    records = [json.loads(line) for line in open(run_dir / "log.jsonl", encoding="utf-8")]
    val = {r["iter"]: r["val_loss"] for r in records if "val_loss" in r}
    step_ms = {r["iter"]: r["ms_per_iter"] for r in records if "ms_per_iter" in r}
    reached = next((it for it in sorted(val) if val[it] <= target), None)
    tokens = re.search(r"([\d,]+) tokens per step", (run_dir / "stdout.txt").read_text(encoding="utf-8"))
    return {
        "val": val,
        "tokens": int(tokens.group(1).replace(",", "")) if tokens else None,
        "ms": statistics.median(step_ms.values()),
        "reached": reached,
        "seconds": None if reached is None else sum(ms for it, ms in step_ms.items() if it <= reached) / 1000,
        "total_seconds": sum(step_ms.values()) / 1000,
        "iters": max(step_ms),
    }


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(rows, cfg):
    checkpoints = [c for c in CHECKPOINTS if c < cfg.iters] + [cfg.iters] if cfg.iters else CHECKPOINTS
    print(f"| run | seed | tokens/iter | {' | '.join(f'val@{c}' for c in checkpoints)} | ms/iter "
          f"| iters to {cfg.target} | s to {cfg.target} |")
    print("|" + "---|" * (len(checkpoints) + 6))
    for name, seed, s in rows:
        vals = " | ".join(fmt(s["val"].get(c), ".4f") for c in checkpoints)
        print(f"| {name} | {seed} | {fmt(s['tokens'], 'd')} | {vals} | {s['ms']:.1f} | {fmt(s['reached'], 'd')} "
              f"| {fmt(s['seconds'], '.1f')} |")


@system.cli
def main(argv):
    cfg = load_config(BenchConfig, argv, "bench/recipes.py", __doc__)
    runs = [parse_run(spec) for spec in cfg.runs]
    try:
        seeds = [int(s) for s in cfg.seeds]
    except ValueError:
        raise UserError(f"seeds must be integers, got {cfg.seeds}") from None
    jobs = [(name, args + [f"--seed={seed}"], seed, Path(cfg.out_dir) / name / f"seed{seed}")
            for name, args in runs for seed in seeds]
    if not cfg.report_only:
        with ThreadPoolExecutor(max_workers=max(1, cfg.jobs)) as pool:
            for future in [pool.submit(train, args, run_dir, cfg) for _, args, _, run_dir in jobs]:
                future.result()
    rows = []
    for name, _, seed, run_dir in jobs:
        if not (run_dir / "log.jsonl").is_file():
            raise UserError(f"no log in {run_dir}: run without --report_only first")
        rows.append((name, seed, summarize(run_dir, cfg.target)))
    print_table(rows, cfg)
    print_ratio(rows, cfg.target)
    return 0


def print_ratio(rows, target):
    """Fast's seconds to the target over classic's. A classic run that never gets
    there is charged its whole run, a lower bound, so the ratio errs against fast."""
    runs = {name: [s for n, _, s in rows if n == name] for name in ("classic", "fast")}
    if not runs["classic"] or not runs["fast"] or any(s["seconds"] is None for s in runs["fast"]):
        return
    classic = statistics.mean(s["total_seconds"] if s["seconds"] is None else s["seconds"] for s in runs["classic"])
    fast = statistics.mean(s["seconds"] for s in runs["fast"])
    missed = [s for s in runs["classic"] if s["seconds"] is None]
    note = (f" (classic did not reach it in {missed[0]['iters']} iterations: charged all of them)" if missed else "")
    print(f"\nseconds to val <= {target}: classic {classic:.1f}{note}, fast {fast:.1f}: "
          f"fast takes {fast / classic:.0%} of classic's time ({classic / fast:.2f}x faster)")


if __name__ == "__main__":
    sys.exit(main())
