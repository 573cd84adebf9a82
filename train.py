"""Trains a GPT on data written by prepare.py.

    python train.py config/shakespeare_char_cpu.toml
    python train.py config/shakespeare_char.toml --compile=true --max_iters=2000
    torchrun --standalone --nproc_per_node=4 train.py config/shakespeare_char.toml

Writes OUT_DIR/ckpt.pt (the latest state, to resume from), OUT_DIR/best.pt
(the lowest val loss so far) and OUT_DIR/log.jsonl (one line per logged step).
"""

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
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
from model import GPT, GPTConfig
from prepare import open_split, read_meta

CHECKPOINT_FORMAT = 1
# Dense bf16 tensor-core peaks, for MFU. A device not listed gets no MFU figure.
PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "L4": 121e12, "A10": 125e12, "4090": 165e12}


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = option("data/shakespeare_char", "directory written by prepare.py")
    out_dir: str = option("out", "where checkpoints and log.jsonl go")
    init_from: str = option("scratch", "'scratch' for a new model, 'resume' to continue out_dir/ckpt.pt")
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
    pos: str = option("learned", "position encoding: learned, sinusoidal or none")
    tie_weights: bool = option(True, "output head shares the token embedding matrix")
    fused_attention: bool = option(True, "use F.scaled_dot_product_attention (False: the written-out math)")
    # optimization
    batch_size: int = option(64, "sequences per micro-batch")
    grad_accum: int = option(1, "micro-batches per optimizer step, split across processes")
    max_iters: int = option(5000, "optimizer steps in the whole run")
    learning_rate: float = option(1e-3, "peak learning rate, reached after warmup")
    min_lr: float = option(1e-4, "learning rate at the end of the cosine decay")
    warmup_iters: int = option(100, "steps of linear warmup from 0")
    lr_decay_iters: int = option(0, "step where cosine decay reaches min_lr (0: max_iters)")
    weight_decay: float = option(0.1, "AdamW weight decay, on weight matrices only")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.99, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the gradient norm to this (0: no clipping)")
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


def pick_device(name):
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pick_dtype(name, device_type):
    if name == "auto":
        if device_type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32  # bf16 and fp16 matmuls on CPUs are mostly far slower than fp32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise UserError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return dtypes[name]


def model_config(cfg, vocab_size):
    names = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size"}
    try:
        return GPTConfig(vocab_size=vocab_size, **{n: getattr(cfg, n) for n in names})
    except ValueError as e:
        raise UserError(f"model config: {e}") from None


def configure_optimizer(model, cfg, device_type):
    # Decay every matrix, embeddings included: with tied weights the token embedding
    # is also the output head, and exempting it would exempt the largest matrix.
    # Biases and LayerNorm gains are not decayed: they set scales and offsets.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device_type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)


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


def maybe_compile(model, device_type):
    """torch.compile where a compiler toolchain exists for the device, else eager."""
    if device_type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        print("warning: --compile needs a C++ compiler on CPU and none was found; running uncompiled")
        return model
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            print("warning: --compile needs triton on CUDA and it is not installed; running uncompiled")
            return model
    if device_type == "mps":
        print("warning: --compile is not supported on mps here; running uncompiled")
        return model
    return torch.compile(model)


# --- Data ---------------------------------------------------------------------------------


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


# --- Checkpoints ------------------------------------------------------------------------------


def save_checkpoint(state, path):
    """Writes to a temporary file in the same directory, fsyncs, then renames over
    path, so a crash at any moment leaves the previous checkpoint or the new one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path, device="cpu"):
    """A checkpoint's dict. weights_only=True: tensors and plain data, never code."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; train one first: python train.py config/NAME.toml")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # torch raises many types for a bad file; all mean the same here
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path} is not a readable checkpoint ({first_line[:200]}); "
                        "it may be truncated or not a checkpoint: retrain, or use best.pt") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"{path} is not a checkpoint written by train.py")
    if ckpt.get("format", 0) > CHECKPOINT_FORMAT:
        raise UserError(f"{path} has checkpoint format {ckpt['format']}, newer than this code "
                        f"({CHECKPOINT_FORMAT}); update the code to read it")
    return ckpt


