"""Side by side with nanoGPT on one machine: training and sampling, the same config and data.

    git clone https://github.com/karpathy/nanoGPT && git -C nanoGPT checkout 3adf61e   # nanoGPT, once
    python prepare.py                                 # Tiny Shakespeare -> data/shakespeare_char/input.txt, once
    python bench/nanogpt.py --nanogpt=nanoGPT --input=data/shakespeare_char/input.txt
    python bench/nanogpt.py --nanogpt=nanoGPT --input=... --repeats=3 --runs=nanogpt --runs=classic --runs=fast
    python bench/nanogpt.py --nanogpt=nanoGPT --input=... --device=cuda    # the GPU reference run, against ours
    python bench/nanogpt.py --nanogpt=nanoGPT --input=... --training=false  # sampling only

--nanogpt and --input have no default: an unmodified nanoGPT checkout (the figures in
docs/results.md are of commit 3adf61e), and Tiny Shakespeare (python prepare.py downloads
it). nanoGPT is copied into --work (it writes into its own folders) and prepares its own
data from --input; this repository prepares the same text. Then each run is a whole
process, the runs take turns (nanoGPT, then ours, and again for --repeats), and for
each the table gives: median ms per training step, wall time of the whole process,
its peak memory (RSS), the val loss at the same steps, and the seconds from the
process's start to the first evaluation at or below --target (nanoGPT's val loss
after its 2000 steps; with --target=0, the best val loss nanoGPT reached in this run).
Every evaluation scores as many sequences as nanoGPT's (on a CPU 20 batches of 12 per
split; 10 batches for a run of batch 24), so both sides' val losses cost and vary alike.
On a CPU each run's last checkpoint is then scored over the whole val split, the same
tokens for both sides: an evaluation's 240 random sequences move its figure by ~0.01.
On a CPU the training steps are then timed again in one process, nanoGPT's and each of
ours taking turns one step at a time (--step_rounds): a machine whose speed changes
every few seconds gives whole runs different mixes of speeds, and back-to-back steps one.
Then sampling from the same model shape (4 layers, 128 wide, block 64; on CUDA the
reference shape, 6 layers, 384 wide, block 256): tokens per second in-process (the
same random weights' shape in both models, 500 new tokens, temperature 0.8, top-k
200), and whole-process seconds of each sample.py on its trained checkpoint.

With --device=cuda the runs are nanoGPT's GPU reference (config/train_shakespeare_char.py
as it is, compiled) against our reference and fast presets, compiled, evaluating alike
(as many sequences as 200 batches of 64, every 250 steps); MFU is against the GPU's dense bf16 peak for both
(nanoGPT prints it against an A100's). Time it on an otherwise idle machine.
"""

import contextlib
import functools
import importlib.util
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's modules

from machine import machine  # noqa: E402

import train  # noqa: E402
from config import UserError, load_config, option  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tinygpt import system  # noqa: E402
from tinygpt.decoding import generate  # noqa: E402
from tinygpt.score import mean_loss  # noqa: E402
from tinygpt.system import (  # noqa: E402
    keep_freed_memory,  # noqa: E402
    peak_flops,
    pick_dtype,
)
from tinygpt.textfiles import SHAKESPEARE_URL  # noqa: E402

# nanoGPT's CPU configuration, as its README gives it.
NANOGPT_CPU = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
               "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
               "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
MODES = {  # per device: nanoGPT's arguments, ours by name, the evaluation both share, the sampled shape
    "cpu": {
        "nanogpt": NANOGPT_CPU,
        "ours": {"classic": ["config/shakespeare_char_cpu.toml"],
                 "classic_lr1e-3": ["config/shakespeare_char_cpu.toml", "--learning_rate=1e-3"],
                 "fast": ["config/shakespeare_char_cpu_fast.toml"],
                 "sprint": ["config/shakespeare_char_cpu_sprint.toml"]},
        "eval": ["--eval_interval=250", "--log_interval=1"],
        "eval_sequences": 20 * 12,  # per split and evaluation: nanoGPT's 20 batches of 12, in batches of each run's
        "shape": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "vocab_size": 65},
    },
    "cuda": {
        "nanogpt": ["config/train_shakespeare_char.py"],  # its GPU reference, as it is: compiled, bf16
        "ours": {"reference": ["config/shakespeare_char.toml", "--compile=true"],
                 "fast": ["config/shakespeare_char_fast.toml", "--compile=true"]},
        "eval": ["--eval_interval=250", "--log_interval=10"],
        "eval_sequences": 200 * 64,
        "shape": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "vocab_size": 65},
    },
}
A100_BF16 = 312e12  # the peak nanoGPT's printed MFU is against
GET_NANOGPT = ("git clone https://github.com/karpathy/nanoGPT then git -C nanoGPT checkout 3adf61e, and pass "
               "--nanogpt=nanoGPT")
