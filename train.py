"""Trains a GPT on data written by prepare.py.

    python train.py --data_dir=data/notes_char               # no preset: sized for the text and 5 minutes
    python train.py config/shakespeare_char_cpu.toml
    python train.py config/shakespeare_char.toml --compile=true --max_iters=2000
    python train.py config/finetune_shakespeare_gpt2.toml   # fine-tuning: --init_from (tinygpt/weights.py)
    torchrun --standalone --nproc_per_node=4 train.py config/shakespeare_char.toml

Writes OUT_DIR/ckpt.pt (the latest state, to resume from), OUT_DIR/best.pt (the
lowest val loss so far) and OUT_DIR/log.jsonl (one line per logged step). Read it
from main(): the settings, the run set up, then the loop.
"""

from tinygpt import terminal  # first: Ctrl-C while torch loads is one line, not a traceback  # isort: skip
import contextlib
import dataclasses
import functools
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from config import UserError, cli, load_config, option
from model import GELUS, GPT, MIXERS, POSITIONS, SCORES
from tinygpt import budget
from tinygpt.checkpoint import read_start, restore_run, run_state, save_checkpoint
from tinygpt.dataset import estimate_loss, load_data, step_seed, train_batches
from tinygpt.device import maybe_compile, mfu, pick_dtype, training_autocasts
from tinygpt.distributed import Processes, end_processes, exit_process, start_processes
from tinygpt.files import version
from tinygpt.optim import configure_optimizer
from tinygpt.outdir import RunLock, append_record, start_log
from tinygpt.settings import check_resumable, check_settings, resumed_config, run_out_dir
from tinygpt.weights import finetune_settings, load_into, load_weights

# How often the processes under torchrun agree to stop (a signal to one, a non-finite loss on one): an
# agreement after each step cost 3-7% of a CPU step with 2 processes; every 10 steps, 0-1% (bench/agreement.py).
AGREE_EVERY = 10


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
    gelu: str = option("exact", "the feed-forward's GELU: exact, or tanh (GPT-2's approximation)", choices=GELUS)
    score: str = option("dot", "how a query scores a key (head, multihead): dot product, or additive", choices=SCORES)
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
    muon_lr: float = option(0.01, "Muon's peak learning rate, on learning_rate's warmup and decay", above=0)
    muon_momentum: float = option(0.95, "Muon's (Nesterov) momentum", low=0, below=1)
    muon_ns_steps: int = option(5, "Newton-Schulz steps per Muon update", low=1)
    muon_weight_decay: float = option(0.0, "Muon's weight decay", low=0)
    # evaluation and logging
    max_time: str = option("", "a time budget for the whole run, e.g. 90s, 5m, 2h: the steps are fitted to it"
                                f" (empty: {budget.DEFAULT_BUDGET} if neither a preset nor --max_iters sets the steps)")
    patience: int = option(5, "stop when val loss has not improved for this many evaluations (0: never)", low=0)
    eval_interval: int = option(250, "evaluate and checkpoint every this many steps", low=1)
    eval_iters: int = option(200, "batches per loss estimate (0: the whole val split, deterministically)", low=0)
    log_interval: int = option(10, "write a log line every this many steps", low=1)
    # system
    device: str = option("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    dtype: str = option("auto", "auto (CUDA: bf16, else fp16; CPU: bf16 where timed faster, else fp32), float32, "
                        "bfloat16, float16", choices=("auto", "float32", "bfloat16", "float16"))
    compile: bool = option(False, "torch.compile the model")
    seed: int = option(1337, "random seed", low=0, high=2**63 - 1)


@cli
def main(argv):
    sources = {}  # where each setting came from: a preset's path or "command line"; absent: free to choose
    cfg = load_config(TrainConfig, argv, "train.py", __doc__.strip().splitlines()[0], sources=sources)
    cfg = dataclasses.replace(cfg, out_dir=run_out_dir(cfg, sources))
    procs = start_processes(cfg.device)  # this process, alone or one of torchrun's, on its device
    lock, status = RunLock(cfg.out_dir), None  # out_dir's lock, taken once every check has passed
    try:
        with terminal.stop_before_start():  # a stop before the loop: one line, not a traceback
            run = set_up(cfg, sources, procs, lock)
        status = train(run)
        return status
    except UserError:
        status = 2  # met by every process at once (Processes.together)
        raise
    finally:
        lock.release()
        end_processes(finished=status is not None)


# --- Setting up ------------------------------------------------------------------------------------


