"""Side by side with nanoGPT on one machine: training and sampling, the same config and data.

    python bench/nanogpt.py --nanogpt=../shared/peers/nanoGPT --input=../shared/data/tinyshakespeare/input.txt
    python bench/nanogpt.py --nanogpt=... --input=... --repeats=3 --runs=nanogpt --runs=classic --runs=fast

nanoGPT is copied into --work (it writes into its own folders) and prepares its own
data from --input; this repository prepares the same text. Then each run is a whole
process, the runs take turns (nanoGPT, then ours, and again for --repeats), and for
each the table gives: median ms per training step, wall time of the whole process,
its peak memory (RSS), the val loss at the same steps, and the seconds from the
process's start to the first evaluation at or below --target (nanoGPT's val loss
after its 2000 steps). Then sampling from the same model shape (4 layers, 128 wide,
block 64): tokens per second in-process (the same random weights' shape in both
models, 500 new tokens, temperature 0.8, top-k 200), and whole-process seconds of
each sample.py on its trained checkpoint. Time it on an otherwise idle machine.
"""

import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's modules

from config import UserError, cli, load_config, option  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tokenizer import cpu_count  # noqa: E402

# nanoGPT's CPU configuration, as its README gives it.
NANOGPT_CPU = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
               "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
               "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
OURS = {  # name: train.py arguments; every run evaluates like nanoGPT's: 20 batches every 250 steps
    "classic": ["config/shakespeare_char_cpu.toml"],
    "classic_lr1e-3": ["config/shakespeare_char_cpu.toml", "--learning_rate=1e-3"],
    "fast": ["config/shakespeare_char_cpu_fast.toml"],
}
EVAL = ["--eval_iters=20", "--eval_interval=250", "--log_interval=1"]
SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "vocab_size": 65}


@dataclass
class BenchConfig:
    nanogpt: str = option("../shared/peers/nanoGPT", "an unmodified nanoGPT checkout")
    input: str = option("../shared/data/tinyshakespeare/input.txt", "Tiny Shakespeare")
    runs: list[str] = option(["nanogpt", *OURS], "which training runs: nanogpt, or one of ours: "
                             + ", ".join(OURS) + ", or NAME=PRESET --key=value ...")
    repeats: int = option(1, "how many times each run is made, in turn")
    target: float = option(1.886, "the val loss whose time to reach is reported")
    sample_tokens: int = option(500, "new tokens per sample")
    work: str = option("out/bench_nanogpt", "where nanoGPT's copy, the data and the runs go")
    iters: int = option(0, "steps of every run, for a quick check (0: each run's own, nanoGPT's 2000)")


