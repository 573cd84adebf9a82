"""Everything one GPU can show, in one call: a table of what it saw, and the raw figures as JSON.

    python bench/gpu.py --nanogpt=PATH --input=input.txt --out=DIR   # on a GPU: about 9 minutes
    python bench/gpu.py --smoke                                      # on a CPU: tiny sizes, a minute

Most parts run as whole processes of this repository's own commands, in turn, each with a time cap; a
part that would not fit in what is left of --budget is skipped with a line, and one that fails is
recorded and the rest go on. The parts: the machine (torch, CUDA, the GPU); the reference preset in
bf16, uncompiled; the reference and fast presets' steps side by side in one process (compiled), with
nanoGPT's step of the reference's shape and the fast one's with torch.optim.Muon, and the kernels each
spends its time in; fp16, stopped by SIGTERM and resumed; the reference preset compiled, against
nanoGPT's GPU reference (config/train_shakespeare_char.py, compiled) over the same steps, MFU for both
against this GPU's peak; the fast preset (Muon, rope) compiled, to nanoGPT's 1.4697 as far as its cap
allows, its step against the reference's; what compiling buys, the same steps eager and compiled;
the automatic run (no preset) for --auto_time, with --compile=true on a GPU, scored on the whole val
split; sampling against nanoGPT's, in one process, the same shape and random weights; torchrun over every
GPU present (NCCL); peak memory where each run logged it.

With --smoke every part runs on the CPU at tiny sizes and without compiling, nanoGPT's parts only
where --nanogpt exists: the suite runs it (tests/test_gpu_bench.py), so the script keeps working
between the rare runs on a GPU. The table goes to docs/results.md with each GPU run.
"""

import contextlib
import dataclasses
import functools
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's modules

from machine import machine  # noqa: E402
from nanogpt import load_nanogpt_model  # noqa: E402

from config import load_config, option  # noqa: E402
from tinygpt import system  # noqa: E402
from tinygpt.budget import parse_duration  # noqa: E402
from tinygpt.decoding import generate  # noqa: E402
from tinygpt.files import load_data  # noqa: E402
from tinygpt.score import mean_loss  # noqa: E402
from tinygpt.system import NAMES, autocast, maybe_compile, peak_flops, pick_dtype, start_processes  # noqa: E402
from tinygpt.weights import model_from_checkpoint  # noqa: E402

NANOGPT_TARGET = 1.4697  # nanoGPT's README: val loss of its GPU reference run after 5000 steps
NANOGPT_A100 = 312e12  # the peak nanoGPT prints its MFU against


@dataclass
class GpuConfig:
    smoke: bool = option(False, "tiny sizes on the CPU, nothing compiled: a check that the script runs")
    nanogpt: str = option("", "an unmodified nanoGPT (git clone https://github.com/karpathy/nanoGPT, at 3adf61e); "
                          "its parts are skipped without one")
    input: str = option("data/shakespeare_char/input.txt", "Tiny Shakespeare, as python prepare.py downloads it "
                        "(smoke: a made-up text)")
    out: str = option("", "where the table and the JSON go (empty: $OUT if set, else --work)")
    work: str = option("out/bench_gpu", "where the data, the runs and nanoGPT's copy go (emptied first)")
    budget: int = option(540, "seconds for every part together", low=1)
    steps: int = option(300, "steps of each timed run (bf16, compiled, nanoGPT's)", low=10)
    auto_time: str = option("1m", "the automatic run's --max_time (on a GPU it compiles from about 152 s)")
    fast_cap: int = option(100, "seconds the fast preset may train, towards nanoGPT's 1.4697", low=1)
    parts: list[str] = option([], "run only these parts, by name (empty: every one); machine always runs")


