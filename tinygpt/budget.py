"""Sizing a run to its data and to the time it has.

    python train.py --data_dir=data/notes_char                 # no preset: sized for the data, 5 minutes
    python train.py --data_dir=data/notes_char --max_time=30m
    python train.py config/shakespeare_char_cpu_fast.toml --max_time=2m   # the preset's model, steps for 2 minutes

With no preset, `choose_run` picks the model and its training from the number of
training tokens, the vocabulary and the compute the time budget buys on this
device. With a budget, `plan_steps` turns the time into a number of steps once,
from step and evaluation times measured at the start (the probe, in train.py),
and `replan` fits it again every few steps from the loop's own times (after
3/4 of the run, only shorter): the learning-rate schedule then ends on time, and the count is
stored in the checkpoint, so a resumed run continues exactly instead of measuring again.
"""

import contextlib
import copy
import dataclasses
import functools
import io
import math
import re
import time

import numpy as np
import torch

from config import UserError
from tinygpt.dataset import get_batch
from tinygpt.settings import has_preset
from tinygpt.system import process_age  # the budget's clock

DEFAULT_BUDGET = "5m"  # with no preset and no --max_iters: a few minutes of a laptop's time
MAX_BUDGET = 1000 * 3600  # the longest budget planned for, in seconds (longer ones overflow the sizing's sums)


