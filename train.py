"""Trains a GPT on data written by prepare.py.

    python train.py --data_dir=data/notes_char               # no preset: sized for the text and 5 minutes
    python train.py config/shakespeare_char_cpu.toml --max_iters=500
    python train.py config/finetune_shakespeare_gpt2.toml   # fine-tuning: --init_from (tinygpt/weights.py)
    torchrun --standalone --nproc_per_node=4 train.py config/shakespeare_char.toml

Writes OUT_DIR/ckpt.pt (the latest state, to resume from), OUT_DIR/best.pt (the lowest val loss) and
OUT_DIR/log.jsonl. Read it from main(): the settings, the run set up, the loop, then each step's parts.
"""

# First: Ctrl-C while torch loads (seconds) is then one line, not a traceback.
from tinygpt import system  # isort: skip
import contextlib
import dataclasses
import functools
import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from config import UserError, load_config, option
from model import GELUS, GPT, MIXERS, POSITIONS, SCORES, GPTConfig
from tinygpt import budget, dataset, device, files, optim, weights

# How often the processes under torchrun agree to stop (a signal to one, a non-finite loss on one): an
# agreement after each step cost 3-7% of a CPU step with 2 processes; every 10 steps, 0-1% (bench/agreement.py).
AGREE_EVERY = 10
DTYPES = ("auto", *device.DTYPES)


@dataclasses.dataclass
class TrainConfig:
    # data and output
    data_dir: str = option("data/shakespeare_char", "what prepare.py wrote")
    out_dir: str = option("", "checkpoints and log (empty: out/NAME for data/NAME)")
    init_from: str = option("scratch", "scratch, resume, a checkpoint, or gpt2[-xl]")
    overwrite: bool = option(False, "replace the checkpoint in out_dir")
    # model (GPTConfig in model.py)
    n_layer: int = option(6, "transformer blocks", low=0)
    n_head: int = option(6, "attention heads", low=1)
    n_embd: int = option(384, "residual stream width", low=1)
    block_size: int = option(256, "context length", low=1)
    dropout: float = option(0.2, "dropout probability", low=0, below=1)
    bias: bool = option(False, "biases in Linear and LayerNorm")
    mixer: str = option("multihead", "how positions talk", choices=MIXERS)
    feedforward: bool = option(True, "an MLP in each block")
    residual: bool = option(True, "residual connections")
    layernorm: bool = option(True, "pre-norm LayerNorm")
    pos: str = option("learned", "position encoding", choices=POSITIONS)
    tie_weights: bool = option(True, "output head = token embedding")
    fused_attention: bool = option(True, "PyTorch's attention kernel")
    gelu: str = option("exact", "GELU (tanh: GPT-2's)", choices=GELUS)
    score: str = option("dot", "how a query scores a key", choices=SCORES)
    window: int = option(0, "keys each query sees (0: all)", low=0)
    # optimization
    batch_size: int = option(64, "sequences per micro-batch", low=1)
    grad_accum: int = option(1, "micro-batches per step", low=1)
    max_iters: int = option(5000, "optimizer steps", low=0)
    learning_rate: float = option(1e-3, "peak learning rate", above=0)
    min_lr: float = option(1e-4, "final learning rate", low=0)
    warmup_iters: int = option(100, "warmup steps", low=0)
    lr_decay_iters: int = option(0, "decay steps (0: max_iters)", low=0)
    weight_decay: float = option(0.1, "AdamW's weight decay", low=0)
    beta1: float = option(0.9, "AdamW's beta1", low=0, below=1)
    beta2: float = option(0.99, "AdamW's beta2", low=0, below=1)
    grad_clip: float = option(1.0, "gradient norm clip (0: none)", low=0)
    optimizer: str = option("adamw", "muon: Muon for block matrices", choices=("adamw", "muon"))
    muon_lr: float = option(0.01, "Muon's learning rate", above=0)
    muon_momentum: float = option(0.95, "Muon's momentum", low=0, below=1)
    muon_ns_steps: int = option(5, "Muon's Newton-Schulz steps", low=1)
    muon_weight_decay: float = option(0.0, "Muon's weight decay", low=0)
    # evaluation and logging
    max_time: str = option("", "a time to fit the run to: 90s, 5m, 2h")
    patience: int = option(5, "evaluations with no better val loss, then stop (0: never)", low=0)
    eval_interval: int = option(250, "steps between evaluations", low=1)
    eval_iters: int = option(200, "batches per loss estimate (0: all of val)", low=0)
    log_interval: int = option(10, "steps between log records", low=1)
    log_to: str = option("", "trackers that get the log records too: tensorboard, wandb, or tensorboard,wandb")
    wandb_project: str = option("tinygpt", "W&B project (--log_to=wandb)")
    wandb_run_name: str = option("", "W&B run name (empty: out_dir's name)")
    # system
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = option("auto", "auto: bf16 where fast, else fp16 on GPUs, fp32", choices=DTYPES)
    compile: bool = option(False, "torch.compile the model")
    seed: int = option(1337, "random seed", low=0, high=2**63 - 1)
    dry_run: bool = option(False, "say the run and its plan, then stop: nothing trained or written")