class Bench:
    """The parts run so far, and the clock they share."""

    def __init__(self, cfg):
        self.cfg, self.start, self.rows, self.figures = cfg, time.monotonic(), [], {}
        self.work = Path(cfg.work).resolve()
        self.gpu = torch.cuda.is_available() and not cfg.smoke
        self.device = "cuda" if self.gpu else "cpu"

    def left(self):
        return self.cfg.budget - (time.monotonic() - self.start)

    def part(self, name, needs, fn, *args):
        """Runs fn(*args) -> (summary, figures) if `needs` seconds are left; records a skip, or a failure."""
        if self.cfg.parts and name not in self.cfg.parts and name != "machine":
            return
        t0 = time.monotonic()
        if self.left() < needs:
            summary, status = f"{self.left():.0f} s left of --budget, {needs} s needed", "skipped"
        else:
            try:
                summary, figures = fn(*args)
                self.figures[name], status = figures, "ok"
            except Exception as e:  # a failure is a result: recorded, and the other parts go on
                summary, status = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}", "failed"
        self.rows.append({"part": name, "status": status, "summary": summary, "seconds": time.monotonic() - t0})
        print(f"[{time.monotonic() - self.start:5.0f} s] {name}: {status}: {summary}", flush=True)

    def run(self, args, cap, stop_at=None, env=None, cwd=ROOT):
        """A whole process of args (a list), at most cap seconds (and what the budget has left): (exit code,
        [(seconds since its start, line)]). At its cap it gets SIGTERM (train.py saves and exits 143), and
        SIGKILL 30 s later. stop_at: a line prefix at which it gets SIGTERM."""
        timeout = max(1.0, min(cap, self.left()))
        proc = subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, **(env or {})}, start_new_session=True)

        def signal_group(signum):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

        timers = [threading.Timer(timeout, signal_group, (signal.SIGTERM,)),
                  threading.Timer(timeout + 30, signal_group, (signal.SIGKILL,))]
        for timer in timers:
            timer.start()
        t0, lines = time.monotonic(), []
        for line in proc.stdout:  # tqdm's bar (stderr, here too) ends its pieces with \r: they come with the lines
            lines.append((time.monotonic() - t0, line.strip().rsplit("\r", 1)[-1]))
            if stop_at and line.startswith(stop_at):
                signal_group(signal.SIGTERM)
                stop_at = None
        code = proc.wait()
        for timer in timers:
            timer.cancel()
        return code, lines

    def train(self, name, args, cap, **kwargs):
        """train.py with args into work/name: (exit code, lines, its log records)."""
        out_dir = self.work / name
        code, lines = self.run(["train.py", *args, f"--out_dir={out_dir}", "--overwrite=true"], cap, **kwargs)
        log = out_dir / "log.jsonl"
        records = [json.loads(r) for r in log.read_text(encoding="utf-8").splitlines()] if log.exists() else []
        if code not in (0, 143, -signal.SIGKILL) or not records:  # SIGKILL: at its cap, 30 s after SIGTERM
            tail = " | ".join(text for _, text in lines[-3:])
            raise RuntimeError(f"train.py exited {code}: {tail}")
        return code, lines, records


