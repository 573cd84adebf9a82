"""Trains a GPT on data written by prepare.py.

    python train.py --data_dir=data/notes_char        # what is auto: chosen for the text and 5 minutes
    python train.py config/shakespeare_char_cpu.toml --max_iters=500
    python train.py config/finetune_shakespeare_gpt2.toml   # fine-tuning (tinygpt/weights.py)
    torchrun --standalone --nproc_per_node=4 train.py config/shakespeare_char.toml

Writes OUT_DIR/ckpt.pt (the latest state, to resume from), OUT_DIR/best.pt (the lowest val loss)
and OUT_DIR/log.jsonl. Read it from main(): the settings, the start, the loop.
"""

import contextlib
import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from config import AUTO, UserError, load_config, option
from model import GELUS, GPT, MIXERS, POSITIONS, SCORES, GPTConfig
from tinygpt import budget, files, optim, score, system, weights

# Under torchrun the processes agree on the clock and on stopping every 10 steps: after each step
# cost 3-7% of a CPU step with 2 processes, every 10 steps 0-1% (bench/agreement.py).
AGREE_EVERY = 10


@dataclasses.dataclass
class TrainConfig:
    # data and output
    data_dir: str = option("data/shakespeare_char", "what prepare.py wrote")
    out_dir: str = option("", "checkpoints and log (empty: out/NAME for data/NAME)")
    init_from: str = option("scratch", "scratch, resume (out_dir's run), or weights to fine-tune")
    overwrite: bool = option(False, "replace the run in out_dir")
    # the model (model.py); auto: chosen for the data and the time (tinygpt/budget.py)
    n_layer: int = option(AUTO, "blocks", low=0)
    n_head: int = option(AUTO, "attention heads", low=1)
    n_embd: int = option(AUTO, "width of the residual stream", low=1)
    block_size: int = option(AUTO, "context length", low=1)
    dropout: float = option(AUTO, "dropout probability", low=0, below=1)
    bias: bool = option(False, "biases in Linear and LayerNorm")
    mixer: str = option("multihead", "how positions talk", choices=MIXERS)
    feedforward: bool = option(True, "an MLP in each block")
    residual: bool = option(True, "residual connections")
    layernorm: bool = option(True, "pre-norm LayerNorm")
    pos: str = option(AUTO, "position encoding", choices=POSITIONS)
    tie_weights: bool = option(True, "output head = token embedding")
    fused_attention: bool = option(True, "PyTorch's attention kernel")
    gelu: str = option("exact", "GELU (tanh: GPT-2's)", choices=GELUS)
    score: str = option("dot", "how a query scores a key", choices=SCORES)
    window: int = option(0, "keys each query sees (0: all)", low=0)
    # optimization: the schedule runs on progress, steps of max_iters or seconds of max_time
    batch_size: int = option(AUTO, "sequences per micro-batch", low=1)
    grad_accum: int = option(1, "micro-batches per step", low=1)
    max_iters: int = option(AUTO, "optimizer steps (auto: what max_time allows)", low=0)
    max_time: str = option(AUTO, "90s, 5m, 2h or none (auto: 5m if max_iters is auto)")
    optimizer: str = option(AUTO, "muon: Muon for block matrices", choices=("adamw", "muon"))
    learning_rate: float = option(1.5e-3, "peak learning rate", above=0)
    min_lr: float = option(0.0, "learning rate at the end", low=0)
    warmup: float = option(0.03, "share of the run warming up", low=0, below=1)
    weight_decay: float = option(0.1, "AdamW's weight decay", low=0)
    beta1: float = option(0.9, "AdamW's beta1", low=0, below=1)
    beta2: float = option(0.99, "AdamW's beta2", low=0, below=1)
    grad_clip: float = option(1.0, "gradient norm clip (0: none)", low=0)
    muon_lr: float = option(0.015, "Muon's peak learning rate", above=0)
    muon_momentum: float = option(0.9, "Muon's momentum", low=0, below=1)
    muon_ns_steps: int = option(5, "Muon's Newton-Schulz steps", low=1)
    muon_weight_decay: float = option(AUTO, "Muon's (auto: 0.1 without dropout)", low=0)
    # evaluation and logging
    patience: int = option(5, "evaluations not better, then stop (0: never)", low=0)
    eval_interval: int = option(250, "steps between evaluations (timed: tenths)", low=1)
    eval_iters: int = option(AUTO, "batches per loss estimate (0: all of val)", low=0)
    log_interval: int = option(10, "steps between log records", low=1)
    log_to: str = option("", "trackers that get them too: tensorboard, wandb")
    wandb_project: str = option("tinygpt", "W&B project (--log_to=wandb)")
    wandb_run_name: str = option("", "W&B run name (empty: out_dir's name)")
    # system
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = option(AUTO, "bf16 where fast, else fp16 on GPUs, fp32", choices=(AUTO, *system.DTYPES))
    compile: bool = option(False, "torch.compile the model")
    seed: int = option(1337, "random seed", low=0, high=2**63 - 1)
    dry_run: bool = option(False, "say the run, then stop: nothing trained or written")