@system.cli
def main(argv):
    sources = {}  # each setting's preset, or "command line"
    cfg = load_config(TrainConfig, argv, "train.py", __doc__, sources=sources)
    cfg = dataclasses.replace(cfg, out_dir=files.run_out_dir(cfg, sources),
                              log_to=cfg.log_to and files.check_trackers(cfg.log_to))  # before any write
    procs = device.start_processes(cfg.device)
    if not Path(cfg.data_dir, "meta.json").exists() and not cfg.dry_run:
        import prepare  # only here: what a fresh clone lacks

        prepare.make_default(cfg.data_dir, procs.world)
    lock, status = files.RunLock(cfg.out_dir), None
    try:
        with system.Stop() as stop:  # Ctrl-C, SIGTERM, SIGHUP
            run = set_up(cfg, sources, procs, lock)
            status = budget.preview(run.cfg, procs.say) if cfg.dry_run else train(run, stop)
        return status
    except UserError:
        status = 2  # met by every process together (Processes.fail_together)
        raise
    finally:
        lock.release()
        device.end_processes(finished=status is not None)


# --- Setting up ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """What the loop reads and changes. cfg: as decided (a replan changes the steps); meta: the tokenizer; splits:
    the train and val tokens; raw_model: what a checkpoint saves; model: what a step runs, raw_model compiled and
    under DDP where asked; scaler: fp16's loss scaling; it: steps taken; bad_evals: evaluations in a row without
    a new best; evaluated: the step evaluated; eval_autocast: an evaluation's, none on a CPU (fp32: exact)."""

    cfg: TrainConfig
    procs: device.Processes
    meta: dict
    splits: dict
    raw_model: GPT
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    model: torch.nn.Module = None
    time_budget: budget.Budget | None = None
    it: int = 0
    best_val: float = math.inf
    bad_evals: int = 0
    evaluated: int | None = None
    trackers: "files.Trackers | None" = None  # where the records go too (--log_to), on rank 0, in the loop
    wandb_id: str | None = None  # the W&B run it logs to, kept with its checkpoints

    def __post_init__(self):
        self.autocast = device.autocast(self.procs.device_type, device.DTYPES[self.cfg.dtype])
        self.eval_autocast = contextlib.nullcontext() if self.procs.device_type == "cpu" else self.autocast