GET_INPUT = (f"python prepare.py downloads Tiny Shakespeare (from {SHAKESPEARE_URL}) to "
             "data/shakespeare_char/input.txt: pass --input=data/shakespeare_char/input.txt")


@dataclass
class BenchConfig:
    nanogpt: str = option("", "an unmodified nanoGPT checkout (required: git clone, then checkout 3adf61e)")
    input: str = option("", "Tiny Shakespeare (required: python prepare.py writes data/shakespeare_char/input.txt)")
    device: str = option("cpu", "cpu: nanoGPT's CPU configuration; cuda: its GPU reference run", choices=tuple(MODES))
    runs: list[str] = option([], "which training runs: nanogpt, or one of ours by name (cpu: classic, classic_lr1e-3, "
                             "fast, sprint; cuda: reference, fast), or NAME=PRESET --key=value ... (none: all of them)")
    repeats: int = option(1, "how many times each run is made, in turn")
    target: float = option(1.886, "the val loss whose time to reach is reported (0: nanoGPT's best in this run)")
    sample_tokens: int = option(500, "new tokens per sample")
    sampling: bool = option(True, "measure sampling after training (false: training only)")
    training: bool = option(True, "train (false: sampling only, whole-process from the runs already in --work)")
    work: str = option("out/bench_nanogpt", "where nanoGPT's copy, the data and the runs go")
    iters: int = option(0, "steps of every run, for a quick check (0: each run's own, nanoGPT's 2000)")
    step_rounds: int = option(300, "on a CPU, rounds of one training step each, nanoGPT's and each of ours in the "
                              "same shape taking turns in one process (0: none)")


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
    Path(log_path).write_text("".join(f"{t:9.3f} {line}\n" for t, line in lines), encoding="utf-8")
    if proc.returncode != 0:
        raise UserError(f"{' '.join(map(str, command))} failed (exit {proc.returncode}); see {log_path}")
    return wall, usage.ru_maxrss / 1024, lines


def setup(cfg, work):
    """nanoGPT's copy with its data prepared, and ours."""
    nano = work / "nanoGPT"
    if not (Path(cfg.nanogpt) / "train.py").is_file():
        raise UserError(f"--nanogpt {cfg.nanogpt}: no nanoGPT checkout there (train.py missing); {GET_NANOGPT}")
    if not Path(cfg.input).is_file():
        raise UserError(f"--input {cfg.input} not found; {GET_INPUT}")
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