@system.cli
def main(argv):
    cfg = load_config(TrainConfig, argv, "train.py", __doc__)
    cfg = dataclasses.replace(cfg, out_dir=cfg.out_dir or f"out/{Path(cfg.data_dir).name}")
    for name in ("data_dir", "out_dir"):
        files.check_path(getattr(cfg, name), f"--{name}", directory=True)
    ckpt = None
    if cfg.init_from == "resume":  # its own settings, under the command line's
        ckpt = files.load_checkpoint(saved(cfg), choosing=False)
        cfg = load_config(TrainConfig, argv, base=ckpt["train_config"] | {"out_dir": cfg.out_dir})
        cfg = dataclasses.replace(cfg, init_from=ckpt["train_config"]["init_from"])  # how it began
    files.check_trackers(cfg.log_to)
    with system.start_processes(cfg.device) as procs, files.RunLock(cfg.out_dir) as lock:
        if not Path(cfg.data_dir, "meta.json").exists() and not cfg.dry_run:
            import prepare  # only here: what a fresh clone lacks

            prepare.make_default(cfg.data_dir, procs.world)
        # Ctrl-C, SIGTERM, SIGHUP: the step ends, saves, exits
        with system.Stop() as stop:
            run = set_up(cfg, procs, lock, ckpt)
            return 0 if cfg.dry_run else train(run, stop)


