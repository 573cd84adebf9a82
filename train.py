"""Trains a GPT on data written by prepare.py.

    python train.py config/shakespeare_char_cpu.toml
    python train.py config/shakespeare_char.toml --compile=true --max_iters=2000
    python train.py config/finetune_shakespeare_gpt2.toml    # fine-tuning: --init_from (weights.py)
    torchrun --standalone --nproc_per_node=4 train.py config/shakespeare_char.toml

Writes OUT_DIR/ckpt.pt (the latest state, to resume from), OUT_DIR/best.pt
(the lowest val loss so far) and OUT_DIR/log.jsonl (one line per logged step).
"""

from tinygpt import terminal  # first: Ctrl-C while torch loads is one line, not a traceback  # isort: skip
import contextlib
import dataclasses
import functools
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from config import UserError, cli, load_config, option
from model import GPT, MIXERS, POSITIONS, GPTConfig, padded_vocab_size
from tinygpt import budget
from tinygpt.checkpoint import CHECKPOINT_FORMAT, check_resumable, load_checkpoint, resumed_config, save_checkpoint
from tinygpt.dataset import check_block_size, estimate_loss, get_batch, load_data
from tinygpt.device import (
    check_device,
    check_model_fits,
    keep_freed_memory,
    maybe_compile,
    peak_flops,
    pick_device,
    pick_dtype,
)
from tinygpt.files import version
from tinygpt.optim import configure_optimizer
from tinygpt.outdir import RunLock, append_record, run_out_dir, start_log
from tinygpt.weights import finetune_settings, load_into, load_source


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = option("data/shakespeare_char", "directory written by prepare.py")
    out_dir: str = option("", "where checkpoints and log.jsonl go (empty: out/NAME for data/NAME)")
    init_from: str = option("scratch", "scratch (a new model), resume (out_dir/ckpt.pt), a checkpoint file to "
                            "fine-tune, or GPT-2: gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a Hugging Face directory")
    overwrite: bool = option(False, "let a new run (scratch or fine-tuning) replace a checkpoint already in out_dir")
    # model (see GPTConfig in model.py)
    n_layer: int = option(6, "number of transformer blocks", low=0)
    n_head: int = option(6, "attention heads per block", low=1)
    n_embd: int = option(384, "width of the residual stream", low=1)
    block_size: int = option(256, "context length in tokens", low=1)
    dropout: float = option(0.2, "dropout probability (0 to turn off)", low=0, below=1)
    bias: bool = option(False, "biases in Linear and LayerNorm layers")
    mixer: str = option("multihead", "how positions communicate: none, average, head or multihead", choices=MIXERS)
    feedforward: bool = option(True, "a per-position MLP in each block")
    residual: bool = option(True, "residual connections around each sub-layer")
    layernorm: bool = option(True, "pre-norm LayerNorm before each sub-layer and at the end")
    pos: str = option("learned", "position encoding: learned, sinusoidal, rope (rotary) or none", choices=POSITIONS)
    tie_weights: bool = option(True, "output head shares the token embedding matrix")
    fused_attention: bool = option(True, "use F.scaled_dot_product_attention (False: the written-out math)")
    gelu: str = option("exact", "the feed-forward's GELU: exact, or tanh (GPT-2's approximation)",
                       choices=("exact", "tanh"))
    score: str = option("dot", "how a query scores a key (head, multihead): dot (scaled dot product) or additive",
                        choices=("dot", "additive"))
    window: int = option(0, "each query sees only its window newest keys, itself included (0: all of them)", low=0)
    # optimization
    batch_size: int = option(64, "sequences per micro-batch, in each process", low=1)
    grad_accum: int = option(1, "micro-batches per optimizer step, in each process", low=1)
    max_iters: int = option(5000, "optimizer steps in the whole run", low=0)
    learning_rate: float = option(1e-3, "peak learning rate, reached after warmup", above=0)
    min_lr: float = option(1e-4, "learning rate at the end of the cosine decay", low=0)
    warmup_iters: int = option(100, "steps of linear warmup from 0", low=0)
    lr_decay_iters: int = option(0, "step where cosine decay reaches min_lr (0: max_iters)", low=0)
    weight_decay: float = option(0.1, "AdamW weight decay, on weight matrices only", low=0)
    beta1: float = option(0.9, "AdamW beta1", low=0, below=1)
    beta2: float = option(0.99, "AdamW beta2", low=0, below=1)
    grad_clip: float = option(1.0, "clip the gradient norm to this (0: no clipping)", low=0)
    optimizer: str = option("adamw", "adamw, or muon: Muon for the matrices inside the blocks, AdamW for the rest",
                            choices=("adamw", "muon"))
    muon_lr: float = option(0.01, "Muon's peak learning rate, on the same warmup and decay as learning_rate",
                           above=0)
    muon_momentum: float = option(0.95, "Muon's (Nesterov) momentum", low=0, below=1)
    muon_ns_steps: int = option(5, "Newton-Schulz steps per Muon update", low=1)
    muon_weight_decay: float = option(0.0, "Muon's weight decay", low=0)
    # evaluation and logging
    max_time: str = option("", "a time budget for the whole run, e.g. 90s, 5m, 2h: the steps are fitted to it"
                                f" (empty: {budget.DEFAULT_BUDGET} if neither a preset nor --max_iters sets the steps)")
    patience: int = option(5, "stop early when val loss has not improved for this many evaluations (0: never)",
                           low=0)
    eval_interval: int = option(250, "evaluate and checkpoint every this many steps", low=1)
    eval_iters: int = option(200, "batches per loss estimate (0: the whole val split, deterministically)", low=0)
    log_interval: int = option(10, "write a log line every this many steps", low=1)
    # system
    device: str = option("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    dtype: str = option("auto", "auto (CUDA: bf16, else fp16; CPU: fp32), float32, bfloat16, float16",
                        choices=("auto", "float32", "bfloat16", "float16"))
    compile: bool = option(False, "torch.compile the model")
    seed: int = option(1337, "random seed", low=0, high=2**63 - 1)