def step_figures(records, world=1):
    """Median ms per step, tokens/s and MFU past the first tenth of the logged steps (compiling and
    warming up), the best val loss and the peak memory the run's evaluations saw."""
    steps = [r for r in records if "ms_per_iter" in r]
    steady = steps[len(steps) // 10 :] or steps
    evals = [r for r in records if "val_loss" in r]
    figures = {"ms_per_step": statistics.median(r["ms_per_iter"] for r in steady) if steady else None,
               "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
               "best_val": min((r["val_loss"] for r in evals), default=None),
               "peak_memory_gib": max((r.get("peak_memory", 0) for r in evals), default=0) / 2**30}
    if steady and "mfu" in steady[-1]:
        figures["mfu"] = statistics.median(r["mfu"] for r in steady)
    return figures


def said(figures):
    parts = [f"{figures['ms_per_step']:.1f} ms/step" if figures.get("ms_per_step") else None,
             f"MFU {100 * figures['mfu']:.1f}%" if figures.get("mfu") else None,
             f"best val {figures['best_val']:.4f}" if figures.get("best_val") else None,
             f"peak {figures['peak_memory_gib']:.2f} GiB" if figures.get("peak_memory_gib") else None]
    return ", ".join(p for p in parts if p)


# --- The parts --------------------------------------------------------------------------------------


def the_machine(bench):
    info = {"machine": machine(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": torch.cuda.device_count() if bench.gpu else 0, "bf16": bench.gpu and torch.cuda.is_bf16_supported()}
    return f"{info['machine']}; CUDA {info['cuda']}, {info['gpus']} GPU(s)", info


def prepare(bench):
    data = bench.work / "data"
    text = Path(bench.cfg.input)
    if bench.cfg.smoke:  # a small text the tiny model learns in a few steps
        words = ["the cat sat on the mat.", "a dog ran in the fog!", "to be or not to be?"]
        text = bench.work / "input.txt"
        text.write_text("\n".join(words[i % 3] + " " + words[i * 7 % 3] for i in range(2000)), encoding="utf-8")
    code, lines = bench.run(["prepare.py", "--input", str(text), "--out_dir", str(data)], 120)
    if code != 0:
        raise RuntimeError(f"prepare.py exited {code}: {lines[-1][1] if lines else ''}")
    return f"{text} -> {data}", {"data_dir": str(data), "input": str(text)}


def presets(bench):
    """The reference and fast presets' arguments: the GPU's, or (smoke) tiny ones on the CPU."""
    data = f"--data_dir={bench.work / 'data'}"
    if bench.cfg.smoke:
        tiny = ["config/tiny.toml", data, "--device=cpu", "--eval_interval=5", "--eval_iters=2", "--log_interval=1"]
        return tiny, [*tiny, "--pos=rope", "--optimizer=muon"]
    timed = [data, "--eval_interval=100000", "--eval_iters=20", "--log_interval=10", "--patience=0"]
    return ["config/shakespeare_char.toml", *timed], ["config/shakespeare_char_fast.toml", *timed]


def bf16_eager(bench):
    reference, _ = presets(bench)
    steps = 10 if bench.cfg.smoke else bench.cfg.steps
    dtype = "--dtype=bfloat16" if bench.gpu else "--dtype=auto"
    _, _, records = bench.train("bf16", [*reference, f"--max_iters={steps}", dtype], 120)
    figures = step_figures(records)
    return f"reference preset, {steps} steps, uncompiled: {said(figures)}", figures


def fp16_stop_and_resume(bench):
    """fp16 (the GradScaler's path) stopped by SIGTERM after its second evaluation, then resumed to the end."""
    reference, _ = presets(bench)
    steps, every = (20, 5) if bench.cfg.smoke else (200, 50)
    dtype = "--dtype=float16" if bench.gpu else "--dtype=float32"
    args = [*reference, f"--max_iters={steps}", f"--eval_interval={every}", dtype]
    code, lines, _ = bench.train("fp16", args, 120, stop_at=f"step {2 * every}:")
    if code != 143 or not any("stopped by SIGTERM" in text for _, text in lines):
        raise RuntimeError(f"the stop exited {code}, not 143 with its line")
    code, lines, records = bench.train("fp16", [*args, "--init_from=resume"], 120)
    done = [text for _, text in lines if text.startswith("done:")]
    if code != 0 or not done:
        raise RuntimeError(f"the resume exited {code}")
    figures = {**step_figures(records), "stop_exit": 143, "resumed_to": records[-1]["iter"]}
    return f"{dtype[8:]}: stopped at step {2 * every} (exit 143), resumed: {done[0]}", figures


def nanogpt_dir(bench):
    """nanoGPT copied into work (it writes into its own folders), its data prepared from --input."""
    theirs = bench.work / "nanoGPT"
    if not theirs.exists():
        shutil.copytree(bench.cfg.nanogpt, theirs, ignore=shutil.ignore_patterns(".git", "out*"))
        shutil.copy(bench.cfg.input, theirs / "data" / "shakespeare_char" / "input.txt")
        subprocess.run([sys.executable, "prepare.py"], cwd=theirs / "data" / "shakespeare_char", check=True,
                       capture_output=True)
    return theirs


def nanogpt_step(bench, cfg, draw):
    """One step of nanoGPT's GPU reference as its train.py takes it (bf16 autocast, its AdamW, grad clip 1.0,
    compiled on a GPU), for a model of cfg's shape drawing batches from draw."""
    their = load_nanogpt_model(nanogpt_dir(bench))
    shape = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "dropout")}
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its size and its parameter groups
        raw = their.GPT(their.GPTConfig(vocab_size=65, bias=False, **shape)).to(bench.device)
        optimizer = raw.configure_optimizers(0.1, 1e-3, (0.9, 0.99), bench.device)
    model = torch.compile(raw) if bench.gpu else raw

    def step():
        with autocast(bench.device, torch.bfloat16 if bench.gpu else torch.float32):
            _, loss = model(*draw())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # waits for the device

    return step


def compiled_against_nanogpt(bench):
    """Our reference preset compiled, then nanoGPT's GPU reference compiled, the same steps; MFU for both
    against this GPU's dense bf16 peak (nanoGPT prints its own against an A100's)."""
    reference, _ = presets(bench)
    steps = bench.cfg.steps
    _, _, records = bench.train("compiled", [*reference, f"--max_iters={steps}", "--compile=true"], 200)
    ours = step_figures(records)
    theirs = bench.work / "nanogpt_out"
    code, lines = bench.run(["train.py", "config/train_shakespeare_char.py", f"--max_iters={steps}",
                             f"--out_dir={theirs}", "--eval_iters=20", "--log_interval=10", "--eval_interval=100000"],
                            200, cwd=nanogpt_dir(bench))
    their_ms, their_mfu = [], []
    for _, text in lines:  # iter N: loss L, time T ms, mfu M%
        if text.startswith("iter ") and "time" in text and int(text.split()[1].rstrip(":")) >= steps // 10:
            their_ms.append(float(text.split("time ")[1].split("ms")[0]))
            their_mfu.append(float(text.split("mfu ")[1].rstrip("%")) / 100)
    if code != 0 or not their_ms:
        raise RuntimeError(f"nanoGPT exited {code}: {lines[-1][1] if lines else ''}")
    peak = peak_flops("cuda")
    figures = {"ours": ours, "nanogpt_ms_per_step": statistics.median(their_ms),
               "nanogpt_mfu": statistics.median(their_mfu) * NANOGPT_A100 / peak if peak else None}
    figures["step_ratio"] = ours["ms_per_step"] / figures["nanogpt_ms_per_step"]
    theirs_said = f"{figures['nanogpt_ms_per_step']:.1f} ms/step" + (
        f", MFU {100 * figures['nanogpt_mfu']:.1f}%" if figures["nanogpt_mfu"] else "")
    return (f"{steps} steps compiled: ours {said(ours)}; nanoGPT's {theirs_said}; "
            f"{figures['step_ratio']:.2f}x its step"), figures


def fast_preset(bench):
    """The fast preset (Muon, rope), compiled on a GPU: its step against the reference's, and how soon its
    evaluations reach nanoGPT's 1.4697, within --fast_cap seconds."""
    _, fast = presets(bench)
    if bench.cfg.smoke:
        args = [*fast, "--max_iters=10"]
    else:
        args = [*fast, "--compile=true", "--eval_interval=500", "--eval_iters=100"]
    code, lines, records = bench.train("fast", args, bench.cfg.fast_cap)
    figures = step_figures(records)
    vals = [(t, float(text.split("val ")[1].split()[0])) for t, text in lines if text.startswith("step ")]
    reached = [t for t, val in vals if val <= NANOGPT_TARGET]
    figures["seconds_to_nanogpt_val"] = reached[0] if reached else None
    reference = bench.figures.get("compiled", {}).get("ours") or bench.figures.get("bf16")
    if reference and reference.get("ms_per_step") and figures.get("ms_per_step"):
        figures["step_vs_reference"] = figures["ms_per_step"] / reference["ms_per_step"]
    to = f"{NANOGPT_TARGET} in {reached[0]:.0f} s of the process" if reached else f"not {NANOGPT_TARGET} in its cap"
    vs = f"; {figures['step_vs_reference']:.2f}x the reference's step" if "step_vs_reference" in figures else ""
    return f"{said(figures)}; {to}{vs}" + ("" if code == 0 else " (stopped at its cap)"), figures


def automatic(bench):
    """No preset, as a user runs it: sized for the data and --auto_time (compiled, on a GPU); best.pt scored
    on the whole val split."""
    args = [f"--data_dir={bench.work / 'data'}", f"--max_time={'2m' if bench.cfg.smoke else bench.cfg.auto_time}"]
    # Smoke: sized as for two minutes, but ten steps: a busy machine still has its two minutes.
    args += ["--device=cpu", "--max_iters=10"] if bench.cfg.smoke else ["--compile=true"]
    _, lines, records = bench.train("auto", args, parse_duration(args[1].split("=")[1]) + 120)
    model, _ = model_from_checkpoint(bench.work / "auto" / "best.pt", bench.device)
    meta, splits = load_data(bench.work / "data")
    mixed = autocast(bench.device, torch.bfloat16 if bench.gpu else torch.float32)
    whole = mean_loss(model, splits["val"], model.config.block_size, 64, bench.device, mixed)
    sized = next((text for _, text in lines if text.startswith("auto: ")), "")
    # Seconds to the first step: the sizing's timing and, compiled, the compile.
    setup = next((t for t, text in lines if " params, " in text), None)
    figures = {**step_figures(records), "whole_val": whole, "sized": sized, "setup_s": setup}
    return f"{said(figures)}; whole val split {whole:.4f}; set-up {setup or 0:.0f} s; {sized[:160]}", figures


def steps_side_by_side(bench):
    """The reference and fast presets' steps in one process, compiled on a GPU, taking turns, with
    nanoGPT's step of the reference's shape (where --nanogpt exists) and the fast preset's again with
    torch.optim.Muon for ours (its step before the batched Muon) and with ours's orthogonalization compiled
    (on a GPU; smoke: as it is); the costliest kernels (smoke: CPU ops) of each, in ms a step, in the JSON.
    Taking turns, a GPU whose speed moves between calls moves them all."""
    import train
    from tinygpt.optim import Muon, Optimizers, orthogonalize

    procs = start_processes(bench.device)  # as train.py does (on a GPU: TF32 for float32 matmuls)
    steps = {}
    for name, args in zip(("reference", "fast"), presets(bench)):
        cfg = load_config(train.TrainConfig, [str(ROOT / a) if a.endswith(".toml") else a for a in args])
        cfg = dataclasses.replace(cfg, dtype=NAMES[pick_dtype(cfg.dtype, procs.device_type, training=True)])
        run = train.build(cfg, load_data(cfg.data_dir), procs)
        model = maybe_compile(run.raw_model, procs.device_type) if bench.gpu else run.raw_model
        draw = functools.partial(train.get_batch, run.splits["train"], cfg.batch_size, cfg.block_size,
                                 np.random.default_rng(0), procs.device)
        if name == "reference" and bench.cfg.nanogpt and Path(bench.cfg.nanogpt).exists():
            steps["nanogpt"] = nanogpt_step(bench, cfg, draw)
        optimizers = {name: run.optimizer}
        if name == "fast":  # the same model and AdamW, the matrices stepped by torch's Muon
            adamw, ours = run.optimizer.optimizers
            theirs = torch.optim.Muon(ours.param_groups[0]["params"], **ours.defaults)  # ours's settings
            optimizers["fast_torch_muon"] = Optimizers(adamw, theirs)
            compiled = Muon(ours.param_groups[0]["params"], **ours.defaults)
            compiled.orthogonalize = torch.compile(orthogonalize) if bench.gpu else orthogonalize
            optimizers["fast_compiled_muon"] = Optimizers(adamw, compiled)
        for key, opt in optimizers.items():
            steps[key] = functools.partial(train.train_step, model, opt, run.scaler, run.autocast, cfg, *draw(),
                                           iter(draw, None))  # .item(): each step waits for the device
    for step in steps.values():
        for _ in range(3):  # compiling, warming up
            step()
    times = {key: [] for key in steps}
    for _ in range(3 if bench.cfg.smoke else 5):  # taking turns
        for key, step in steps.items():
            times[key] += [timed(step) for _ in range(5 if bench.cfg.smoke else 20)]
    figures = {key: 1000 * statistics.median(t) for key, t in times.items()}
    activity, column = (ProfilerActivity.CUDA, "self_device_time_total") if bench.gpu else (ProfilerActivity.CPU,
                                                                                           "self_cpu_time_total")
    for key, step in steps.items():
        with profile(activities=[activity]) as prof:
            for _ in range(10):
                step()
        costliest = sorted(prof.key_averages(), key=lambda e: -getattr(e, column))[:8]
        figures[f"{key}_costliest"] = {e.key[:80]: getattr(e, column) / 1000 / 10 for e in costliest}
    ratios = ", ".join(f"{key} {figures[key]:.1f} ms ({figures[key] / figures['reference']:.2f}x)" for key in steps)
    text = f"a step, {'compiled, ' * bench.gpu}taking turns, against the reference's: {ratios}"
    if "nanogpt" in figures:
        figures["reference_vs_nanogpt"] = figures["reference"] / figures["nanogpt"]
        text += f"; the reference {figures['reference_vs_nanogpt']:.2f}x nanoGPT's step"
    return text, figures


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compiling(bench):
    """What compiling buys the model the automatic run chose at 5 minutes on an H100 (the recipe at 8 x 384,
    block 256, batch 40): the same steps eager and compiled; a step's speed-up, and the seconds compiling adds
    to the process (its evaluations' graph included)."""
    data = f"--data_dir={bench.work / 'data'}"
    shape = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=4", "--device=cpu"] \
        if bench.cfg.smoke else ["--n_layer=8", "--n_embd=384", "--n_head=6", "--block_size=256", "--batch_size=40"]
    recipe = ["--pos=rope", "--optimizer=muon", "--muon_lr=0.015", "--learning_rate=1.5e-3", "--bias=false",
              "--dropout=0.1"]
    steps = 10 if bench.cfg.smoke else 200
    runs = {}
    for compiled in (False, True):
        args = [data, *shape, *recipe, f"--max_iters={steps}", "--eval_interval=100000", "--eval_iters=10",
                "--log_interval=10", f"--compile={str(compiled and not bench.cfg.smoke).lower()}"]
        _, lines, records = bench.train("compiled_steps" if compiled else "eager_steps", args, 150)
        runs[compiled] = lines[-1][0], step_figures(records)["ms_per_step"]
    (eager_s, eager_ms), (compiled_s, compiled_ms) = runs[False], runs[True]
    figures = {"eager_ms": eager_ms, "compiled_ms": compiled_ms, "speedup": eager_ms / compiled_ms,
               "compile_s": compiled_s - eager_s - steps * (compiled_ms - eager_ms) / 1000}
    return (f"{steps} steps: eager {eager_ms:.1f} ms, compiled {compiled_ms:.1f} ms, {figures['speedup']:.2f}x; "
            f"compiling added {figures['compile_s']:.0f} s"), figures


def sampling(bench):
    """500 new tokens, temperature 0.8, top-k 200, in one process: ours and nanoGPT's, taking turns, the same
    shape and random weights, both under bf16 autocast on a GPU."""
    from model import GPT, GPTConfig

    shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=32) if bench.cfg.smoke else dict(
        n_layer=6, n_head=6, n_embd=384, block_size=256)
    new = 50 if bench.cfg.smoke else 500
    ours = GPT(GPTConfig(vocab_size=65, dropout=0.0, bias=False, **shape)).to(bench.device).eval()
    models = {"ours": lambda idx: generate(ours, idx, new, temperature=0.8, top_k=200)}
    if bench.cfg.nanogpt and Path(bench.cfg.nanogpt).exists():
        their_module = load_nanogpt_model(nanogpt_dir(bench))
        theirs = their_module.GPT(their_module.GPTConfig(vocab_size=65, dropout=0.0, bias=False, **shape))
        theirs = theirs.to(bench.device).eval()
        models["nanogpt"] = lambda idx: theirs.generate(idx, new, temperature=0.8, top_k=200)
    rates = {name: [] for name in models}
    mixed = autocast(bench.device, torch.bfloat16 if bench.gpu else torch.float32)
    for _ in range(3):
        for name, draw in models.items():
            idx = torch.zeros(1, 1, dtype=torch.long, device=bench.device)
            with torch.no_grad(), mixed:
                if bench.gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                draw(idx)
                if bench.gpu:
                    torch.cuda.synchronize()
            rates[name].append(new / (time.perf_counter() - t0))
    figures = {name: statistics.median(r) for name, r in rates.items()}
    text = ", ".join(f"{name} {rate:,.0f} tokens/s" for name, rate in figures.items())
    if "nanogpt" in figures:
        figures["ratio"] = figures["ours"] / figures["nanogpt"]
        text += f" ({figures['ratio']:.2f}x nanoGPT's)"
    return text, figures