# --- Setting up ------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """What the loop reads and changes. model is what a step runs: raw_model (what a checkpoint
    saves), compiled and under DDP where asked. The loop's state: its steps taken, the best val
    loss, evaluations in a row without one, the progress of the next evaluation, and a timed run's
    clock (its seconds spent of its seconds; inf: not timed)."""

    cfg: TrainConfig
    procs: system.Processes
    meta: dict
    splits: dict
    raw_model: GPT
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: object
    eval_autocast: object
    model: torch.nn.Module = None
    it: int = 0
    best_val: float = math.inf
    bad_evals: int = 0
    next_eval: float = 0.0
    spent: float = 0.0
    seconds: float = math.inf
    wandb_id: str | None = None
    trackers: object = None
    bad: str = ""


def set_up(cfg, procs, lock, ckpt):
    """The run at its first step: out_dir locked, the start taken (scratch, resume from ckpt, or
    fine-tune), what is auto chosen, the model built with its optimizer."""
    # A mistake one process meets (rank 0 alone writes) ends them all.
    with procs.fail_together():
        if procs.master and not cfg.dry_run:
            lock.acquire()
        meta, splits = data = files.load_data(cfg.data_dir)
        pretrained = None
        if cfg.init_from != "scratch" and not ckpt:  # fine-tuning: the shape is the weights'
            pretrained = weights.load_weights(cfg.init_from, cfg.out_dir)
            cfg = weights.finetune_settings(pretrained, cfg, meta)
        if not ckpt and saved(cfg).exists() and not cfg.overwrite:
            raise UserError(f"{saved(cfg)} exists; continue it with --init_from=resume, start over "
                            "with --overwrite=true, or pick another --out_dir")
        dtype = system.pick_dtype(cfg.dtype, procs.device_type, training=True)
        cfg = dataclasses.replace(cfg, dtype=system.NAMES[dtype])
    if AUTO in (getattr(cfg, k) for k in budget.CHOSEN):  # chosen for the data and the time
        sizes = len(splits["train"]), len(splits["val"]), meta["vocab_size"]
        timed = lambda c: measure(c, data, procs)  # noqa: E731
        age = lambda: procs.broadcast((system.process_age(),))[0]  # noqa: E731  rank 0's clock
        longest = pretrained.longest() if pretrained else math.inf
        cfg, chosen = budget.fill_auto(cfg, sizes, timed, procs.world, age, longest)
        procs.say(chosen)
    seconds = cfg.max_time != AUTO and budget.parse_duration(cfg.max_time)
    if seconds and not ckpt:  # a new timed run has what is left of its time, by rank 0's clock
        seconds = budget.USABLE * seconds - procs.broadcast((system.process_age(),))[0]
        if seconds <= 0:
            raise UserError(f"max_time {cfg.max_time} is spent before the run starts "
                            f"({-seconds:.1f} s over); give more time")
    with procs.fail_together():
        run = build(cfg, data, procs)
        run.seconds = seconds or math.inf
        if pretrained:
            procs.say(weights.load_into(run.raw_model, pretrained, meta))
        if ckpt:
            weights.restore(ckpt, run)
            procs.say(f"resuming {saved(cfg)} at iteration {run.it}")
        if procs.master and not cfg.dry_run:
            files.start_log(cfg.out_dir, run.it)
    compiled = system.maybe_compile(run.raw_model, procs.device_type) if cfg.compile else run.raw_model
    run.model = procs.wrap(compiled)
    procs.say(f"{run.raw_model.num_params():,} params, {tokens_per_step(cfg, procs):,} tokens/step "
              f"({cfg.batch_size} x {cfg.block_size} a micro-batch); {procs.device} {cfg.dtype}")
    if cfg.dry_run:
        procs.say(f"to train it: {budget.repeat_command(cfg, world=procs.world)}")
        procs.say("dry run: nothing trained or written")
    return run


def build(cfg, data, procs):
    """A new Run of cfg on procs.device, once the data holds more than a block, the switches go
    together and training fits in memory: the model, seeded, and its optimizer."""
    meta, splits = data
    files.check_block_size(splits, cfg.block_size, cfg.data_dir)
    mconf, dtype = model_config(cfg, meta["vocab_size"]), system.DTYPES[cfg.dtype]
    system.check_model_fits(mconf, cfg.batch_size, cfg.block_size, procs.device, dtype)
    torch.manual_seed(cfg.seed)
    model = GPT(mconf).to(procs.device)
    optimizer = make_optimizer(model, cfg, procs.device_type)
    scaler = torch.amp.GradScaler(procs.device_type, enabled=dtype == torch.float16)
    autocast = system.autocast(procs.device_type, dtype)
    # Evaluations on a CPU run in fp32: exact, as tinygpt.score scores a text.
    exact = system.autocast(procs.device_type, torch.float32 if procs.device_type == "cpu" else dtype)
    return Run(cfg, procs, meta, splits, model, optimizer, scaler, autocast, exact)


def model_config(cfg, vocab_size):
    """The model for cfg; its embedding padded to a multiple of 64 rows, for speed."""
    shape = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig) if hasattr(cfg, f.name)}
    try:
        return GPTConfig(**shape, vocab_size=-(-vocab_size // 64) * 64, real_vocab_size=vocab_size)
    except ValueError as e:
        raise UserError(f"model config: {e}") from None


def measure(cfg, data, procs):
    """(seconds per step, per forward pass of a batch as evaluations run it) of a new model of cfg
    here, rank 0's on every process: a few of each, timed, for the sizing to choose by."""
    run = build(cfg, data, procs)
    batches = train_batches(run.splits["train"], cfg, procs.rank, 0, procs.device)
    x, y = next(batches)
    step = lambda: train_step(run.raw_model, run.optimizer, run.scaler, run.autocast, cfg, x, y, batches)  # noqa: E731
    one = {"val": run.splits["val"]}, dataclasses.replace(cfg, eval_iters=1), procs.device, run.eval_autocast
    evaluation = lambda: estimate_loss(run.raw_model, *one)  # noqa: E731  one batch, as evaluations run
    step_s = budget.time_per_call(step, min_seconds=0.5)
    return procs.broadcast((step_s, budget.time_per_call(evaluation, min_seconds=0, warmup=1)))