def set_up(cfg, sources, procs, lock):
    """The run at its first step: out_dir locked, the settings decided, the model built, the steps fitted.
    With a preset the settings are its own; a resumed run keeps those it started with; fine-tuning takes
    the model's shape from its weights; with no preset the model is sized for the data and the time."""
    # A mistake that one process meets ends them all: each block, then all agree.
    with procs.fail_together():
        if procs.master and not cfg.dry_run:
            lock.acquire()  # a run that fails to start changes nothing
        data = dataset.load_data(cfg.data_dir)
    with procs.fail_together():
        fine_tune = cfg.init_from not in ("scratch", "resume")
        pretrained = weights.load_weights(cfg.init_from, cfg.out_dir) if fine_tune else None
        ckpt = files.checkpoint_to_resume(saved(cfg), cfg, procs.device)
        if ckpt is not None:  # a resumed run keeps the settings it started with
            cfg = weights.resumed_config(ckpt, cfg, sources, procs.device_type)
        elif pretrained is not None:  # a fine-tuned one takes the weights' shape
            cfg = weights.finetune_settings(pretrained, cfg, data[0], sources)
        dtype = device.pick_dtype(cfg.dtype, procs.device_type, training=True)
        cfg = dataclasses.replace(cfg, dtype=device.NAMES[dtype])
        preset = any(where != "command line" for where in sources.values())
        timed = ckpt is None and (cfg.max_time or not (preset or "max_iters" in sources))
        sized = ckpt is None and pretrained is None and not (preset or all(k in sources for k in budget.SIZED))
        speeds = budget.Speeds(device.machine(procs.device, dtype), data[0]["vocab_size"]) \
            if (timed or sized) and procs.world == 1 else None  # what this machine timed before
        time_budget = budget.Budget(cfg, sources, speeds) if timed else None
        if sized:  # no preset: the model sized for the data and the time
            measure = lambda c: probe(build(c, data, procs), speeds)  # noqa: E731
            cfg = budget.size_for_data(cfg, sources, data, procs, time_budget, measure)
    with procs.fail_together():
        run = build(cfg, data, procs, pretrained)
        if ckpt is not None:  # checked first: the same model and tokenizer, and steps left
            run.it, run.best_val, run.bad_evals, run.evaluated, run.wandb_id = weights.restore(
                ckpt, cfg, run.raw_model, run.optimizer, run.scaler, run.meta)
            procs.say(f"resuming {saved(cfg)} at iteration {run.it}")
    del pretrained, ckpt  # not twice in memory
    run.model = procs.wrap(device.maybe_compile(run.raw_model, procs.device_type) if cfg.compile else run.raw_model)
    if time_budget is not None:
        with device.peer_lost():  # the probe's steps, under DDP
            step_s, eval_s = probe(run, speeds)
        now = procs.broadcast((budget.process_age(),))[0]
        run.cfg, said = time_budget.fit(run.cfg, step_s, eval_s, now, len(run.splits["val"]))
        run.time_budget = time_budget
        procs.say(said)
    with procs.fail_together():  # the first write
        if procs.master and not cfg.dry_run:
            files.start_log(cfg.out_dir, run.it)
    procs.say(f"{run.raw_model.num_params():,} params, {tokens_per_step(run):,} tokens/step: batch {cfg.batch_size} x "
              f"grad_accum {cfg.grad_accum} x {procs.world} process(es) x {cfg.block_size}; {procs.device} {cfg.dtype}")
    return run


def build(cfg, data, procs, pretrained=None):
    """A new Run of cfg on procs.device, once the data holds more than a block, the switches go together
    and training fits in memory: the model (seeded, or holding the weights to fine-tune), its optimizer."""
    meta, splits = data
    dataset.check_block_size(splits, cfg.block_size, cfg.data_dir)
    mconf = model_config(cfg, meta["vocab_size"])
    device.check_model_fits(mconf, cfg.batch_size, cfg.block_size, procs.device, device.DTYPES[cfg.dtype])
    torch.manual_seed(cfg.seed)
    model = GPT(mconf).to(procs.device)
    if pretrained is not None:
        procs.say(weights.load_into(model, pretrained, meta))
    return Run(cfg, procs, meta, splits, model, make_optimizer(model, cfg, procs.device_type),
               torch.amp.GradScaler(procs.device_type, enabled=cfg.dtype == "float16"), model)


def model_config(cfg, vocab_size):
    """The model for cfg; its embedding is padded past the tokenizer's vocab_size for speed."""
    shape = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig) if hasattr(cfg, f.name)}
    try:
        return GPTConfig(**shape, vocab_size=device.padded_vocab_size(vocab_size), real_vocab_size=vocab_size)
    except ValueError as e:
        raise UserError(f"model config: {e}") from None


def saved(cfg, name="ckpt.pt"):
    """ckpt.pt: the latest state; best.pt: the lowest val loss."""
    return Path(cfg.out_dir) / name


