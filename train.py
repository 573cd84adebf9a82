"""Trains a GPT on data written by prepare.py.

    python train.py config/shakespeare_char_cpu.toml
    python train.py config/shakespeare_char.toml --compile=true --max_iters=2000
    torchrun --standalone --nproc_per_node=4 train.py config/shakespeare_char.toml

Writes OUT_DIR/ckpt.pt (the latest state, to resume from), OUT_DIR/best.pt
(the lowest val loss so far) and OUT_DIR/log.jsonl (one line per logged step).
"""

import contextlib
import dataclasses
import functools
import json
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

from checkpoint import CHECKPOINT_FORMAT, load_checkpoint, save_checkpoint
from config import UserError, cli, load_config, option
from device import maybe_compile, peak_flops, pick_device, pick_dtype
from model import GPT, GPTConfig, padded_vocab_size
from optim import configure_optimizer
from prepare import open_split, read_meta


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = option("data/shakespeare_char", "directory written by prepare.py")
    out_dir: str = option("out", "where checkpoints and log.jsonl go")
    init_from: str = option("scratch", "'scratch' for a new model, 'resume' to continue out_dir/ckpt.pt")
    overwrite: bool = option(False, "let a scratch run replace a checkpoint already in out_dir")
    # model (see GPTConfig in model.py)
    n_layer: int = option(6, "number of transformer blocks")
    n_head: int = option(6, "attention heads per block")
    n_embd: int = option(384, "width of the residual stream")
    block_size: int = option(256, "context length in tokens")
    dropout: float = option(0.2, "dropout probability (0 to turn off)")
    bias: bool = option(False, "biases in Linear and LayerNorm layers")
    mixer: str = option("multihead", "how positions communicate: none, average, head or multihead")
    feedforward: bool = option(True, "a per-position MLP in each block")
    residual: bool = option(True, "residual connections around each sub-layer")
    layernorm: bool = option(True, "pre-norm LayerNorm before each sub-layer and at the end")
    pos: str = option("learned", "position encoding: learned, sinusoidal, rope (rotary) or none")
    tie_weights: bool = option(True, "output head shares the token embedding matrix")
    fused_attention: bool = option(True, "use F.scaled_dot_product_attention (False: the written-out math)")
    score: str = option("dot", "how a query scores a key (head, multihead): dot (scaled dot product) or additive")
    window: int = option(0, "each query sees only its window newest keys, itself included (0: all of them)")
    # optimization
    batch_size: int = option(64, "sequences per micro-batch, in each process")
    grad_accum: int = option(1, "micro-batches per optimizer step, in each process")
    max_iters: int = option(5000, "optimizer steps in the whole run")
    learning_rate: float = option(1e-3, "peak learning rate, reached after warmup")
    min_lr: float = option(1e-4, "learning rate at the end of the cosine decay")
    warmup_iters: int = option(100, "steps of linear warmup from 0")
    lr_decay_iters: int = option(0, "step where cosine decay reaches min_lr (0: max_iters)")
    weight_decay: float = option(0.1, "AdamW weight decay, on weight matrices only")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.99, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the gradient norm to this (0: no clipping)")
    optimizer: str = option("adamw", "adamw, or muon: Muon for the matrices inside the blocks, AdamW for the rest")
    muon_lr: float = option(0.01, "Muon's peak learning rate, on the same warmup and decay as learning_rate")
    muon_momentum: float = option(0.95, "Muon's (Nesterov) momentum")
    muon_ns_steps: int = option(5, "Newton-Schulz steps per Muon update")
    muon_weight_decay: float = option(0.0, "Muon's weight decay")
    # evaluation and logging
    eval_interval: int = option(250, "evaluate and checkpoint every this many steps")
    eval_iters: int = option(200, "batches per loss estimate (0: the whole val split, deterministically)")
    log_interval: int = option(10, "write a log line every this many steps")
    # system
    device: str = option("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    dtype: str = option("auto", "auto (CUDA: bf16, else fp16; CPU: fp32), float32, bfloat16, float16")
    compile: bool = option(False, "torch.compile the model")
    seed: int = option(1337, "random seed")


# --- Setup -----------------------------------------------------------------------------


def model_config(cfg, vocab_size):
    """The model for cfg; its embedding is padded past the tokenizer's vocab_size for speed."""
    names = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "real_vocab_size"}
    try:
        return GPTConfig(vocab_size=padded_vocab_size(vocab_size), real_vocab_size=vocab_size,
                         **{n: getattr(cfg, n) for n in names})
    except ValueError as e:
        raise UserError(f"model config: {e}") from None


def get_lr(it, cfg):
    """Linear warmup, then cosine decay to min_lr, then min_lr."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return cfg.min_lr
    progress = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def flops_per_token(model, cfg):
    """Training FLOPs per token: 6 per parameter (forward and backward) plus attention's."""
    return 6 * model.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