def saved(cfg, name="ckpt.pt"):
    """ckpt.pt: the latest state; best.pt: the lowest val loss."""
    return Path(cfg.out_dir) / name


def tokens_per_step(cfg, procs):
    return cfg.batch_size * cfg.grad_accum * procs.world * cfg.block_size


# --- The loop --------------------------------------------------------------------------------


def train(run, stop):
    """The loop: the learning rate; an evaluation and checkpoint when due; forward and backward
    over the micro-batches; clip; step; log. Returns the exit code."""
    cfg, procs = run.cfg, run.procs
    batches = train_batches(run.splits["train"], cfg, procs.rank, run.it, procs.device)
    x, y = next(batches)
    stop.model, loss = run.raw_model, 0.0
    # The clock's zero: a resumed run goes on from its own.
    clock = system.process_age() - run.spent
    bar = tqdm(total=cfg.max_iters, initial=run.it, disable=not procs.master or None)
    with files.open_trackers(run) as run.trackers, bar:
        while True:
            steps = run.it / cfg.max_iters if cfg.max_iters else 1.0  # --max_iters=0: an evaluation alone
            progress = min(1.0, max(steps, run.spent / run.seconds))
            lr = get_lr(progress, cfg)
            for group in run.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            if progress >= run.next_eval:
                with procs.fail_together():  # a full disk under rank 0's checkpoint ends them all
                    evaluate(run, lr, progress)
            signum = agree(run, stop, loss, clock)
            if signum or progress >= 1 or 0 < cfg.patience <= run.bad_evals:
                break
            if cfg.dropout > 0:  # this step's dropout masks
                torch.manual_seed(step_seed(cfg.seed, procs.rank, run.it))
            t0 = time.perf_counter()
            loss, x, y = train_step(run.model, run.optimizer, run.scaler, run.autocast, cfg, x, y, batches)
            run.it += 1
            log_step(run, loss, lr, time.perf_counter() - t0, bar)
    return finish(run, signum)


def get_lr(progress, cfg):
    """At progress in [0, 1] (steps, or seconds, done of the run's): a linear warmup over its
    first `warmup` share, then a cosine decay to min_lr at its end. An optimizer group's lr_scale
    (Muon's) scales it to its own peak."""
    if progress < cfg.warmup:  # counted in steps from 1, as nanoGPT's: the first step learns too
        return cfg.learning_rate * (progress * cfg.max_iters + 1) / (cfg.warmup * cfg.max_iters + 1)
    decay = (progress - cfg.warmup) / (1 - cfg.warmup)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * decay)) * (cfg.learning_rate - cfg.min_lr)


def agree(run, stop, loss, clock):
    """What the processes decide together, alone after each step and under torchrun every
    AGREE_EVERY: the clock is rank 0's, and a signal to any process, or a loss gone non-finite on
    any, stops them all. Returns the signal, or 0."""
    if not math.isfinite(loss):
        run.bad = run.bad or f"{loss} at iteration {run.it}"
    if run.procs.world > 1 and run.it % AGREE_EVERY:
        return 0
    mine = (system.process_age() - clock if run.procs.master else 0.0, stop.signum or 0, bool(run.bad))
    run.spent, signum, bad = run.procs.all_max(mine)
    if bad:
        raise UserError(f"loss is {run.bad or f'not finite on another process by iteration {run.it}'}; "
                        f"the last good checkpoint is kept in {run.cfg.out_dir}. Try a lower "
                        "--learning_rate, or bfloat16 instead of float16")
    return int(signum)