# --- Setup -----------------------------------------------------------------------------


def model_config(cfg, vocab_size):
    """The model for cfg; its embedding is padded past the tokenizer's vocab_size for speed."""
    names = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "real_vocab_size"}
    try:
        return GPTConfig(vocab_size=padded_vocab_size(vocab_size), real_vocab_size=vocab_size,
                         **{n: getattr(cfg, n) for n in names})
    except ValueError as e:
        raise UserError(f"model config: {e}") from None


def check_settings(cfg, device, data=None):
    """Every check that needs nothing from out_dir, done before anything is built or written:
    the dtype, the data (meta.json and the bins, read here unless given), the model's config
    and its size."""
    dtype = pick_dtype(cfg.dtype, torch.device(device).type, training=True)
    meta, splits = data or load_data(cfg.data_dir)
    check_block_size(splits, cfg.block_size, cfg.data_dir)
    mconf = model_config(cfg, meta["vocab_size"])
    check_model_fits(mconf, cfg.batch_size, cfg.block_size, device, dtype)
    return dtype, meta, splits, mconf


def get_lr(it, cfg):
    """Linear warmup, then cosine decay to min_lr, then min_lr."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return cfg.min_lr
    progress = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def step_seed(seed, rank, it):
    """The seed of step `it` on process `rank`, for its batches and dropout masks. Derived afresh
    each step, so a resumed run, on any number of processes, draws what an uninterrupted one would."""
    return int(np.random.SeedSequence((seed, rank, it)).generate_state(1)[0])


# --- The run ---------------------------------------------------------------------------------


def read_start(cfg, device):
    """The checkpoint to resume from; None for a new run, which must not replace one unless told to."""
    path = Path(cfg.out_dir) / "ckpt.pt"
    if cfg.init_from != "resume" and path.exists() and not cfg.overwrite:
        raise UserError(f"{path} exists; continue it with --init_from=resume, "
                        "start over with --overwrite=true, or pick another --out_dir")
    return load_checkpoint(path, device) if cfg.init_from == "resume" else None


def time_steps(cfg, meta, splits, device, dtype, autocasts, world, model=None, optimizer=None, scaler=None):
    """(seconds per training step, seconds per evaluation with its checkpoints) for cfg here, from
    a few real steps (budget.time_steps). Without a model, one is built for cfg and dropped."""
    if model is None:
        model = GPT(model_config(cfg, meta["vocab_size"])).to(device)
        optimizer = configure_optimizer(model, cfg, device.split(":")[0])
        scaler = torch.amp.GradScaler(enabled=dtype == torch.float16)
    step = functools.partial(train_step, accum=cfg.grad_accum, autocast=autocasts[0], cfg=cfg)
    return agree_on(budget.time_steps(cfg, splits, device, autocasts[1], world, model, optimizer, scaler, step),
                    device, world)


def agree(flag, device, world):
    """Rank 0's flag on every process: its evaluations decide for all."""
    return bool(agree_on((float(bool(flag)),), device, world)[0])