# --- Data ---------------------------------------------------------------------------------


def step_seed(seed, rank, it):
    """The seed of step `it` on process `rank`, for its batches and its dropout masks.
    Derived afresh at every step, so a resumed run, on any number of processes, draws
    exactly what an uninterrupted one would, with no generator state to save."""
    return int(np.random.SeedSequence((seed, rank, it)).generate_state(1)[0])


def get_batch(data, batch_size, block_size, rng, device):
    """batch_size random windows of data: inputs (B, T) and next-token targets (B, T)."""
    starts = rng.integers(0, len(data) - block_size, size=batch_size)
    x = np.stack([data[s : s + block_size] for s in starts]).astype(np.int64)
    y = np.stack([data[s + 1 : s + 1 + block_size] for s in starts]).astype(np.int64)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if device.startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def sequential_batches(data, block_size, batch_size, n_windows, device):
    """n_windows non-overlapping windows from the start of data, batch by batch."""
    n_windows = min(n_windows, (len(data) - 1) // block_size)
    for first in range(0, n_windows, batch_size):
        starts = range(first * block_size, min(first + batch_size, n_windows) * block_size, block_size)
        x = np.stack([data[s : s + block_size] for s in starts]).astype(np.int64)
        y = np.stack([data[s + 1 : s + 1 + block_size] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)


@torch.no_grad()
def estimate_loss(model, splits, cfg, device, autocast, seed):
    """Mean loss per split. eval_iters > 0: that many random batches (seeded, so the
    training data order is untouched). eval_iters = 0: the whole val split in
    non-overlapping windows, and as many train tokens from the train split's start."""
    model.eval()
    out = {}
    for name, data in splits.items():
        if cfg.eval_iters > 0:
            rng = np.random.default_rng(seed)
            batches = (get_batch(data, cfg.batch_size, cfg.block_size, rng, device) for _ in range(cfg.eval_iters))
        else:
            n_windows = (len(splits["val"]) - 1) // cfg.block_size
            batches = sequential_batches(data, cfg.block_size, 4 * cfg.batch_size, n_windows, device)
        total, count = 0.0, 0
        for x, y in batches:
            with autocast:
                _, loss = model(x, y)
            total += loss.item() * y.numel()
            count += y.numel()
        out[name] = total / count
    model.train()
    return out


# --- The run ---------------------------------------------------------------------------------


class StopRequested:
    """While active, SIGINT and SIGTERM set a flag instead of killing the process:
    the loop finishes its step, saves, and exits 128 + the signal's number."""

    def __enter__(self):
        self.signum = None
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def load_data(cfg):
    """meta.json and memmapped splits, checked against block_size."""
    meta = read_meta(cfg.data_dir)
    splits = {split: open_split(cfg.data_dir, split, meta) for split in ("train", "val")}
    for split, data in splits.items():
        if len(data) <= cfg.block_size:
            raise UserError(f"the {split} split of {cfg.data_dir} has {len(data)} tokens, not more than "
                            f"block_size {cfg.block_size}; lower --block_size or prepare a longer text")
    return meta, splits


def prepare_out_dir(cfg, start_iter):
    """Makes out_dir, refuses to start over a run that exists, and cuts log.jsonl back
    to start_iter, so a resumed run's log reads like an uninterrupted one."""
    out_dir = Path(cfg.out_dir)
    if cfg.init_from == "scratch" and (out_dir / "ckpt.pt").exists() and not cfg.overwrite:
        raise UserError(f"{out_dir / 'ckpt.pt'} exists; continue it with --init_from=resume, "
                        "start over with --overwrite=true, or pick another --out_dir")
    log_path = out_dir / "log.jsonl"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        kept = [] if start_iter == 0 or not log_path.exists() else [
            line for line in log_path.read_text().splitlines() if json.loads(line)["iter"] <= start_iter]
        tmp = log_path.with_name("log.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, log_path)
    except OSError as e:
        raise UserError(f"cannot write to out_dir {out_dir} ({e.strerror}); pick another --out_dir") from None
    return out_dir


def check_resumable(ckpt, mconf, meta, cfg):
    path = Path(cfg.out_dir) / "ckpt.pt"
    now, then = dataclasses.asdict(mconf), ckpt["model_config"]
    diff = {k: (v, then.get(k)) for k, v in now.items() if then.get(k) != v}
    if diff:
        raise UserError(f"cannot resume {path}: the model config differs (now, checkpoint): {diff}")
    if any(ckpt["meta"].get(k) != meta.get(k) for k in ("tokenizer", "vocab", "encoding")):
        raise UserError(f"cannot resume {path}: its tokenizer differs from the one in {cfg.data_dir}")


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
    cfg = load_config(TrainConfig, argv, "train.py", __doc__.strip().splitlines()[0])
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    device = pick_device(cfg.device)
    if ddp:
        local_rank = int(os.environ["LOCAL_RANK"])
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    try:
        return run(cfg, device, rank, world)
    finally:
        if ddp:
            dist.destroy_process_group()


def run(cfg, device, rank, world):
    master = rank == 0
    device_type = "cuda" if device.startswith("cuda") else device.split(":")[0]
    dtype = pick_dtype(cfg.dtype, device_type)
    if cfg.init_from not in ("scratch", "resume"):
        raise UserError(f"init_from must be 'scratch' or 'resume', got {cfg.init_from!r}")
    meta, splits = load_data(cfg)
    ckpt = load_checkpoint(Path(cfg.out_dir) / "ckpt.pt", device) if cfg.init_from == "resume" else None
    out_dir = prepare_out_dir(cfg, ckpt["iter"] if ckpt else 0) if master else Path(cfg.out_dir)

    torch.manual_seed(cfg.seed)
    mconf = model_config(cfg, meta["vocab_size"])
    model = GPT(mconf).to(device)
    optimizer = configure_optimizer(model, cfg, device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == torch.float16))
    start_iter, best_val, evaluated = 0, float("inf"), None  # evaluated: the iteration whose eval is done
    if ckpt is not None:
        check_resumable(ckpt, mconf, meta, cfg)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_iter, best_val = ckpt["iter"], ckpt["best_val_loss"]
        evaluated = start_iter if ckpt["val_loss"] is not None else None  # None: saved on a signal
        if master:
            print(f"resuming {out_dir / 'ckpt.pt'} at iteration {start_iter}")
    del ckpt

    raw_model = model
    if cfg.compile:
        model = maybe_compile(model, device_type)
    if world > 1:
        model = DDP(model, device_ids=[int(device.split(":")[1])] if device_type == "cuda" else None)
    autocast = (torch.autocast(device_type=device_type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())
    # batch_size and grad_accum are per process, so one step sees all of this:
    sequences_per_iter = cfg.batch_size * cfg.grad_accum * world
    tokens_per_iter = sequences_per_iter * cfg.block_size
    flops = flops_per_token(raw_model, cfg)
    peak = peak_flops(device_type)
    if master:
        print(f"{raw_model.num_params():,} parameters; {tokens_per_iter:,} tokens per step: batch "
              f"{cfg.batch_size} x grad_accum {cfg.grad_accum} x {world} process(es) = {sequences_per_iter} "
              f"sequences of {cfg.block_size}; on {device}, {str(dtype).removeprefix('torch.')}")

    def log(record):
        with open(out_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def checkpoint(it, val_loss):
        state = {"format": CHECKPOINT_FORMAT, "model": raw_model.state_dict(),
                 "model_config": dataclasses.asdict(mconf), "train_config": dataclasses.asdict(cfg),
                 "meta": meta, "iter": it, "best_val_loss": best_val, "val_loss": val_loss,
                 "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
        save_checkpoint(state, out_dir / "ckpt.pt")
        return state

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
    it = start_iter
    with StopRequested() as stop:
        while True:
            lr = get_lr(it, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's group runs at muon_lr's scale
            if master and (it % cfg.eval_interval == 0 or it == cfg.max_iters) and it != evaluated:
                losses = estimate_loss(raw_model, splits, cfg, device, autocast, seed=cfg.seed + it)
                record = {"iter": it, "train_loss": losses["train"], "val_loss": losses["val"],
                          "val_bpc": losses["val"] / math.log(2), "lr": lr}
                log(record)
                improved = losses["val"] < best_val
                best_val = min(best_val, losses["val"])
                state = checkpoint(it, losses["val"])
                if improved:
                    save_checkpoint(state, out_dir / "best.pt")
                bar.write(f"step {it}: train {losses['train']:.4f}, val {losses['val']:.4f} "
                          f"({record['val_bpc']:.3f} bits/token){' *' if improved else ''}")
            if it >= cfg.max_iters:
                break

            t0 = time.perf_counter()
            torch.manual_seed(step_seed(cfg.seed, rank, it))  # this step's dropout masks
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
                    log(record)
            if stop.signum is not None:
                bar.close()
                if master:
                    checkpoint(it, None)
                    print(f"stopped by {signal.Signals(stop.signum).name} at iteration {it}; saved "
                          f"{out_dir / 'ckpt.pt'} (continue with --init_from=resume)")
                return 128 + stop.signum
    bar.close()
    if master:
        median = sorted(step_ms)[len(step_ms) // 2] if step_ms else 0.0
        print(f"done: {it} iterations, best val loss {best_val:.4f}, median {median:.1f} ms/iter; "
              f"checkpoints in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