def run_process(command, cwd, log_path):
    """Runs a command, stamping each line of its output with the seconds since it started.
    Returns (wall seconds, peak RSS in MiB, [(seconds, line)])."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # lines arrive when printed, so their times are true
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.perf_counter() - t0, line.rstrip("\n")) for line in proc.stdout]
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak memory
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    Path(log_path).write_text("".join(f"{t:9.3f} {line}\n" for t, line in lines))
    if proc.returncode != 0:
        raise UserError(f"{' '.join(map(str, command))} failed (exit {proc.returncode}); see {log_path}")
    return wall, usage.ru_maxrss / 1024, lines


def setup(cfg, work):
    """nanoGPT's copy with its data prepared, and ours."""
    nano = work / "nanoGPT"
    if not (Path(cfg.nanogpt) / "train.py").is_file():
        raise UserError(f"--nanogpt {cfg.nanogpt}: no nanoGPT checkout there (train.py missing)")
    if not Path(cfg.input).is_file():
        raise UserError(f"--input {cfg.input} not found")
    if not (nano / "data/shakespeare_char/meta.pkl").is_file():
        shutil.rmtree(nano, ignore_errors=True)
        shutil.copytree(cfg.nanogpt, nano, ignore=shutil.ignore_patterns("out*", ".git"))
        shutil.copy(cfg.input, nano / "data/shakespeare_char/input.txt")
        subprocess.run([sys.executable, "prepare.py"], cwd=nano / "data/shakespeare_char", check=True,
                       stdout=subprocess.DEVNULL)
    ours = work / "data/shakespeare_char"
    if not (ours / "meta.json").is_file():
        subprocess.run([sys.executable, "prepare.py", "--input", cfg.input, "--out_dir", ours], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
    return nano, ours


def train_nanogpt(nano, run_dir, steps):
    out = run_dir / "out"
    wall, rss, lines = run_process([sys.executable, "train.py", *NANOGPT_CPU, *steps, f"--out_dir={out}"], nano,
                                   run_dir / "stdout.txt")
    step_ms = [float(m.group(1)) for _, line in lines if (m := re.match(r"iter \d+: .* time ([\d.]+)ms", line))]
    evals = [(int(m.group(1)), float(m.group(2)), t) for t, line in lines
             if (m := re.match(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", line))]
    return wall, rss, step_ms, evals


def train_ours(args, data_dir, run_dir, steps):
    command = [sys.executable, "train.py", *args, f"--data_dir={data_dir}", f"--out_dir={run_dir / 'out'}",
               *EVAL, *steps, "--overwrite=true"]
    wall, rss, lines = run_process(command, ROOT, run_dir / "stdout.txt")
    records = [json.loads(line) for line in open(run_dir / "out/log.jsonl")]
    step_ms = [r["ms_per_iter"] for r in records if "ms_per_iter" in r]
    times = [t for t, line in lines if re.match(r"step \d+: train", line)]  # when each evaluation was printed
    evals = [(r["iter"], r["val_loss"], t) for r, t in zip([r for r in records if "val_loss" in r], times)]
    return wall, rss, step_ms, evals


def training(cfg, work, nano, data_dir):
    steps = [f"--max_iters={cfg.iters}", f"--lr_decay_iters={cfg.iters}"] if cfg.iters else []
    results = {}
    for repeat in range(cfg.repeats):
        for spec in cfg.runs:
            name, _, args = spec.partition("=")
            run_dir = work / "runs" / name / str(repeat)
            run_dir.mkdir(parents=True, exist_ok=True)
            print(f"[{repeat + 1}/{cfg.repeats}] {name}", flush=True)
            if name == "nanogpt":
                result = train_nanogpt(nano, run_dir, steps)
            elif args or name in OURS:
                result = train_ours(args.split() if args else OURS[name], data_dir, run_dir, steps)
            else:
                raise UserError(f"unknown run {name!r}: nanogpt, {', '.join(OURS)}, or NAME=PRESET --key=value")
            results.setdefault(name, []).append(result)
    return results


def print_training(results, target):
    steps = sorted({it for runs in results.values() for run in runs for it, _, _ in run[3]})
    shown = [s for s in steps if s % 500 == 0 or s == steps[-1]]
    print(f"\n| run | median ms/iter | wall s | peak MiB | {' | '.join(f'val@{s}' for s in shown)} | s to {target} |")
    print("|---|---:|---:|---:|" + "---:|" * len(shown) + "---:|")
    for name, runs in results.items():
        for wall, rss, step_ms, evals in runs:
            val = {it: v for it, v, _ in evals}
            reached = next((t for _, v, t in evals if v <= target), None)
            cells = [f"{statistics.median(step_ms):.1f}", f"{wall:.1f}", f"{rss:.0f}",
                     *(f"{val[s]:.4f}" if s in val else "-" for s in shown), "-" if reached is None else f"{reached:.1f}"]
            print(f"| {name} | " + " | ".join(cells) + " |")
    if "nanogpt" in results:
        base = statistics.median(statistics.median(r[2]) for r in results["nanogpt"])
        base_wall = statistics.median(r[0] for r in results["nanogpt"])
        for name, runs in results.items():
            if name != "nanogpt":
                ms = statistics.median(statistics.median(r[2]) for r in runs)
                wall = statistics.median(r[0] for r in runs)
                print(f"{name}: {ms / base:.2f}x nanoGPT's median step time, {wall / base_wall:.2f}x its wall time")


def load_nanogpt_model(nano):
    spec = importlib.util.spec_from_file_location("nanogpt_model", nano / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tokens_per_second(generate, repeats=5):
    """Median tokens/s of generate() -> number of tokens, after a warm-up call."""
    generate()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = generate()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


@torch.no_grad()
def sampling_in_process(nano, new_tokens):
    nanogpt = load_nanogpt_model(nano)
    torch.manual_seed(0)
    theirs = nanogpt.GPT(nanogpt.GPTConfig(**SHAPE, bias=False, dropout=0.0)).eval()
    ours = GPT(GPTConfig(**SHAPE, bias=False)).eval()
    start = torch.zeros(1, 1, dtype=torch.long)
    rate_theirs = tokens_per_second(lambda: theirs.generate(start, new_tokens, temperature=0.8, top_k=200).size(1) - 1)
    rate_ours = tokens_per_second(lambda: ours.generate(start, new_tokens, temperature=0.8, top_k=200).size(1) - 1)
    rate_nocache = tokens_per_second(
        lambda: ours.generate(start, new_tokens, temperature=0.8, top_k=200, use_cache=False).size(1) - 1)
    return rate_theirs, rate_ours, rate_nocache


def sampling_whole_process(nano, work, new_tokens, repeats=5):
    nano_ckpt = work / "runs/nanogpt/0/out"
    ours_ckpt = work / "runs/classic/0/out"
    commands = {
        "nanogpt": ([sys.executable, "sample.py", f"--out_dir={nano_ckpt}", "--device=cpu", "--compile=False",
                     "--num_samples=1", f"--max_new_tokens={new_tokens}"], nano),
        "ours": ([sys.executable, "sample.py", f"--out_dir={ours_ckpt}", "--num_samples=1",
                  f"--max_new_tokens={new_tokens}"], ROOT),
    }
    if not (nano_ckpt / "ckpt.pt").is_file() or not (ours_ckpt / "ckpt.pt").is_file():
        return None
    walls = {name: [] for name in commands}
    for i in range(repeats):
        for name, (command, cwd) in commands.items():
            walls[name].append(run_process(command, cwd, work / f"sample_{name}_{i}.txt")[0])
    return {name: statistics.median(w) for name, w in walls.items()}


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads"


@cli
def main(argv):
    cfg = load_config(BenchConfig, argv, "bench/nanogpt.py", __doc__.strip().splitlines()[0])
    work = Path(cfg.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    nano, data_dir = setup(cfg, work)
    print(f"machine: {machine()}")
    results = training(cfg, work, nano, data_dir)
    print_training(results, cfg.target)
    theirs, ours, nocache = sampling_in_process(nano, cfg.sample_tokens)
    print(f"\nsampling {cfg.sample_tokens} tokens in-process, {SHAPE}: nanoGPT {theirs:,.0f} tokens/s, "
          f"ours {ours:,.0f} tokens/s ({ours / theirs:.1f}x); ours without the KV cache {nocache:,.0f} tokens/s")
    walls = sampling_whole_process(nano, work, cfg.sample_tokens)
    if walls:
        print(f"sampling {cfg.sample_tokens} tokens, whole process (median of 5): nanoGPT {walls['nanogpt']:.2f} s, "
              f"ours {walls['ours']:.2f} s ({walls['nanogpt'] / walls['ours']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