@dataclass
class Run:
    """Everything the loop reads and changes."""

    cfg: TrainConfig  # the settings as decided; a time budget's re-planning changes the steps
    procs: Processes  # this process among the others, and its device
    meta: dict  # the tokenizer, as in meta.json
    splits: dict  # the train and val tokens
    raw_model: GPT  # the weights, plain: what a checkpoint saves
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # fp16's loss scaling; idle in every other dtype
    model: torch.nn.Module = None  # what a step runs: raw_model, compiled and under DDP where asked
    eval_model: torch.nn.Module = None  # compiled if model is, never under DDP: only rank 0 evaluates
    time_budget: budget.Budget | None = None  # fits the steps again as the run goes
    it: int = 0  # steps taken
    best_val: float = math.inf
    bad_evals: int = 0  # evaluations in a row without a new best
    evaluated: int | None = None  # the step whose evaluation is done
    step_ms: list = field(default_factory=list)

    def __post_init__(self):
        self.model = self.eval_model = self.raw_model
        self.autocast, self.eval_autocast = training_autocasts(self.procs.device_type, getattr(torch, self.cfg.dtype))


def set_up(cfg, sources, procs, lock):
    """The run at its first step: its settings decided and checked, its model built (from the weights
    to fine-tune, or restored from ckpt.pt), out_dir locked, and with a time budget its steps fitted."""
    with procs.together():  # a mistake one process meets ends them all: each block, then all agree
        data = load_data(cfg.data_dir)
        if procs.master:
            lock.check_free()  # another run into out_dir is named now, not taken for a finished one
    with procs.together():
        seen = version(Path(cfg.out_dir) / "ckpt.pt")
        weights = load_weights(cfg.init_from, cfg.out_dir) if cfg.init_from not in ("scratch", "resume") else None
        ckpt = read_start(cfg, procs.device)
        cfg, time_budget = decide(cfg, sources, ckpt, weights, data, procs)
    with procs.together():
        run = build(cfg, data, procs, weights)
        del weights  # the copy is in the model: GPT-2's weights need not stay twice in memory
        if procs.master:
            lock.acquire()  # out_dir is this run's from here on; nothing in it was touched before
            if version(Path(cfg.out_dir) / "ckpt.pt") != seen:  # another run wrote it while this one started
                ckpt = read_start(cfg, procs.device)
        if ckpt is not None:
            check_resumable(ckpt, run.raw_model.config, run.meta, cfg)
            restore_run(run, ckpt)
    if ckpt is not None:
        procs.say(f"resuming {Path(cfg.out_dir) / 'ckpt.pt'} at iteration {run.it}")
    del ckpt
    if cfg.compile:
        run.model = run.eval_model = maybe_compile(run.raw_model, procs.device_type)
    run.model = procs.wrap(run.model)  # under DDP when started by torchrun
    if time_budget is not None:
        step_s, eval_s = time_budget.times or probe(run)
        elapsed = procs.agree_on((budget.process_age(),))[0]
        run.cfg, run.time_budget = time_budget.fit(run.cfg, step_s, eval_s, elapsed, procs.say), time_budget
    with procs.together():  # the first write into out_dir, once every check and the probe have passed
        if procs.master:
            start_log(cfg.out_dir, run.it)
    c, sequences = run.cfg, run.cfg.batch_size * run.cfg.grad_accum * procs.world
    ddp = f", DDP over {procs.backend}" if procs.backend else ""
    procs.say(f"{run.raw_model.num_params():,} parameters; {tokens_per_step(run):,} tokens per step: batch "
              f"{c.batch_size} x grad_accum {c.grad_accum} x {procs.world} process(es) = {sequences} sequences "
              f"of {c.block_size}; on {procs.device}, {c.dtype}{ddp}")
    return run