def train_nanogpt(nano, run_dir, mode, steps):
    out = run_dir / "out"
    wall, rss, lines = run_process([sys.executable, "train.py", *mode["nanogpt"], *steps, f"--out_dir={out}"], nano,
                                   run_dir / "stdout.txt")
    iters = [m.groups() for _, line in lines
             if (m := re.match(r"iter (\d+): .* time ([\d.]+)ms, mfu (-?[\d.]+)%", line))]
    step_ms = [float(ms) for it, ms, _ in iters if int(it) >= 5]  # its first steps compile and warm up
    peak = device_peak()
    mfu = [float(pct) / 100 * A100_BF16 / peak for it, _, pct in iters if peak and float(pct) > 0]
    evals = [(int(m.group(1)), float(m.group(2)), t) for t, line in lines
             if (m := re.match(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", line))]
    return {"wall": wall, "rss": rss, "step_ms": step_ms, "evals": evals, "mfu": mfu}


def train_ours(args, data_dir, run_dir, mode, steps):
    batch = load_config(train.TrainConfig, args, "train.py", "").batch_size  # evaluations see what nanoGPT's see
    eval_iters = f"--eval_iters={max(1, round(mode['eval_sequences'] / batch))}"
    command = [sys.executable, "train.py", *args, f"--data_dir={data_dir}", f"--out_dir={run_dir / 'out'}",
               *mode["eval"], eval_iters, *steps, "--overwrite=true"]
    wall, rss, lines = run_process(command, ROOT, run_dir / "stdout.txt")
    records = [json.loads(line) for line in open(run_dir / "out/log.jsonl", encoding="utf-8")]
    step_ms = [r["ms_per_iter"] for r in records if "ms_per_iter" in r and r["iter"] >= 5]
    times = [t for t, line in lines if re.match(r"step \d+: train", line)]  # when each evaluation was printed
    evals = [(r["iter"], r["val_loss"], t) for r, t in zip([r for r in records if "val_loss" in r], times)]
    mfu = [r["mfu"] for r in records if "mfu" in r]
    return {"wall": wall, "rss": rss, "step_ms": step_ms, "evals": evals, "mfu": mfu}


@torch.no_grad()
def whole_val(run_dir, nano, data_dir):
    """(step, loss) of a run's last checkpoint over every token of the val split, in fp32
    (score.mean_loss, in windows of the block size the run trained on). Each evaluation's 240 random
    sequences vary by about 0.01 from draw to draw; this is the same 111,540 tokens for both
    sides (nanoGPT's val.bin and ours hold the same ids, checked). nanoGPT keeps the checkpoint
    of its best evaluation past step 0, ours the last step. None where there is none."""
    path = run_dir / "out/ckpt.pt"
    if not path.is_file():  # nanoGPT saves none before its first evaluation past step 0
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    ids = np.fromfile(data_dir / "val.bin", dtype=np.uint16)
    if "model_args" in ckpt:  # nanoGPT's
        if not np.array_equal(ids, np.fromfile(nano / "data/shakespeare_char/val.bin", dtype=np.uint16)):
            raise UserError(f"nanoGPT's val.bin in {nano} and ours in {data_dir} differ: delete {nano} to "
                            "prepare again")
        nanogpt = load_nanogpt_model(nano)
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its size
            model = nanogpt.GPT(nanogpt.GPTConfig(**ckpt["model_args"]))
        model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
        step, block = ckpt["iter_num"], ckpt["model_args"]["block_size"]
    else:
        model = GPT(GPTConfig(**{**ckpt["model_config"], "dropout": 0.0}))
        model.load_state_dict(ckpt["model"])
        step, block = ckpt["iter"], ckpt["model_config"]["block_size"]
    return step, mean_loss(model.eval(), ids, block, 96, "cpu")


def device_peak():
    """The GPU's dense bf16 peak (device.PEAK_FLOPS), or None on a CPU."""
    return peak_flops("cuda") if torch.cuda.is_available() else None


def training(cfg, mode, work, nano, data_dir):
    steps = [f"--max_iters={cfg.iters}"] if cfg.iters else []  # ours decays over max_iters; nanoGPT is told
    results = {}
    for repeat in range(cfg.repeats):
        for spec in cfg.runs or ["nanogpt", *mode["ours"]]:
            name, _, args = spec.partition("=")
            run_dir = work / "runs" / name / str(repeat)
            run_dir.mkdir(parents=True, exist_ok=True)
            print(f"[{repeat + 1}/{cfg.repeats}] {name}", flush=True)
            if name == "nanogpt":
                result = train_nanogpt(nano, run_dir, mode, steps + [f"--lr_decay_iters={cfg.iters}"] * bool(steps))
            elif args or name in mode["ours"]:
                result = train_ours(args.split() if args else mode["ours"][name], data_dir, run_dir, mode, steps)
            else:
                raise UserError(f"unknown run {name!r}: nanogpt, {', '.join(mode['ours'])}, or NAME=PRESET --key=value")
            if cfg.device == "cpu":
                result["whole_val"] = whole_val(run_dir, nano, data_dir)
            results.setdefault(name, []).append(result)
    return results


def print_training(results, target):
    if not target:  # the best val loss nanoGPT reached here
        target = min(v for run in results.get("nanogpt", []) for _, v, _ in run["evals"])
    steps = sorted({it for runs in results.values() for run in runs for it, _, _ in run["evals"]})
    shown = [s for s in steps if s % 1000 == 0 or s == steps[-1]] if steps[-1] > 2000 else \
        [s for s in steps if s % 500 == 0 or s == steps[-1]]
    nano_wall = statistics.median(r["wall"] for r in results["nanogpt"]) if "nanogpt" in results else None
    vals = " | ".join(f"val@{s}" for s in shown)
    print(f"\n| run | median ms/iter | MFU | wall s | peak MiB | best val "
          f"| best val in nanoGPT's {nano_wall or 0:.0f} s | {vals} | s to {target:.4f} | whole val split (step) |")
    print("|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(shown) + "---:|---:|")
    for name, runs in results.items():
        for run in runs:
            val = {it: v for it, v, _ in run["evals"]}
            reached = next((t for _, v, t in run["evals"] if v <= target), None)
            mfu = f"{statistics.median(run['mfu']):.1%}" if run["mfu"] else "-"
            in_time = [v for _, v, t in run["evals"] if nano_wall and t <= nano_wall]
            cells = [f"{statistics.median(run['step_ms']):.1f}", mfu, f"{run['wall']:.1f}", f"{run['rss']:.0f}",
                     f"{min(val.values()):.4f}", f"{min(in_time):.4f}" if in_time else "-",
                     *(f"{val[s]:.4f}" if s in val else "-" for s in shown),
                     "-" if reached is None else f"{reached:.1f}",
                     f"{run['whole_val'][1]:.4f} ({run['whole_val'][0]})" if run.get("whole_val") else "-"]
            print(f"| {name} | " + " | ".join(cells) + " |")
    if "nanogpt" in results:
        base = statistics.median(statistics.median(r["step_ms"]) for r in results["nanogpt"])
        base_wall = statistics.median(r["wall"] for r in results["nanogpt"])
        for name, runs in results.items():
            if name != "nanogpt":
                ms = statistics.median(statistics.median(r["step_ms"]) for r in runs)
                wall = statistics.median(r["wall"] for r in runs)
                print(f"{name}: {ms / base:.2f}x nanoGPT's median step time, {wall / base_wall:.2f}x its wall time")


def load_nanogpt_model(nano):
    spec = importlib.util.spec_from_file_location("nanogpt_model", nano / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SAMPLING_ROUNDS = 15  # nanoGPT's rate moves +-7% between runs here: the median of many turns


def tokens_per_second(generators, repeats=SAMPLING_ROUNDS):
    """{name: median tokens/s} of each sample() -> number of tokens (read back: on a GPU, it
    waits), after a warm-up. They take turns, so a machine that slows down slows them all."""
    for sample in generators.values():
        sample()
    rates = {name: [] for name in generators}
    for _ in range(repeats):
        for name, sample in generators.items():
            t0 = time.perf_counter()
            n = sample()
            rates[name].append(n / (time.perf_counter() - t0))
    return {name: statistics.median(r) for name, r in rates.items()}


@torch.no_grad()
def sampling_in_process(nano, shape, device, new_tokens):
    """nanoGPT's model and ours of the same shape, random weights: ours with learned positions as
    nanoGPT's, with rope (the fast presets' and the automatic run's), and without the KV cache."""
    nanogpt = load_nanogpt_model(nano)
    torch.manual_seed(0)
    theirs = nanogpt.GPT(nanogpt.GPTConfig(**shape, bias=False, dropout=0.0)).to(device).eval()
    ours = GPT(GPTConfig(**shape, bias=False)).to(device).eval()
    rope = GPT(GPTConfig(**shape, bias=False, pos="rope")).to(device).eval()
    start = torch.zeros(1, 1, dtype=torch.long, device=device)

    def run(model, **kwargs):  # nanoGPT's model.generate, or our decoding's
        sample = model.generate if model is theirs else functools.partial(generate, model)
        return lambda: len(sample(start, new_tokens, temperature=0.8, top_k=200, **kwargs)[0].tolist()) - 1  # waits

    return tokens_per_second({"nanogpt": run(theirs), "ours": run(ours), "rope": run(rope),
                              "nocache": run(ours, use_cache=False)})


def sampling_whole_process(nano, work, ours_run, device, new_tokens, repeats=5):
    nano_ckpt = work / "runs/nanogpt/0/out"
    ours_ckpt = work / f"runs/{ours_run}/0/out"
    commands = {
        "nanogpt": ([sys.executable, "sample.py", f"--out_dir={nano_ckpt}", f"--device={device}", "--compile=False",
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


def steps_taking_turns(nano, mode, runs, rounds):
    """{name: median ms} of one training step of nanoGPT's CPU run and of each of ours (name: args), the
    steps taking turns one at a time in one process. This machine changes speed every few seconds, so
    minutes-long runs each see their own mix of speeds; two steps back to back see the same one. Both
    draw the same random tokens with train.get_batch (speed does not depend on what they are). Both
    use the allocator as train.py sets it on a CPU (keep_freed_memory), nanoGPT's step too: the ratio is
    the arithmetic's, and the whole runs above show what the allocator adds."""
    keep_freed_memory()
    nanogpt = load_nanogpt_model(nano)
    shape = mode["shape"]
    data = np.random.default_rng(0).integers(0, shape["vocab_size"], 1_000_000).astype(np.uint16)
    rng = np.random.default_rng(0)
    nano_args = dict(arg[2:].split("=", 1) for arg in mode["nanogpt"] if arg.startswith("--"))
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its size and its parameter groups
        theirs = nanogpt.GPT(nanogpt.GPTConfig(**shape, bias=False, dropout=0.0))
        their_opt = theirs.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")

    def their_step():  # nanoGPT's loop on a CPU: fp32 (its autocast is for CUDA), grad clip 1.0
        x, y = train.get_batch(data, int(nano_args["batch_size"]), shape["block_size"], rng, "cpu")
        _, loss = theirs(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        their_opt.step()
        their_opt.zero_grad(set_to_none=True)
        return loss.item()

    steps = {"nanogpt": their_step}
    for name, args in runs.items():
        cfg = load_config(train.TrainConfig, args, "train.py", "")
        model = GPT(train.model_config(cfg, shape["vocab_size"]))
        dtype = pick_dtype(cfg.dtype, "cpu", training=True)
        autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        # train.py's own step; the next batch it returns goes unused, each call drawing its own
        draw = functools.partial(train.get_batch, data, cfg.batch_size, cfg.block_size, rng, "cpu")
        steps[name] = functools.partial(train.train_step, model, train.make_optimizer(model, cfg, "cpu"),
                                        torch.amp.GradScaler("cpu", enabled=False), autocast, cfg, *draw(),
                                        iter(draw, None))
    times = {name: [] for name in steps}
    for round_ in range(rounds + 5):  # the first 5 warm up
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            if round_ >= 5:
                times[name].append((time.perf_counter() - t0) * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


@system.cli
def main(argv):
    cfg = load_config(BenchConfig, argv, "bench/nanogpt.py", __doc__.strip().splitlines()[0])
    mode = MODES[cfg.device]
    if not cfg.nanogpt:  # no default: what this compares with is the user's to name
        raise UserError(f"--nanogpt is required: {GET_NANOGPT}")
    if not cfg.input:
        raise UserError(f"--input is required: {GET_INPUT}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device=cuda: no CUDA device here; use --device=cpu")
    work = Path(cfg.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    nano, data_dir = setup(cfg, work)
    print(f"machine: {machine()}")
    if cfg.training:
        print_training(training(cfg, mode, work, nano, data_dir), cfg.target)
    if cfg.step_rounds and cfg.device == "cpu":
        runs = {name: args.split() if args else mode["ours"][name]
                for name, _, args in (spec.partition("=") for spec in cfg.runs or mode["ours"])
                if name != "nanogpt" and (args or name in mode["ours"])}
        ms = steps_taking_turns(nano, mode, runs, cfg.step_rounds)
        base = ms.pop("nanogpt")
        print(f"\ntraining steps taking turns one at a time in one process (median of {cfg.step_rounds}): nanoGPT "
              f"{base:.1f} ms" + "".join(f", {name} {t:.1f} ms ({t / base:.2f}x)" for name, t in ms.items()))
    if not cfg.sampling:
        return 0
    rates = sampling_in_process(nano, mode["shape"], cfg.device, cfg.sample_tokens)
    theirs, ours = rates["nanogpt"], rates["ours"]
    print(f"\nsampling {cfg.sample_tokens} tokens in-process on {cfg.device}, {mode['shape']}, taking turns (median "
          f"of {SAMPLING_ROUNDS}): nanoGPT {theirs:,.0f} tokens/s, ours {ours:,.0f} tokens/s ({ours / theirs:.2f}x); "
          f"ours with rope {rates['rope']:,.0f} ({rates['rope'] / theirs:.2f}x); ours without the KV cache "
          f"{rates['nocache']:,.0f} tokens/s ({ours / rates['nocache']:.1f}x less than with it)")
    walls = sampling_whole_process(nano, work, next(iter(mode["ours"])), cfg.device, cfg.sample_tokens)
    if walls:
        print(f"sampling {cfg.sample_tokens} tokens, whole process (median of 5): nanoGPT {walls['nanogpt']:.2f} s, "
              f"ours {walls['ours']:.2f} s ({walls['nanogpt'] / walls['ours']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