def rng_state(data_state):
    """All random state, with data_state the data sampler's before its next batch."""
    state = {"python": random.getstate(), "numpy_data": data_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    # Python's state holds 128-bit ints and tuples: keep them as JSON text, so the
    # checkpoint stays plain data that weights_only loading accepts.
    return {**state, "python": json.dumps(state["python"]), "numpy_data": json.dumps(state["numpy_data"])}


def set_rng_state(state, data_rng):
    version, internal, gauss = json.loads(state["python"])
    random.setstate((version, tuple(internal), gauss))
    data_rng.bit_generator.state = json.loads(state["numpy_data"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- The run ---------------------------------------------------------------------------------


class StopRequested:
    """Turns SIGINT/SIGTERM into a flag: the loop finishes its step and saves."""

    def __init__(self):
        self.signum = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.handle)

    def handle(self, signum, frame):
        self.signum = signum


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
    if cfg.grad_accum % world != 0:
        raise UserError(f"grad_accum ({cfg.grad_accum}) must be a multiple of the number of processes ({world})")
    accum = cfg.grad_accum // world
    if cfg.init_from not in ("scratch", "resume"):
        raise UserError(f"init_from must be 'scratch' or 'resume', got {cfg.init_from!r}")

    meta = read_meta(cfg.data_dir)
    splits = {split: open_split(cfg.data_dir, split, meta) for split in ("train", "val")}
    for split, data in splits.items():
        if len(data) <= cfg.block_size:
            raise UserError(f"the {split} split of {cfg.data_dir} has {len(data)} tokens, not more than "
                            f"block_size {cfg.block_size}; lower --block_size or prepare a longer text")

    out_dir = Path(cfg.out_dir)
    ckpt = None
    if cfg.init_from == "resume":
        ckpt = load_checkpoint(out_dir / "ckpt.pt", device)
    if master:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / ".write_test").touch()
            (out_dir / ".write_test").unlink()
        except OSError as e:
            raise UserError(f"cannot write to out_dir {out_dir} ({e.strerror}); pick another --out_dir") from None

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    data_rng = np.random.default_rng(cfg.seed + rank)  # each process draws its own batches
    mconf = model_config(cfg, meta["vocab_size"])
    model = GPT(mconf).to(device)
    optimizer = configure_optimizer(model, cfg, device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == torch.float16))
    start_iter, best_val = 0, float("inf")
    if ckpt is not None:
        if ckpt["model_config"] != dataclasses.asdict(mconf):
            diff = {k: (v, ckpt["model_config"].get(k)) for k, v in dataclasses.asdict(mconf).items()
                    if ckpt["model_config"].get(k) != v}
            raise UserError(f"cannot resume {out_dir / 'ckpt.pt'}: model config differs (now, checkpoint): {diff}")
        if ckpt["meta"].get("vocab") != meta.get("vocab") or ckpt["meta"].get("tokenizer") != meta.get("tokenizer"):
            raise UserError(f"cannot resume {out_dir / 'ckpt.pt'}: its tokenizer differs from {cfg.data_dir}'s")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_iter, best_val = ckpt["iter"], ckpt["best_val_loss"]
        set_rng_state(ckpt["rng"], data_rng)
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
    tokens_per_iter = cfg.batch_size * cfg.block_size * cfg.grad_accum
    flops = flops_per_token(raw_model, cfg)
    peak = next((v for k, v in PEAK_FLOPS.items() if device_type == "cuda" and k in torch.cuda.get_device_name()), None)
    if master:
        print(f"{raw_model.num_params():,} parameters, {tokens_per_iter:,} tokens per step, "
              f"{world} process(es) on {device}, {str(dtype).removeprefix('torch.')}")

    def log(record):
        with open(out_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def checkpoint(it, val_loss):
        state = {"format": CHECKPOINT_FORMAT, "model": raw_model.state_dict(),
                 "model_config": dataclasses.asdict(mconf), "train_config": dataclasses.asdict(cfg),
                 "meta": meta, "iter": it, "best_val_loss": best_val, "val_loss": val_loss,
                 "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "rng": rng_state(data_state)}
        save_checkpoint(state, out_dir / "ckpt.pt")
        return state

    stop = StopRequested()
    bar = tqdm(total=cfg.max_iters, initial=start_iter, disable=not master or None, dynamic_ncols=True)
    # The sampler's state before the batch the next step starts with: resuming from
    # it draws the same batches an uninterrupted run would.
    data_state = data_rng.bit_generator.state
    x, y = get_batch(splits["train"], cfg.batch_size, cfg.block_size, data_rng, device)
    step_ms = []
    it = start_iter
    while True:
        lr = get_lr(it, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        resumed_here = it == start_iter and start_iter > 0
        if master and (it % cfg.eval_interval == 0 or it == cfg.max_iters) and not resumed_here:
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
        for micro in range(accum):
            sync = micro == accum - 1 or world == 1
            with (contextlib.nullcontext() if sync else model.no_sync()), autocast:
                _, loss = model(x, y)
                loss = loss / accum
            # Draw the next batch while the device works on this one.
            data_state = data_rng.bit_generator.state
            x, y = get_batch(splits["train"], cfg.batch_size, cfg.block_size, data_rng, device)
            scaler.scale(loss).backward()
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item() * accum  # the .item() waits for the device: timing is honest
        step_ms.append((time.perf_counter() - t0) * 1000)
        it += 1

        # fp16's GradScaler skips steps whose gradients overflow; that is not a failure.
        # A non-finite loss is: every step after it would be garbage.
        if not math.isfinite(loss_value):
            raise UserError(f"loss is {loss_value} at iteration {it}; the last good checkpoint is kept in "
                            f"{out_dir}. Try a lower --learning_rate, or bfloat16 instead of float16")
        if master:
            tok_s = tokens_per_iter / (step_ms[-1] / 1000)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
            if it % cfg.log_interval == 0:
                record = {"iter": it, "loss": loss_value, "lr": lr, "ms_per_iter": step_ms[-1], "tokens_per_s": tok_s}
                if peak:
                    record["mfu"] = flops * tok_s / peak
                log(record)
        if stop.signum is not None:
            if master:
                checkpoint(it, None)
                print(f"\nstopped by signal at iteration {it}; saved {out_dir / 'ckpt.pt'} "
                      f"(continue with --init_from=resume)")
            return 128 + stop.signum
    bar.close()
    if master:
        median = sorted(step_ms)[len(step_ms) // 2] if step_ms else 0.0
        print(f"done: {it} iterations, best val loss {best_val:.4f}, median {median:.1f} ms/iter; "
              f"checkpoints in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