def decide(cfg, sources, ckpt, weights, data, procs):
    """(cfg as the run will train, its time budget or None). A resumed run keeps the settings it started
    with; fine-tuning takes the model's shape from its weights; with no preset the model and batch are
    sized for the data and the budget. The dtype is picked here (auto on a CPU: measured) and kept."""
    meta, splits = data
    if ckpt is not None:
        cfg = resumed_config(ckpt, cfg, sources, procs.device_type)
    dtype = pick_dtype(cfg.dtype, procs.device_type, training=True)
    cfg = dataclasses.replace(cfg, dtype=str(dtype).removeprefix("torch."))
    time_budget = budget.Budget.of(cfg, sources) if ckpt is None else None
    if ckpt is None and weights is not None:
        cfg = finetune_settings(weights, cfg, meta, sources)
    elif ckpt is None and budget.sized(sources):
        seconds = time_budget.seconds if time_budget else budget.parse_duration(budget.DEFAULT_BUDGET)
        left = seconds - procs.agree_on((budget.process_age(),))[0]  # rank 0's clock: all size alike
        cfg, max_steps, times = budget.size_for_data(cfg, sources, len(splits["train"]), len(splits["val"]),
                                              meta["vocab_size"], left, procs.world,
                                              lambda settings: probe(build(settings, data, procs)), procs.say)
        if time_budget is not None:
            time_budget.use_sizing(max_steps, times if procs.world == 1 and not cfg.compile else None)
    return cfg, time_budget


def build(cfg, data, procs, weights=None):
    """A new Run of cfg on procs.device: its model (seeded, or holding the weights to fine-tune), the
    optimizer and the gradient scaler."""
    meta, splits = data
    torch.manual_seed(cfg.seed)
    model = GPT(check_settings(cfg, procs.device, data))  # refused here, before anything is built or probed
    if weights is not None:
        procs.say(load_into(model, weights, meta))
    model = model.to(procs.device)
    optimizer = configure_optimizer(model, cfg, procs.device_type)
    scaler = torch.amp.GradScaler(procs.device_type, enabled=cfg.dtype == "float16")
    return Run(cfg, procs, meta, splits, model, optimizer, scaler)


def probe(run):
    """(seconds per training step, seconds per evaluation with its checkpoints) of run, timed on a few
    real steps (budget.time_steps), rank 0's on every process."""
    step = functools.partial(train_step, accum=run.cfg.grad_accum, autocast=run.autocast, cfg=run.cfg)
    return run.procs.agree_on(budget.time_steps(run, step))


def tokens_per_step(run):
    return run.cfg.batch_size * run.cfg.grad_accum * run.procs.world * run.cfg.block_size  # both per process


# --- The loop ------------------------------------------------------------------------------------


def train(run):
    """The loop, in its natural order: the learning rate; an evaluation and checkpoint when due; forward
    and backward over the micro-batches; clip; step; log. Returns the exit code."""
    batches = train_batches(run.splits["train"], run.cfg, run.procs.rank, run.it, run.procs.device)
    x, y = next(batches)
    times = budget.LoopTimes(run.it)  # the loop's own step and evaluation times, for the budget
    stop_early = bool(run.cfg.patience and run.bad_evals >= run.cfg.patience)  # a resumed run that had stopped
    bar = tqdm(total=run.cfg.max_iters, initial=run.it, disable=not run.procs.master or None, dynamic_ncols=True)
    signum, bad = 0, None  # a signal to any process, the first non-finite loss: each ends the run
    with terminal.StopRequested() as stop, bar:
        while True:
            eval_due = evaluation_due(run)
            if run.time_budget is not None and (eval_due or run.it % AGREE_EVERY == 0):  # fitted again
                run.cfg = run.time_budget.replan(run.cfg, run.it, times, run.procs.agree_on, bar.write)
                bar.total = run.cfg.max_iters
            lr = get_lr(run.it, run.cfg)
            for group in run.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's group runs at muon_lr's scale
            if eval_due:
                with times.evaluation(), run.procs.together():  # a full disk there ends every process
                    if run.procs.master:
                        evaluate(run, lr, bar.write)
                stop_early = run.procs.agree(run.cfg.patience and run.bad_evals >= run.cfg.patience)
            if run.it >= run.cfg.max_iters or stop_early:
                break
            t0 = time.perf_counter()
            if run.cfg.dropout > 0:  # this step's dropout masks, the step's only use of torch's generator
                torch.manual_seed(step_seed(run.cfg.seed, run.procs.rank, run.it))  # (~140 us: only if drawn)
            loss, x, y = train_step(run.model, run.optimizer, run.scaler, functools.partial(next, batches), x, y,
                                    run.cfg.grad_accum, run.autocast, run.cfg)
            run.step_ms.append((time.perf_counter() - t0) * 1000)
            run.it += 1
            bad = bad if bad is not None or math.isfinite(loss) else f"{loss} at iteration {run.it}"
            log_step(run, loss, lr, bar)
            # Every process decides together whether to stop: after each step when alone, else every
            # AGREE_EVERY steps and before each evaluation, so nothing is saved after a non-finite loss.
            if run.procs.world == 1 or run.it % AGREE_EVERY == 0 or evaluation_due(run):
                signum, failed = run.procs.most((stop.signum or 0, bad is not None))
                if failed:
                    bad = bad or f"not finite on another process by iteration {run.it}"
                    raise UserError(f"loss is {bad}; the last good checkpoint is kept in {run.cfg.out_dir}. Try a "
                                    "lower --learning_rate, or bfloat16 instead of float16")
                if signum:
                    break
    return finish(run, signum)