def torchrun(bench):
    """The reference preset under torchrun over every GPU present (NCCL; smoke: one CPU process, gloo)."""
    reference, _ = presets(bench)
    n = torch.cuda.device_count() if bench.gpu else 1
    out_dir = bench.work / "torchrun"
    args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "train.py", *reference,
            "--max_iters=20", "--eval_interval=10", f"--out_dir={out_dir}", "--overwrite=true"]
    code, lines = bench.run(args, 150, env={"OMP_NUM_THREADS": "1"})
    backend = next((text for _, text in lines if "DDP over" in text), "")
    if code != 0 or not backend:
        raise RuntimeError(f"torchrun exited {code}: {' | '.join(text for _, text in lines[-3:])}")
    return f"{backend}; exit 0", {"processes": n, "backend": backend.split("DDP over ")[-1]}


# --- The table --------------------------------------------------------------------------------------


@system.cli
def main(argv):
    cfg = load_config(GpuConfig, argv, "bench/gpu.py", __doc__)
    bench = Bench(cfg)
    shutil.rmtree(bench.work, ignore_errors=True)
    bench.work.mkdir(parents=True)
    has_nanogpt = bool(cfg.nanogpt) and Path(cfg.nanogpt).exists() and not cfg.smoke
    bench.part("machine", 0, the_machine, bench)
    bench.part("prepare", 5, prepare, bench)
    bench.part("bf16", 20, bf16_eager, bench)
    bench.part("steps", 20 if cfg.smoke else 90, steps_side_by_side, bench)
    if has_nanogpt and bench.gpu:
        bench.part("compiled", 90, compiled_against_nanogpt, bench)
    elif not cfg.parts or "compiled" in cfg.parts:
        bench.rows.append({"part": "compiled", "status": "skipped", "summary": "needs a GPU and --nanogpt",
                           "seconds": 0})
    bench.part("fast", 30 if cfg.smoke else 60, fast_preset, bench)
    bench.part("compiling", 20 if cfg.smoke else 80, compiling, bench)
    bench.part("auto", 25 if cfg.smoke else 70, automatic, bench)
    bench.part("fp16", 30, fp16_stop_and_resume, bench)
    bench.part("sampling", 10, sampling, bench)
    bench.part("torchrun", 15, torchrun, bench)
    out = Path(cfg.out or os.environ.get("OUT") or bench.work)
    out.mkdir(parents=True, exist_ok=True)
    table = ["| part | status | what it saw | s |", "|---|---|---|---:|"]
    table += [f"| {r['part']} | {r['status']} | {r['summary']} | {r['seconds']:.0f} |" for r in bench.rows]
    (out / "gpu.md").write_text("\n".join(table) + "\n", encoding="utf-8")
    (out / "gpu.json").write_text(json.dumps({"rows": bench.rows, "figures": bench.figures}, indent=1, default=str),
                                  encoding="utf-8")
    print("\n".join(table))
    print(f"{time.monotonic() - bench.start:.0f} s in all; {out / 'gpu.md'}, {out / 'gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