def parse_duration(text):
    """Seconds in '90s', '5m', '2h', '1h30m', '1.5h' or a plain number of seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    cleaned = text.strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+(\.\d*)?", cleaned):
        cleaned += "s"
    parts = re.findall(r"(\d+(?:\.\d*)?)([hms])", cleaned)
    if not parts or "".join(n + u for n, u in parts) != cleaned:
        raise UserError(f"max_time must be a duration such as 90s, 5m, 2h or 1h30m, got {text!r}")
    seconds = sum(float(n) * units[u] for n, u in parts)
    if not seconds <= MAX_BUDGET:
        raise UserError(f"max_time {text!r} is longer than a run can plan for (at most 1000h); give a shorter one")
    return seconds


# --- The rule -----------------------------------------------------------------------------

# Model sizes, smallest first. Depth and width grow together, each size about twice the
# parameters of the one before; heads are 32 channels wide up to 256, 64 beyond. The context
# grows with them: 64 below a width of 128, 128 up to 192 (Tiny Shakespeare, 5 minutes, 4 x 128:
# whole val 1.503 with block 128, 1.516 with 64), 256 beyond.
SHAPES = [(2, 64), (3, 96), (4, 128), (5, 160), (6, 192), (6, 256), (8, 320), (8, 384), (10, 512), (12, 768)]
# A model needs about this many training tokens per parameter (repeats counted) to be worth
# its size. Measured at 5 minutes: Tiny Shakespeare, 4 x 128 on 5M tokens beat 3 x 96 on 6M
# (val 1.52 against 1.59); a 23k text, 3 x 96 over 50 passes beat 2 x 64 (2.47 against 2.59
# bits/char); a 109k text, 4 x 128 beat 3 x 96 (2.12 against 2.16).
TOKENS_PER_PARAM = 3
# Measured on a 23 KB and a 170 KB text: with dropout, a small text still gives after 30 to 60
# passes over it; without, the model memorizes it within a few.
MAX_EPOCHS = 50
MAX_STEPS = 1500  # past this, larger batches instead of more steps
MIN_BATCH = 16  # the smallest batch the rule gives
# The fast recipe (config/shakespeare_char_cpu_fast.toml): Muon for the block matrices, rotary positions;
# and the learning rate decayed to 0 (Tiny Shakespeare, 5 minutes, 4 x 128 with batch 80: whole val
# 1.516 with min_lr 1e-4, 1.502 with 0 and fewer evaluations; with batch 64 and 0 alone, 1.504).
RECIPE = {"pos": "rope", "optimizer": "muon", "muon_lr": 0.015, "muon_momentum": 0.9, "learning_rate": 1.5e-3,
          "min_lr": 0.0, "weight_decay": 0.1, "bias": False}
# Evaluations spread over a run with no preset (and one at the start): at most EVALS, fewer where
# they would take more than EVAL_SHARE of the time, but at least MIN_EVALS, each reading fewer batches
# where those would (fewer_batches_per_evaluation). On Tiny Shakespeare at 5 minutes, 12 evaluations
# took 33 s of 281 (12%); 4 left 7% more steps for training.
EVALS, MIN_EVALS, EVAL_SHARE = 12, 4, 0.03
USABLE = 0.97  # of a budget, for steps and evaluations: the rest for saving, the exit and a slower last quarter
# Tokens per loss estimate (of each split) when the val split is too large to read whole: a fixed
# number of tokens, not of batches, so that a large batch does not make each evaluation longer. The
# Python source in 20 minutes (batch 104 x 128) spent 22 s on each of 5 evaluations, 10% of the run,
# with 20 batches.
EVAL_TOKENS = 20 * 32 * 128


# What the sizing chooses for a run with no preset. Given all of them, nothing is sized: the run is
# the command line over TrainConfig's defaults, with no probe and no recipe.
SIZED = ("n_layer", "n_embd", "block_size", "batch_size")


def sized(sources):
    """Whether a new run is sized for its data: no preset, and some of SIZED left to choose."""
    return not has_preset(sources) and not all(k in sources for k in SIZED)


def shape_settings(n_layer, n_embd):
    block = 64 if n_embd < 128 else 128 if n_embd <= 192 else 256
    return {"n_layer": n_layer, "n_embd": n_embd, "n_head": heads(n_embd), "block_size": block}


def heads(n_embd):
    """Heads 32 channels wide up to a width of 256, 64 beyond; fewer where they would not divide it."""
    n_head = max(1, n_embd // (32 if n_embd <= 256 else 64))
    while n_embd % n_head:
        n_head -= 1
    return n_head


def block_params(n_layer, n_embd):
    """Parameters inside the blocks: attention (4 C^2) and feed-forward (8 C^2) per layer."""
    return 12 * n_layer * n_embd**2


def train_flops_per_token(params, n_layer, n_embd, block_size):
    """Forward and backward: 6 per weight a token passes through, plus attention over the context."""
    return 6 * params + 12 * n_layer * n_embd * block_size


def model_flops_per_token(n_layer, n_embd, block_size, vocab_size):
    """train_flops_per_token of a model not built yet: its blocks, and the embedding shared with the head."""
    return train_flops_per_token(block_params(n_layer, n_embd) + vocab_size * n_embd, n_layer, n_embd, block_size)


def choose_run(train_tokens, val_tokens, vocab_size, flops_per_s, seconds, given=None):
    """The model and training for this data and budget: ({setting: value}, most steps worth
    taking, a reason to print). flops_per_s: the training rate measured on this device.
    given: the settings of SIZED, n_head and dropout that the command line set, chosen around."""
    given, data_tokens = given or {}, MAX_EPOCHS * train_tokens  # what the text can usefully give

    def shape(n_layer, n_embd):  # one of SHAPES, with what was given (a width that n_head divides)
        heads_given = given.get("n_head", 1)
        n_embd = given.get("n_embd", heads_given * max(1, round(n_embd / heads_given)))
        settings = shape_settings(given.get("n_layer", n_layer), n_embd)
        settings["block_size"] = given.get("block_size", min(settings["block_size"], val_tokens // 2))
        return settings

    def tokens(s, most=data_tokens):  # what the budget can train a model so shaped on
        flops = model_flops_per_token(s["n_layer"], s["n_embd"], s["block_size"], vocab_size)
        return min(most, flops_per_s * seconds / flops)

    # The largest model that the budget and the text can both feed: past it, a model sees too
    # few tokens per parameter, or (where the time limits it) takes too few steps even with the
    # smallest batch, to beat a smaller one trained longer. At 1 minute, 4 x 128 with block 128 and
    # batch 16 took 892 to 1,108 steps: the Rust text 1.969 bits/char where 3 x 96 reached 1.931,
    # Tiny Shakespeare 2.228 against 2.222 (3 x 96 with block 64 in another hour: 2.236, 2.255).
    def fed(s):
        n, smallest_batch = tokens(s), given.get("batch_size", MIN_BATCH)
        enough_steps = n >= data_tokens or n >= MAX_STEPS * s["block_size"] * smallest_batch
        return enough_steps and n >= TOKENS_PER_PARAM * block_params(s["n_layer"], s["n_embd"])

    shapes = [shape(*s) for s in SHAPES]
    settings = next((s for s in reversed(shapes) if fed(s)), shapes[0])
    block = settings["block_size"]
    total = tokens(settings)
    epochs = total / train_tokens
    # A batch for about MAX_STEPS steps: enough to learn, not so many that each one's fixed cost
    # dominates (on a 2-core CPU, 4 x 128: about 30 ms a step, plus 2 ms a sequence of 64).
    # Measured at 5 minutes, best.pt on the whole val split, bits/char: Tiny Shakespeare (3 to 7
    # passes) 2.18 with batch 64 over 1,600 steps, 48 over 2,100 and 32 over 2,900, 2.19 with 24
    # over 3,600, 2.20 with 16 over 4,500; a 109k text (35-50 passes) 2.03 with 48 over 1,500,
    # 2.09 with 24 over 2,300; a 4.6M text (1 pass) 1.82 with 64 over 1,400, 1.90 with 16.
    # A run that the text ends before the time does spends the time left on more, smaller steps: the
    # Cyrillic text in 20 minutes, 5 x 160 over 50 passes, 2.010 bits/char with batch 24 (1,591 steps, 277 s),
    # 1.965 with 16 (2,386 steps, 330 s), 1.963 with 12, 1.981 with 8.
    steps = MAX_STEPS * tokens(settings, math.inf) / total  # total is at most the time's tokens: 1500 or more
    batch = given.get("batch_size", max(MIN_BATCH, min(128, 8 * round(total / (block * steps) / 8))))
    # Dropout keeps a model that sees its text many times from memorizing it: none up to 8 passes,
    # 0.1 more each time they double, but at most 0.2, and 0.06 less than that each time the tokens
    # per parameter double from the fewest the sizing allows (a model with many is still learning,
    # and dropout's noise slows it more than it helps). Measured with dropout on the stream alone
    # (model.py), best.pt on the whole val split: the license in 1 minute, 3 x 96, 50 passes, 3.1
    # tokens per parameter, 2.48 bits/char with 0.2, 2.54 with 0.1; Tiny Shakespeare in 20 minutes,
    # 6 x 192, 17-19 passes, 6.4 to 7.2 per parameter, 1.4521 nats with 0.13, 1.4606 with 0.07; the
    # Cyrillic text in 1 minute, 3 x 96, 32-39 passes, 9.6 per parameter, 2.05 bits/char with 0.1
    # (three runs), 2.12 with 0.15, 2.19 with 0.2 (median of six), 2.28 without. Below 8 passes it
    # slowed learning: Tiny Shakespeare in 5 minutes, 6 passes, 2.27 with 0.06, 2.18 without (with
    # dropout on the attention weights too).
    per_param = total / block_params(settings["n_layer"], settings["n_embd"])
    most = 0.2 - 0.06 * math.log2(max(per_param, TOKENS_PER_PARAM) / TOKENS_PER_PARAM)
    dropout = given.get("dropout", round(max(0.0, min(0.1 * math.log2(epochs / 8), most)), 2))
    eval_iters = 0 if val_tokens <= EVAL_TOKENS else math.ceil(EVAL_TOKENS / (batch * block))  # 0: whole, exact
    settings.update(RECIPE, batch_size=batch, dropout=dropout, eval_iters=eval_iters)
    reason = f"about {total / 1e6:.3g}M tokens of training ({epochs:.1f} passes over the text)"
    return settings, most_steps(train_tokens, batch * block), reason


def most_steps(train_tokens, tokens_per_step):
    """The steps worth taking on a text: MAX_EPOCHS passes over it."""
    return max(1, int(MAX_EPOCHS * train_tokens / tokens_per_step))


def size_run(train_tokens, val_tokens, vocab_size, seconds, rate, given=None):
    """(settings, reason) of choose_run with this device's training rate, rate(settings) -> FLOP/s,
    measured on the models it considers: a small one first, then each choice, until the choice
    stands. The rate grows with the model and the batch (a step's fixed cost is shared by more
    sequences) and falls with dropout (on a 2-core CPU, 0.2 makes a step a third slower), so each
    is measured as chosen."""
    keys = ("n_layer", "n_embd", "block_size", "batch_size", "dropout")
    choice, tried = {**shape_settings(*SHAPES[2]), **RECIPE, "batch_size": 16, "dropout": 0.0}, []
    choice["block_size"] = min(choice["block_size"], val_tokens // 2)  # a short text's: probed as it would train
    for _ in range(5):
        settings, _, reason = choose_run(train_tokens, val_tokens, vocab_size, rate(choice), seconds, given)
        chosen = [settings[k] for k in keys]
        if chosen == [choice[k] for k in keys] or chosen in tried:  # it stands, or it came back
            break
        tried.append(chosen)
        choice = settings
    return settings, reason


def size_for_data(cfg, sources, train_tokens, val_tokens, vocab_size, seconds_left, world, measure, say=print):
    """(cfg, steps, times): cfg (a train.TrainConfig) with the model and training chosen by choose_run for
    the data and the seconds left of the budget, except what the command line set; the most steps worth
    taking on this data; and measure(cfg) of the cfg returned, when it was one of the models timed (the
    budget need not time it again). world processes train together, each its own batch_size x grad_accum
    sequences a step. measure(cfg) -> (seconds per step, seconds per evaluation), on this device: it checks
    the settings before it builds a model, so what was given is refused before any probe."""

    # The recipe's rotary angles turn a dot product's queries and keys: not for attention that has none.
    rope = cfg.mixer in ("head", "multihead") and cfg.score == "dot"
    started, measured = time.perf_counter(), {}

    def chosen(settings):  # what the command line did not set
        return {k: v for k, v in settings.items() if k not in sources and (rope or k != "pos")}

    def rate(settings):  # training FLOP/s of a model so configured, on these devices together
        probe, t0 = dataclasses.replace(cfg, **chosen(settings)), time.perf_counter()
        step_s, _ = measured[dataclasses.astuple(probe)] = measure(probe)
        spent, left = time.perf_counter() - t0, seconds_left - (time.perf_counter() - started)
        if left < spent + step_s:  # another probe as long (the budget's), and a step, would not fit
            raise UserError(f"max_time {cfg.max_time or DEFAULT_BUDGET} is too short to size a run for this data: "
                            f"timing {probe.n_layer} layers x {probe.n_embd} (a vocabulary of {vocab_size:,}) took "
                            f"{spent:.1f} s, and {max(left, 0):.1f} s are left; give more time, or the whole shape "
                            "(--n_layer, --n_embd, --block_size, --batch_size)")
        flops = model_flops_per_token(probe.n_layer, probe.n_embd, probe.block_size, vocab_size)
        return world * probe.batch_size * probe.grad_accum * probe.block_size * flops / step_s

    given = {k: getattr(cfg, k) for k in (*SIZED, "n_head", "dropout") if k in sources}
    # Sized for the seconds its steps will have: what the plan keeps, less the evaluations' share. On
    # all of them, Tiny Shakespeare and the Rust text at 1 minute counted 2.4M tokens for 4 x 128 and
    # trained it on 1.8M and 1.4M, one size too large (3 x 96 was 2.1% and 4.6% better).
    train_seconds = USABLE * (1 - EVAL_SHARE) * seconds_left
    settings, reason = size_run(train_tokens, val_tokens, vocab_size, train_seconds, rate, given)
    cfg = dataclasses.replace(cfg, **chosen(settings))
    kept = sorted(k for k in settings if k in sources)  # the rule's estimate is then of another run: not said
    say(f"no preset: sized for the data ({train_tokens:,} training tokens): {cfg.n_layer} layers x {cfg.n_embd} wide, "
        f"block {cfg.block_size}, batch {cfg.batch_size}, dropout {cfg.dropout:g}, {cfg.optimizer}, {cfg.pos} "
        "positions" + (f" ({', '.join(kept)} as given)" if kept else f": {reason}"))
    steps = most_steps(train_tokens, world * cfg.batch_size * cfg.grad_accum * cfg.block_size)  # as given
    return cfg, steps, measured.get(dataclasses.astuple(cfg))


def fit_to_time(cfg, sources, seconds, step_s, eval_s, max_steps=None, elapsed=None, say=print):
    """cfg with the steps that fit in what is left of the time budget: the schedule ends on time.
    With no preset, evaluations are spread over the run. elapsed: process_age() unless given
    (under torchrun, rank 0's, so that every process plans the same steps)."""
    left = USABLE * seconds - (process_age() if elapsed is None else elapsed)
    spread = "eval_interval" not in sources
    if spread and cfg.eval_iters and "eval_iters" not in sources:
        cfg, eval_s = fewer_batches_per_evaluation(cfg, left, eval_s)
    steps = plan_steps(left, step_s, eval_s, None if spread else cfg.eval_interval, max_steps)
    if steps < 1 and max_steps != 0:  # (--max_iters=0: an evaluation, and no step)
        raise UserError(f"max_time {cfg.max_time or DEFAULT_BUDGET} leaves {max(left, 0):.0f} s after "
                        f"start-up, less than a step ({step_s:.2f} s) and an evaluation ({eval_s:.2f} s); "
                        "give more time, or a smaller model")
    changes = {"lr_decay_iters": steps}
    if spread:
        changes["eval_interval"] = max(1, math.ceil(steps / spread_evaluations(left, eval_s)))
    changes["warmup_iters"] = min(cfg.warmup_iters, max(1, steps // 10))
    changes = {k: v for k, v in changes.items() if sources.get(k) != "command line"}
    capped = sources.get("max_iters") == "command line" and steps == cfg.max_iters  # --max_iters: at most that
    cfg = dataclasses.replace(cfg, max_iters=steps, **changes)
    say(f"time budget {cfg.max_time or DEFAULT_BUDGET}: {cfg.max_iters:,} steps{' (--max_iters)' if capped else ''} "
        f"of {step_s * 1000:.0f} ms and an evaluation every {cfg.eval_interval:,} ({eval_s:.1f} s each) in the "
        f"{left:.0f} s left")
    return cfg


def fewer_batches_per_evaluation(cfg, seconds_left, eval_s):
    """(cfg, eval_s): a short run's evaluations read fewer batches, so that the fewest it gets
    (MIN_EVALS and the first) take about EVAL_SHARE of its time, but no fewer than an eighth of
    EVAL_TOKENS. At 1 minute on Tiny Shakespeare, 5 evaluations of 40 batches took 10.5 s of 55."""
    least = math.ceil(EVAL_TOKENS / 8 / (cfg.batch_size * cfg.block_size))
    fitting = int(cfg.eval_iters * EVAL_SHARE * seconds_left / ((MIN_EVALS + 1) * eval_s))
    iters = min(cfg.eval_iters, max(least, fitting))
    return dataclasses.replace(cfg, eval_iters=iters), eval_s * iters / cfg.eval_iters


def replan(cfg, sources, seconds, it, step_s, eval_s, max_steps=None, elapsed=None, say=print, grow=True):
    """cfg with its steps fitted again, at iteration it, to what is left of the budget, from the
    loop's own mean step and evaluation times: a short probe can be 20% off on a busy machine.
    Evaluations keep their interval; what the command line set stays. grow: the plan may get longer.
    elapsed: process_age() unless given. Says so when the steps change by 1% or more."""
    left = USABLE * seconds - (process_age() if elapsed is None else elapsed)
    room = None if max_steps is None else max(0, max_steps - it)
    steps = it + (plan_steps(left, step_s, eval_s, cfg.eval_interval, room, it) if room != 0 else 0)
    steps = steps if grow else min(steps, cfg.max_iters)
    if abs(steps - cfg.max_iters) >= 0.01 * cfg.max_iters:
        say(f"time budget: steps take {step_s * 1000:.0f} ms and evaluations {eval_s:.1f} s so far: "
            f"{steps:,} steps in all (planned: {cfg.max_iters:,})")
    decay = {} if sources.get("lr_decay_iters") == "command line" else {"lr_decay_iters": steps}
    return dataclasses.replace(cfg, max_iters=steps, **decay)


class Budget:
    """A run's time budget, kept by train.py from its start to its end: the steps fitted once from a
    probe of a few real steps (fit), then again from the loop's own times (replan). max_steps: the
    most steps worth taking, --max_iters when the command line gives it with --max_time, and the
    most the data can use when the run was sized for it (use_sizing)."""

    def __init__(self, seconds, sources, max_steps=None):
        self.seconds, self.sources, self.max_steps, self.times = seconds, sources, max_steps, None

    @classmethod
    def of(cls, cfg, sources):
        """The budget of a new run: --max_time, or DEFAULT_BUDGET when neither a preset nor --max_iters
        sets the steps; None when they do and --max_time is not given."""
        if cfg.max_time or (not has_preset(sources) and "max_iters" not in sources):
            given = cfg.max_iters if sources.get("max_iters") == "command line" else None
            return cls(parse_duration(cfg.max_time or DEFAULT_BUDGET), sources, given)
        return None

    def use_sizing(self, max_steps, times):
        """The run was sized for its data: at most max_steps, and its steps and evaluations take times
        (seconds each), when the sizing timed this very run (one process, not compiled), else None."""
        self.max_steps, self.times = min(max_steps, self.max_steps or max_steps), times

    def fit(self, cfg, step_s, eval_s, elapsed, say=print):
        return fit_to_time(cfg, self.sources, self.seconds, step_s, eval_s, self.max_steps, elapsed, say)

    def replan(self, cfg, it, times, agree_on, say=print):
        """cfg with its steps fitted again from the loop's own times, as it is before the loop has
        them. In the run's first 3/4 the plan may grow or shrink, and the schedule takes the change in
        its stride; after that it may only shrink, so that steps which slow down late (by up to 40% on
        a 2-core CPU) do not carry the run past its budget. agree_on: all plan from rank 0's times."""
        measured = times.means(it)
        if not measured:
            return cfg
        step_s, eval_s, now = agree_on(measured)
        grow = it <= 0.75 * cfg.max_iters
        return replan(cfg, self.sources, self.seconds, it, step_s, eval_s, self.max_steps, now, say, grow)


class LoopTimes:
    """The training loop's own times on the budget's clock (process_age), for replan: the time
    since the loop started, less its evaluations, over its steps."""

    def __init__(self, it):
        self.start, self.first, self.eval_seconds, self.evals = process_age(), it, 0.0, 0

    @contextlib.contextmanager
    def evaluation(self):
        t0 = process_age()
        yield
        self.eval_seconds, self.evals = self.eval_seconds + process_age() - t0, self.evals + 1

    def means(self, it):
        """(seconds per step, seconds per evaluation, the clock now) at iteration it, or None
        before the loop has both stepped and evaluated."""
        if not self.evals or it <= self.first:
            return None
        now = process_age()
        return (now - self.start - self.eval_seconds) / (it - self.first), self.eval_seconds / self.evals, now


# --- The budget ---------------------------------------------------------------------------


def spread_evaluations(seconds_left, eval_s):
    """How many evaluations to spread over a run of seconds_left when each takes eval_s (EVALS)."""
    return max(MIN_EVALS, min(EVALS, int(EVAL_SHARE * seconds_left / max(eval_s, 1e-9))))


def plan_steps(seconds_left, step_s, eval_s, eval_interval=None, max_steps=None, start=0):
    """How many steps after step `start` fit in seconds_left, when each takes step_s, and an evaluation
    (with its checkpoints) taking eval_s comes at every multiple of eval_interval, `start` included, and
    at the end (None: spread_evaluations spread over the run, and one at the start). At most max_steps."""

    def evaluations(steps):
        if eval_interval is None:
            return spread_evaluations(seconds_left, eval_s) + 1
        end = start + steps
        return (start % eval_interval == 0) + end // eval_interval - start // eval_interval + (end % eval_interval > 0)

    per_step = step_s + (0 if eval_interval is None else eval_s / eval_interval)
    steps = max(0, int(seconds_left / per_step))  # a few evaluations' worth too many: counted down
    while steps > 0 and steps * step_s + evaluations(steps) * eval_s > seconds_left + 1e-9:  # (float rounding)
        steps -= 1
    return steps if max_steps is None else min(steps, max_steps)


def time_steps(run, train_step):
    """(seconds per training step, seconds per evaluation with its checkpoints) of run (a train.Run),
    timed on a few real steps of train_step(model, optimizer, scaler, next_batch, x, y). The model,
    optimizer and scaler are put back as they were, so the run starts as if untouched."""
    cfg, raw, optimizer, scaler = run.cfg, run.raw_model, run.optimizer, run.scaler
    saved = copy.deepcopy((raw.state_dict(), optimizer.state_dict(), scaler.state_dict()))
    rng = np.random.default_rng(cfg.seed)
    batch = functools.partial(get_batch, run.splits["train"], cfg.batch_size, cfg.block_size, rng, run.procs.device)
    x, y = batch()

    def step():
        nonlocal x, y
        _, x, y = train_step(run.model, optimizer, scaler, batch, x, y)

    def forward():
        with torch.no_grad(), run.eval_autocast:
            raw(x, y)[1].item()

    calls = 5 if run.procs.world > 1 else None  # every process must run the same number of synchronized steps
    step_s = time_per_call(step, min_seconds=0.5, calls=calls)
    raw.eval()
    forward_s = time_per_call(forward, min_seconds=0.2, calls=calls)
    raw.train()
    t0 = time.perf_counter()
    torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict()}, io.BytesIO())
    save_s = 2 * (time.perf_counter() - t0)  # ckpt.pt, and best.pt when val improves
    raw.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    scaler.load_state_dict(saved[2])
    optimizer.zero_grad(set_to_none=True)
    eval_tokens = 2 * (cfg.eval_iters * cfg.batch_size * cfg.block_size or len(run.splits["val"]))  # val, train
    return step_s, eval_tokens / (cfg.batch_size * cfg.block_size) * forward_s + save_s


def time_per_call(fn, min_seconds=1.0, min_calls=3, warmup=2, calls=None):
    """Median seconds per call of fn, after warmup calls (allocations, caches, compilation):
    at least min_calls, for at least min_seconds, or exactly `calls` when given."""
    for _ in range(warmup):
        fn()
    times, start = [], time.perf_counter()
    while (len(times) < calls) if calls else (len(times) < min_calls or time.perf_counter() - start < min_seconds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