def evaluate(run, lr, progress):
    """Estimates the losses (the same batches each time: a change is the model's) on every process,
    which all decide alike; rank 0 logs them and saves ckpt.pt, and best.pt when val improved. A
    stop signal ends it between two batches, and weights whose loss is not finite, unsaved."""
    model = getattr(run.model, "module", run.model)  # never under DDP
    try:
        losses = estimate_loss(model, run.splits, run.cfg, run.procs.device, run.eval_autocast)
    except system.Stopped:
        return model.train()
    if run.seconds < math.inf:  # at the next tenth of a timed run's time
        run.next_eval = (math.floor(progress * budget.EVALS) + 1) / budget.EVALS
    else:  # after eval_interval more steps; at the end, at the latest
        every, steps = run.cfg.eval_interval, max(1, run.cfg.max_iters)
        run.next_eval = min(steps, (run.it // every + 1) * every) / steps
    val = losses["val"]
    if not math.isfinite(val):
        return
    improved = val < run.best_val
    run.best_val, run.bad_evals = min(run.best_val, val), 0 if improved else run.bad_evals + 1
    if run.procs.master:
        record = {"iter": run.it, "train_loss": losses["train"], "val_loss": val, "lr": lr,
                  "val_bpc": val / math.log(2)}
        if run.procs.device_type == "cuda":
            record["peak_memory"] = torch.cuda.max_memory_allocated()
        files.append_record(run.cfg.out_dir, record, run.trackers)
        save_checkpoint(run, val, "ckpt.pt", "best.pt" if improved else None)
        tqdm.write(f"step {run.it}: train {losses['train']:.4f}, val {val:.4f} "
                   f"({record['val_bpc']:.3f} bits/token){' *' * improved}")


def train_step(model, optimizer, scaler, autocast, cfg, x, y, batches):
    """One optimizer step over grad_accum micro-batches, the first (x, y), then from batches (an
    iterator); returns the loss and the next batch, drawn while the device works. Under DDP the
    gradients are averaged across processes on the last micro-batch alone."""
    for micro in range(cfg.grad_accum):
        last = micro == cfg.grad_accum - 1 or not hasattr(model, "no_sync")
        with (contextlib.nullcontext() if last else model.no_sync()), autocast:
            _, loss = model(x, y)
        x, y = next(batches)
        scaler.scale(loss / cfg.grad_accum).backward()
    if cfg.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item(), x, y


def log_step(run, loss, lr, seconds, bar):
    """The bar moves each step; a log record every log_interval."""
    if not run.procs.master or not math.isfinite(loss):
        return
    tok_s = tokens_per_step(run.cfg, run.procs) / seconds
    bar.update(1)
    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
    if run.it % run.cfg.log_interval == 0:
        record = {"iter": run.it, "loss": loss, "lr": lr, "ms_per_iter": 1000 * seconds, "tokens_per_s": tok_s}
        if mfu := system.mfu(run.procs.device_type, run.raw_model, run.cfg, tok_s / run.procs.world):
            record["mfu"] = mfu
        files.append_record(run.cfg.out_dir, record, run.trackers)


def finish(run, signum):
    """The run's last words and its exit code: stopped by a signal (ckpt.pt saved, to continue
    from), stopped early (no better val loss for --patience evaluations), or done; a timed run's
    command to train it again, for its steps."""
    with run.procs.fail_together():
        if run.procs.master and signum:
            save_checkpoint(run, None, "ckpt.pt")
        if run.procs.master and not signum and run.seconds < math.inf:
            command = budget.save_repeat_command(run.cfg, run.it, run.procs.world)
            run.procs.say(f"to train it again: {command}")
    if signum:
        run.procs.say(f"stopped by {system.signal_name(signum)} at iteration {run.it}; saved "
                      f"{saved(run.cfg)} (continue with --init_from=resume)")
        return 128 + signum
    if 0 < run.cfg.patience <= run.bad_evals:
        run.procs.say(f"stopped early at iteration {run.it}: val loss has not improved for "
                      f"{run.bad_evals} evaluations (--patience={run.cfg.patience}); the best "
                      f"model is in {saved(run.cfg, 'best.pt')}")
    run.procs.say(f"done: {run.it} iterations, best val {run.best_val:.4f}; in {run.cfg.out_dir}")
    return 0


# --- A step's parts: batches, the loss estimate, the optimizer, the checkpoint -------------------


def get_batch(data, batch_size, block_size, rng, device_name):
    """batch_size windows of data at random: x (B, T), and y (B, T), each position's next token.
    On a GPU from pinned memory: copied while the GPU works."""
    starts = rng.integers(0, len(data) - block_size, size=batch_size)
    xy = torch.from_numpy(np.stack([data[s : s + block_size + 1] for s in starts]).astype(np.int64))
    if device_name.startswith("cuda"):
        xy = xy.pin_memory().to(device_name, non_blocking=True)
    xy = xy.to(device_name)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def train_batches(data, cfg, rank, it, device_name):
    """One process's batches, grad_accum a step, from step it on, each step's from its own seed: a
    resumed run, on any number of processes, draws what an uninterrupted one would."""
    while True:
        rng = np.random.default_rng(step_seed(cfg.seed, rank, it))
        for _ in range(cfg.grad_accum):
            yield get_batch(data, cfg.batch_size, cfg.block_size, rng, device_name)
        it += 1


def step_seed(seed, rank, it):
    """The seed of step it on process rank: of its batches and dropout masks."""
    return int(np.random.SeedSequence((seed, rank, it)).generate_state(1)[0])


@torch.no_grad()
def estimate_loss(model, splits, cfg, device_name, autocast):
    """Mean loss per split: over eval_iters random batches, the same each time; or with eval_iters 0
    over every token of val (as python -m tinygpt.score scores a file), and as many of train."""
    model.eval()
    out = {}
    for name, data in splits.items():
        if cfg.eval_iters == 0:
            out[name] = score.mean_loss(model, data[: len(splits["val"])], cfg.block_size,
                                        4 * cfg.batch_size, device_name, autocast)
            continue
        rng = np.random.default_rng(cfg.seed)
        batches = (get_batch(data, cfg.batch_size, cfg.block_size, rng, device_name)
                   for _ in range(cfg.eval_iters))
        with autocast:
            out[name] = sum(model(x, y)[1].item() for x, y in batches) / cfg.eval_iters
    model.train()
    return out


def make_optimizer(model, cfg, device_type):
    """AdamW, or (muon) Muon for the matrices inside the blocks and AdamW for the rest. AdamW decays
    every matrix (the embedding is the output head too) and no bias or gain, which set scales and
    offsets. Its fused kernel updates every tensor in one pass: on a CPU a third of the per-tensor
    loop's time."""
    named = list(model.named_parameters())
    muon = [p for n, p in named if cfg.optimizer == "muon" and n.startswith("blocks.") and p.dim() == 2]
    rest = [p for _, p in named if all(p is not m for m in muon)]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                              fused=device_type != "mps")
    return optim.Optimizers(adamw, optim.muon(muon, cfg)) if muon else adamw


def save_checkpoint(run, val_loss, *names):
    """What ckpt.pt holds after step run.it, in tensors and plain data (enough to resume exactly, or
    sample), saved as each of names; val_loss: that step's evaluation, or None (saved on a signal).
    Each file is written whole or not at all: a crash leaves the previous checkpoint or the new one.
    """
    state = {"format": files.CHECKPOINT_FORMAT, "model": run.raw_model.state_dict(),
             "model_config": dataclasses.asdict(run.raw_model.config),
             "train_config": dataclasses.asdict(run.cfg), "meta": run.meta, "val_loss": val_loss,
             "iter": run.it, "best_val_loss": run.best_val, "bad_evals": run.bad_evals,
             "next_eval": run.next_eval, "spent": run.spent, "seconds": run.seconds,
             "optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict(),
             "wandb_run_id": getattr(run.trackers, "wandb_id", run.wandb_id)}
    for path in (saved(run.cfg, name) for name in names if name):
        try:
            files.write_atomic(path, lambda f: torch.save(state, f))
        except OSError as e:
            then = ("the previous checkpoint is kept: free some space and continue with "
                    "--init_from=resume" if path.exists() else "nothing was saved: free some space")
            raise UserError(f"{files.write_error(path, e)}; {then}") from None


if __name__ == "__main__":
    raise SystemExit(main())