def agree_on(numbers, device, world):
    """Rank 0's numbers on every process, so that all make the same plan."""
    if world == 1:
        return tuple(numbers)
    t = torch.tensor(numbers, dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return tuple(t.tolist())


def train_step(model, optimizer, scaler, next_batch, x, y, accum, autocast, cfg):
    """One optimizer step over accum micro-batches; returns the loss and the next batch."""
    for micro in range(accum):
        # Under DDP, gradients are averaged across processes only on the last micro-step.
        sync = micro == accum - 1 or not isinstance(model, DDP)
        with (contextlib.nullcontext() if sync else model.no_sync()), autocast:
            _, loss = model(x, y)
            loss = loss / accum
        x, y = next_batch()  # drawn while the device still works on this one
        scaler.scale(loss).backward()
    if cfg.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item() * accum, x, y  # .item() waits for the device, so step timings are honest


@cli
def main(argv):
    sources = {}  # where each setting came from: a preset, the command line, or neither (free to choose)
    cfg = load_config(TrainConfig, argv, "train.py", __doc__.strip().splitlines()[0], sources=sources)
    cfg = dataclasses.replace(cfg, out_dir=run_out_dir(cfg, sources))
    ddp = "RANK" in os.environ  # started by torchrun, with one process or more
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    device = check_device(pick_device(cfg.device))
    if device == "cpu":
        keep_freed_memory()  # each step reuses the last one's memory: no page faults
    if ddp:
        local_rank = int(os.environ["LOCAL_RANK"])
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    lock = RunLock(cfg.out_dir)  # taken once everything is checked; held until the run ends
    try:
        status = run(cfg, sources, device, rank, world, lock)
        if ddp and status == 0:  # every process at the end before any leaves: gloo can abort one whose peer is gone
            dist.barrier()
        return status
    finally:
        lock.release()
        if ddp:
            dist.destroy_process_group()


def run(cfg, sources, device, rank, world, lock):
    master = rank == 0
    say = print if master else (lambda *args: None)
    device_type = "cuda" if device.startswith("cuda") else device.split(":")[0]
    meta, splits = data = load_data(cfg.data_dir)
    out_dir = Path(cfg.out_dir)
    if master:
        lock.check_free()  # another run into out_dir is named now, not taken for a finished one
    seen = version(out_dir / "ckpt.pt")
    fine_tune = cfg.init_from not in ("scratch", "resume")
    source = load_source(cfg.init_from, cfg.out_dir) if fine_tune else None  # the weights to start from
    ckpt = read_start(cfg, device)
    if ckpt is not None:
        cfg = resumed_config(ckpt["train_config"], cfg, sources)
    dtype = pick_dtype(cfg.dtype, device_type, training=True)  # auto on a CPU: measured here
    cfg = dataclasses.replace(cfg, dtype=str(dtype).removeprefix("torch."))  # and kept, for a resume
    autocast = (torch.autocast(device_type=device_type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())
    # The training's and the evaluations'; on a CPU these run in fp32: exact, and score.py's figure.
    autocasts = (autocast, contextlib.nullcontext() if device_type == "cpu" else autocast)
    seconds = max_steps = None
    if ckpt is None:  # a time budget fixes the steps (and with no preset, the model) once, here
        preset = any(where != "command line" for where in sources.values())
        if cfg.max_time or (not preset and "max_iters" not in sources):
            seconds = budget.parse_duration(cfg.max_time or budget.DEFAULT_BUDGET)
        if fine_tune:  # the weights fix the model's shape
            cfg = finetune_settings(source, cfg, meta)
        elif not preset:
            measure = functools.partial(time_steps, meta=meta, splits=splits, device=device, dtype=dtype,
                                        autocasts=autocasts, world=world)
            cfg, max_steps = budget.size_for_data(cfg, sources, len(splits["train"]), len(splits["val"]),
                                                  meta["vocab_size"], seconds or budget.parse_duration(
                                                      budget.DEFAULT_BUDGET), measure, say)
    mconf = check_settings(cfg, device, data)[3]
    if ckpt is not None:
        check_resumable(ckpt, mconf, meta, cfg)

    torch.manual_seed(cfg.seed)
    model = GPT(mconf)
    if source is not None:
        say(load_into(model, source, meta))
    del source  # the copy is in the model: GPT-2's weights need not stay twice in memory
    model = model.to(device)
    optimizer = configure_optimizer(model, cfg, device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == torch.float16))
    if master:
        lock.acquire()  # out_dir is this run's from here on; nothing in it was touched before
        if version(out_dir / "ckpt.pt") != seen:  # another run wrote it while this one started
            ckpt = read_start(cfg, device)
            if ckpt is not None:
                check_resumable(ckpt, mconf, meta, cfg)
        start_log(out_dir, ckpt["iter"] if ckpt else 0)
    start_iter, best_val, evaluated = 0, float("inf"), None  # evaluated: the iteration whose eval is done
    bad_evals = 0  # evaluations in a row without a new best
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_iter, best_val, bad_evals = ckpt["iter"], ckpt["best_val_loss"], ckpt.get("bad_evals", 0)
        evaluated = start_iter if ckpt["val_loss"] is not None else None  # None: saved on a signal
        if master:
            print(f"resuming {out_dir / 'ckpt.pt'} at iteration {start_iter}")
    del ckpt

    raw_model = model
    if cfg.compile:
        model = maybe_compile(model, device_type)
    eval_model = model  # compiled too, if it is: evaluations run at the training's speed
    if dist.is_initialized():  # under torchrun, even with one process
        model = DDP(model, device_ids=[int(device.split(":")[1])] if device_type == "cuda" else None)
    if seconds is not None:
        step_s, eval_s = time_steps(cfg, meta, splits, device, dtype, autocasts, world, model, optimizer, scaler)
        elapsed = agree_on((budget.process_age(),), device, world)[0]
        cfg = budget.fit_to_time(cfg, sources, seconds, step_s, eval_s, max_steps, elapsed, say)
    # batch_size and grad_accum are per process, so one step sees all of this:
    sequences_per_iter = cfg.batch_size * cfg.grad_accum * world
    tokens_per_iter = sequences_per_iter * cfg.block_size
    flops = budget.train_flops_per_token(raw_model.num_params(), cfg.n_layer, cfg.n_embd, cfg.block_size)
    peak = peak_flops(device_type)
    if master:
        print(f"{raw_model.num_params():,} parameters; {tokens_per_iter:,} tokens per step: batch "
              f"{cfg.batch_size} x grad_accum {cfg.grad_accum} x {world} process(es) = {sequences_per_iter} "
              f"sequences of {cfg.block_size}; on {device}, {str(dtype).removeprefix('torch.')}"
              + (f", DDP over {dist.get_backend()}" if dist.is_initialized() else ""))

    def checkpoint(it, val_loss):
        state = {"format": CHECKPOINT_FORMAT, "model": raw_model.state_dict(),
                 "model_config": dataclasses.asdict(mconf), "train_config": dataclasses.asdict(cfg),
                 "meta": meta, "iter": it, "best_val_loss": best_val, "val_loss": val_loss, "bad_evals": bad_evals,
                 "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
        save_checkpoint(state, out_dir / "ckpt.pt")
        return state

    def evaluate(it, lr):
        """Estimates the losses and logs them; saves ckpt.pt, and best.pt when val improved."""
        nonlocal best_val, bad_evals
        losses = estimate_loss(eval_model, splits, cfg, device, autocasts[1], seed=cfg.seed + it)
        record = {"iter": it, "train_loss": losses["train"], "val_loss": losses["val"],
                  "val_bpc": losses["val"] / math.log(2), "lr": lr}
        append_record(out_dir, record)
        improved = losses["val"] < best_val
        best_val, bad_evals = min(best_val, losses["val"]), 0 if improved else bad_evals + 1
        state = checkpoint(it, losses["val"])
        if improved:
            save_checkpoint(state, out_dir / "best.pt")
        bar.write(f"step {it}: train {losses['train']:.4f}, val {losses['val']:.4f} "
                  f"({record['val_bpc']:.3f} bits/token){' *' if improved else ''}")

    bar = tqdm(total=cfg.max_iters, initial=start_iter, disable=not master or None, dynamic_ncols=True)

    def train_batches(it):
        """This process's micro-batches, grad_accum per step, from step it on."""
        while True:
            rng = np.random.default_rng(step_seed(cfg.seed, rank, it))
            for _ in range(cfg.grad_accum):
                yield get_batch(splits["train"], cfg.batch_size, cfg.block_size, rng, device)
            it += 1

    batches = train_batches(start_iter)
    next_batch = functools.partial(next, batches)
    x, y = next_batch()
    step_ms = []
    stop_early = bool(cfg.patience and bad_evals >= cfg.patience)  # a resumed run that had stopped early
    it = start_iter
    times = budget.LoopTimes(start_iter)  # with a budget, the steps are fitted again from these
    with terminal.StopRequested() as stop:
        while True:
            eval_due = (it % cfg.eval_interval == 0 or it == cfg.max_iters) and it != evaluated
            measured = times.means(it) if eval_due and seconds and it <= 0.75 * cfg.max_iters else None
            if measured:  # at each evaluation in the run's first 3/4
                step_s, eval_s, now = agree_on(measured, device, world)
                cfg = budget.replan(cfg, sources, seconds, it, step_s, eval_s, max_steps, now,
                                    bar.write if master else say)
                bar.total = cfg.max_iters
            lr = get_lr(it, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's group runs at muon_lr's scale
            if eval_due:
                with times.evaluation():
                    if master:
                        evaluate(it, lr)
                    stop_early = agree(cfg.patience and bad_evals >= cfg.patience, device, world)
            if it >= cfg.max_iters or stop_early:
                break

            t0 = time.perf_counter()
            if cfg.dropout > 0:  # this step's dropout masks, the step's only use of torch's generator
                torch.manual_seed(step_seed(cfg.seed, rank, it))  # (~140 us: skipped where nothing draws)
            loss_value, x, y = train_step(model, optimizer, scaler, next_batch, x, y, cfg.grad_accum, autocast, cfg)
            step_ms.append((time.perf_counter() - t0) * 1000)
            it += 1
            # fp16's GradScaler skips steps whose gradients overflow; that is not a failure.
            # A non-finite loss is: every step after it would be garbage, so nothing is saved.
            if not math.isfinite(loss_value):
                raise UserError(f"loss is {loss_value} at iteration {it}; the last good checkpoint is kept in "
                                f"{out_dir}. Try a lower --learning_rate, or bfloat16 instead of float16")
            if master:
                tok_s = tokens_per_iter / (step_ms[-1] / 1000)
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
                if it % cfg.log_interval == 0:
                    record = {"iter": it, "loss": loss_value, "lr": lr, "ms_per_iter": step_ms[-1],
                              "tokens_per_s": tok_s}
                    if peak:
                        record["mfu"] = flops * tok_s / peak
                    append_record(out_dir, record)
            if stop.signum is not None:
                bar.close()
                if master:
                    checkpoint(it, None)
                    print(f"stopped by {signal.Signals(stop.signum).name} at iteration {it}; saved "
                          f"{out_dir / 'ckpt.pt'} (continue with --init_from=resume)")
                return 128 + stop.signum
    bar.close()
    if master:
        if it < cfg.max_iters:
            print(f"stopped early at iteration {it}: val loss has not improved for {bad_evals} evaluations "
                  f"(--patience={cfg.patience}); the best model is in {out_dir / 'best.pt'}")
        median = sorted(step_ms)[len(step_ms) // 2] if step_ms else 0.0
        print(f"done: {it} iterations, best val loss {best_val:.4f}, median {median:.1f} ms/iter; "
              f"checkpoints in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