def tokens_per_step(run):
    return run.cfg.batch_size * run.cfg.grad_accum * run.procs.world * run.cfg.block_size


# --- The loop ------------------------------------------------------------------------------------


def train(run, stop):
    """The loop: the learning rate; an evaluation and checkpoint when due; forward and backward over the
    micro-batches; clip; step; log. Returns the exit code."""
    batches = train_batches(run.splits["train"], run.cfg, run.procs.rank, run.it, run.procs.device)
    x, y = next(batches)
    # A timed run's loop times its steps and evaluations, for the budget to fit the steps again as the run goes.
    times = budget.LoopTimes(run.it) if run.time_budget else contextlib.nullcontext()
    signum, bad, stop.model = 0, None, run.raw_model  # a signal or a bad loss ends it
    first, stepped_ms = run.it, 0.0
    with files.open_trackers(run) as run.trackers, \
            tqdm(total=run.cfg.max_iters, initial=run.it, disable=not run.procs.master or None) as bar:
        while True:
            if run.time_budget is not None and (evaluation_due(run) or run.it % AGREE_EVERY == 0):
                replan(run, times, bar)  # may end the run at this step
            lr = get_lr(run.it, run.cfg)
            for group in run.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's: muon_lr's
            if evaluation_due(run):
                with times, run.procs.fail_together():  # a full disk ends every process
                    if run.procs.master:
                        evaluate(run, lr, bar.write)
                run.bad_evals, signum = map(int, run.procs.broadcast((run.bad_evals, stop.signum or 0)))  # rank 0's
            if signum or run.it >= run.cfg.max_iters or 0 < run.cfg.patience <= run.bad_evals:
                break
            t0 = time.perf_counter()
            if run.cfg.dropout > 0:  # this step's dropout masks
                torch.manual_seed(step_seed(run.cfg.seed, run.procs.rank, run.it))
            loss, x, y = train_step(run.model, run.optimizer, run.scaler, run.autocast, run.cfg, x, y, batches)
            step_ms = (time.perf_counter() - t0) * 1000
            run.it, stepped_ms = run.it + 1, stepped_ms + step_ms
            bad = bad if bad is not None or math.isfinite(loss) else f"{loss} at iteration {run.it}"
            log_step(run, loss, lr, step_ms, bar)
            # Every process decides together whether to stop: after each step when alone, else every
            # AGREE_EVERY steps and before each evaluation, so nothing is saved after a non-finite loss.
            if run.procs.world == 1 or run.it % AGREE_EVERY == 0 or evaluation_due(run):
                signum, failed = run.procs.all_max((stop.signum or 0, bad is not None))
                if failed:
                    bad = bad or f"not finite on another process by iteration {run.it}"
                    raise UserError(f"loss is {bad}; the last good checkpoint is kept in {run.cfg.out_dir}. Try a "
                                    "lower --learning_rate, or bfloat16 instead of float16")
                if signum:
                    break
    return finish(run, signum, stepped_ms / max(1, run.it - first))


def evaluation_due(run):
    """Every eval_interval steps, and at the end: once each."""
    return (run.it % run.cfg.eval_interval == 0 or run.it == run.cfg.max_iters) and run.it != run.evaluated


def replan(run, times, bar):
    measured = times.means(run.it)  # the steps fitted again from the loop's own times, rank 0's on every process
    if measured:
        run.cfg, said = run.time_budget.replan(run.cfg, run.it, *run.procs.broadcast(measured))
        bar.total = run.cfg.max_iters
        if said and run.procs.master:
            bar.write(said)