def evaluation_due(run):  # every eval_interval steps, and at the end: once each
    return (run.it % run.cfg.eval_interval == 0 or run.it == run.cfg.max_iters) and run.it != run.evaluated


def get_lr(it, cfg):
    """Linear warmup, then cosine decay to min_lr, then min_lr."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return cfg.min_lr
    progress = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def evaluate(run, lr, write):
    """Estimates the losses and logs them; saves ckpt.pt, and best.pt when val improved. Every evaluation
    draws the same batches: a change in val loss is the model's, not the draw's, and best.pt is the best."""
    losses = estimate_loss(run.eval_model, run.splits, run.cfg, run.procs.device, run.eval_autocast, run.cfg.seed)
    record = {"iter": run.it, "train_loss": losses["train"], "val_loss": losses["val"],
              "val_bpc": losses["val"] / math.log(2), "lr": lr}
    append_record(run.cfg.out_dir, record)
    improved = losses["val"] < run.best_val
    run.best_val, run.bad_evals = min(run.best_val, losses["val"]), 0 if improved else run.bad_evals + 1
    state = run_state(run, losses["val"])
    save_checkpoint(state, Path(run.cfg.out_dir) / "ckpt.pt")
    if improved:
        save_checkpoint(state, Path(run.cfg.out_dir) / "best.pt")
    run.evaluated = run.it
    write(f"step {run.it}: train {losses['train']:.4f}, val {losses['val']:.4f} "
          f"({record['val_bpc']:.3f} bits/token){' *' if improved else ''}")


def train_step(model, optimizer, scaler, next_batch, x, y, accum, autocast, cfg):
    """One optimizer step over accum micro-batches; returns the loss and the next batch."""
    for micro in range(accum):
        # Under DDP, gradients are averaged across processes only on the last micro-step.
        last = micro == accum - 1 or not hasattr(model, "no_sync")
        with (contextlib.nullcontext() if last else model.no_sync()), autocast:
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


def log_step(run, loss, lr, bar):
    """The bar moves, and every log_interval steps a line goes to log.jsonl."""
    if not run.procs.master or not math.isfinite(loss):
        return
    tok_s = tokens_per_step(run) / (run.step_ms[-1] / 1000)
    bar.update(1)
    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
    if run.it % run.cfg.log_interval == 0:
        c = run.cfg
        utilization = mfu(budget.train_flops_per_token(run.raw_model.num_params(), c.n_layer, c.n_embd, c.block_size),
                          tok_s, run.procs.device_type, run.procs.world)
        append_record(c.out_dir, {"iter": run.it, "loss": loss, "lr": lr, "ms_per_iter": run.step_ms[-1],
                                  "tokens_per_s": tok_s} | ({"mfu": utilization} if utilization else {}))


def finish(run, signum=0):
    """The run's last words and its exit code: stopped by a signal (ckpt.pt saved at this step, to
    continue from), stopped early (no better val loss for --patience evaluations), or done."""
    c, ckpt = run.cfg, Path(run.cfg.out_dir) / "ckpt.pt"
    if signum:
        with run.procs.together():
            if run.procs.master:
                save_checkpoint(run_state(run, None), ckpt)
        run.procs.say(f"stopped by {signal.Signals(signum).name} at iteration {run.it}; saved {ckpt} "
                      "(continue with --init_from=resume)")
        return 128 + signum
    if run.it < c.max_iters:
        run.procs.say(f"stopped early at iteration {run.it}: val loss has not improved for {run.bad_evals} "
                      f"evaluations (--patience={c.patience}); the best model is in {Path(c.out_dir) / 'best.pt'}")
    median = sorted(run.step_ms)[len(run.step_ms) // 2] if run.step_ms else 0.0
    run.procs.say(f"done: {run.it} iterations, best val loss {run.best_val:.4f}, median {median:.1f} ms/iter; "
                  f"checkpoints in {c.out_dir}")
    return 0


if __name__ == "__main__":
    exit_process(main())