def get_lr(it, cfg):
    """Linear warmup, cosine decay, then min_lr."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return cfg.min_lr
    progress = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def evaluate(run, lr, write):
    """Estimates the losses (the same batches each time: a change is the model's) and logs them; saves
    ckpt.pt, and best.pt when val improved. A stop signal ends it between two batches, with nothing saved."""
    model = getattr(run.model, "module", run.model)  # never under DDP
    try:
        losses = estimate_loss(model, run.splits, run.cfg, run.procs.device, run.eval_autocast)
    except system.Stopped:
        return model.train()
    record = {"iter": run.it, "train_loss": losses["train"], "val_loss": losses["val"], "lr": lr,
              "val_bpc": losses["val"] / math.log(2)}
    if run.procs.device_type == "cuda":
        record["peak_memory"] = torch.cuda.max_memory_allocated()
    files.append_record(run.cfg.out_dir, record, run.trackers)
    improved = losses["val"] < run.best_val
    run.best_val, run.bad_evals = min(run.best_val, losses["val"]), 0 if improved else run.bad_evals + 1
    state = run_state(run, losses["val"])
    save_checkpoint(state, saved(run.cfg))
    if improved:
        save_checkpoint(state, saved(run.cfg, "best.pt"))
    run.evaluated = run.it
    write(f"step {run.it}: train {losses['train']:.4f}, val {losses['val']:.4f} "
          f"({record['val_bpc']:.3f} bits/token){' *' if improved else ''}")


def train_step(model, optimizer, scaler, autocast, cfg, x, y, batches):
    """One optimizer step over cfg.grad_accum micro-batches, the first (x, y), then from batches (an iterator);
    returns the loss and the next batch."""
    for micro in range(cfg.grad_accum):
        # Under DDP, gradients are averaged across processes only on the last micro-step.
        last = micro == cfg.grad_accum - 1 or not hasattr(model, "no_sync")
        with (contextlib.nullcontext() if last else model.no_sync()), autocast:
            _, loss = model(x, y)
        x, y = next(batches)  # drawn while the device works
        scaler.scale(loss / cfg.grad_accum).backward()
    if cfg.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item(), x, y  # .item() waits for the device


def log_step(run, loss, lr, step_ms, bar):
    """The bar moves each step; a log record every log_interval."""
    if not run.procs.master or not math.isfinite(loss):
        return
    tok_s = tokens_per_step(run) / (step_ms / 1000)
    bar.update(1)
    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
    if run.it % run.cfg.log_interval == 0:
        record = {"iter": run.it, "loss": loss, "lr": lr, "ms_per_iter": step_ms, "tokens_per_s": tok_s}
        if mfu := device.mfu(run.procs.device_type, run.raw_model.num_params(), run.cfg, tok_s / run.procs.world):
            record["mfu"] = mfu
        files.append_record(run.cfg.out_dir, record, run.trackers)


def finish(run, signum, ms):
    """The run's last words and its exit code: stopped by a signal (ckpt.pt saved, to continue from),
    stopped early (no better val loss for --patience evaluations), or done; a timed run's repeat.txt. ms: the steps'
    mean (log.jsonl's ms_per_iter)."""
    with run.procs.fail_together():
        if run.procs.master and signum and run.evaluated != run.it:  # else this step's evaluation has saved it
            save_checkpoint(run_state(run, None), saved(run.cfg))
        if run.procs.master and run.time_budget:
            run.procs.say(f"to train it again without timing anything: {budget.save_repeat_command(run.cfg)}")
    if signum:
        run.procs.say(f"stopped by {system.signal_name(signum)} at iteration {run.it}; saved {saved(run.cfg)} "
                      "(continue with --init_from=resume)")
        return 128 + signum
    if run.it < run.cfg.max_iters:
        run.procs.say(f"stopped early at iteration {run.it}: val loss has not improved for {run.bad_evals} "
                      f"evaluations (--patience={run.cfg.patience}); the best model is in {saved(run.cfg, 'best.pt')}")
    run.procs.say(f"done: {run.it} iterations, best val {run.best_val:.4f}, {ms:.1f} ms a step; in {run.cfg.out_dir}")
    return 0


# --- A step's parts: batches, the loss estimate, the optimizer, the checkpoint -------------------------


def get_batch(data, batch_size, block_size, rng, device_name):
    """batch_size windows of data at random: x (B, T), and y (B, T), each position's next token."""
    starts = rng.integers(0, len(data) - block_size, size=batch_size)
    xy = torch.from_numpy(np.stack([data[s : s + block_size + 1] for s in starts]).astype(np.int64))
    if device_name.startswith("cuda"):  # pinned: copied while the GPU works
        xy = xy.pin_memory().to(device_name, non_blocking=True)
    xy = xy.to(device_name)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def train_batches(data, cfg, rank, it, device_name):
    """One process's batches, grad_accum a step, from step it on, each step's from its own seed: a resumed
    run, on any number of processes, draws what an uninterrupted one would."""
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
    """Mean loss per split: over eval_iters random batches, the same each time; or with eval_iters 0 over
    every token of val (as python -m tinygpt.score scores a file), and as many of train."""
    model.eval()
    out = {}
    for name, data in splits.items():
        if cfg.eval_iters == 0:
            out[name] = dataset.mean_loss(model, data[: len(splits["val"])], cfg.block_size, 4 * cfg.batch_size,
                                          device_name, autocast)
            continue
        rng = np.random.default_rng(cfg.seed)
        batches = (get_batch(data, cfg.batch_size, cfg.block_size, rng, device_name) for _ in range(cfg.eval_iters))
        with autocast:
            out[name] = sum(model(x, y)[1].item() for x, y in batches) / cfg.eval_iters
    model.train()
    return out


def make_optimizer(model, cfg, device_type):
    """AdamW, or (muon) Muon for the matrices inside the blocks and AdamW for the rest. AdamW decays every
    matrix (the embedding is the output head too) and no bias or gain, which set scales and offsets."""
    named = list(model.named_parameters())
    matrices = [p for n, p in named if cfg.optimizer == "muon" and n.startswith("blocks.") and p.dim() == 2]
    rest = [p for _, p in named if all(p is not m for m in matrices)]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    # The fused kernel updates every tensor in one pass: on a CPU a third of the time of the per-tensor loop.
    adamw = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=device_type != "mps")
    return optim.Optimizers(adamw, optim.muon(matrices, cfg)) if matrices else adamw


def save_checkpoint(state, path):
    """Written whole or not at all (files.write_atomic): a crash leaves the previous checkpoint or the new one."""
    try:
        files.write_atomic(path, lambda f: torch.save(state, f))
    except OSError as e:
        then = ("the previous checkpoint is kept: free some space and continue with --init_from=resume"
                if path.exists() else "nothing was saved: free some space and run again")
        raise UserError(f"{files.write_error(path, e)}; {then}") from None


def run_state(run, val_loss):
    """What ckpt.pt holds after step run.it, in tensors and plain data: enough to resume exactly, or sample.
    val_loss: that step's evaluation, or None (saved on a signal)."""
    return {"format": files.CHECKPOINT_FORMAT, "model": run.raw_model.state_dict(),
            "model_config": dataclasses.asdict(run.raw_model.config), "train_config": dataclasses.asdict(run.cfg),
            "meta": run.meta, "iter": run.it, "best_val_loss": run.best_val, "val_loss": val_loss,
            "bad_evals": run.bad_evals, "optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict(),
            "device_type": run.procs.device_type, "wandb_run_id": getattr(run.trackers, "wandb_id", run.wandb_id)}


def probe(run, speeds=None):
    """(seconds per step, per evaluation with its checkpoints) of run, rank 0's on every process: as this machine
    timed it before (speeds, a budget.Speeds), else timed on a few real steps, then put back (budget.time_steps)."""
    cfg = run.cfg
    draw = functools.partial(get_batch, run.splits["train"], cfg.batch_size, cfg.block_size,
                             np.random.default_rng(cfg.seed), run.procs.device)
    batch = draw()
    step = functools.partial(train_step, run.model, run.optimizer, run.scaler, run.autocast, cfg, *batch,
                             iter(draw, None))
    time_it = functools.partial(budget.time_steps, step, run.raw_model, batch, run.eval_autocast, run.optimizer,
                                run.scaler, calls=5 if run.procs.world > 1 else None)
    step_s, forward_s, save_s = speeds.measure(cfg, time_it) if speeds else time_it()
    eval_batches = 2 * (cfg.eval_iters or len(run.splits["val"]) / (cfg.batch_size * cfg.block_size))  # val, train
    return run.procs.broadcast((step_s, eval_batches * forward_s + save_s))


if __name__ == "__main__":
    system.exit(main())
