"""Sizing a run to its data and to the time it has (--max_time): the rule, and the arithmetic of the time.
With no preset, `choose_run` picks the model from the data and the compute the time buys here (train.py
times a few real steps); `Budget` fits the steps to the time, and again to the loop's own times, so the
schedule ends on time. The measurements: docs/own_text.md."""

import contextlib
import copy
import dataclasses
import io
import json
import math
import re
import shlex
import time
from pathlib import Path

import filelock
import torch

from config import UserError
from model import GPTConfig
from tinygpt.device import compiler_missing, train_flops_per_token
from tinygpt.files import write_atomic, write_error
from tinygpt.system import cache_dir, process_age  # process_age: the budget's clock

DEFAULT_BUDGET = "5m"  # with no preset and no --max_iters: a few minutes of a laptop's time
MAX_BUDGET = 1000 * 3600  # the longest budget planned for, in seconds (longer ones overflow the sizing's sums)
# Model sizes, smallest first, each about twice the parameters of the one before; heads 32 wide up to 256, 64
# beyond; the context 64 below a width of 128, 256 from it.
SHAPES = [(2, 64), (3, 96), (4, 128), (5, 160), (6, 192), (6, 256), (8, 320), (8, 384), (10, 512), (12, 768)]
TOKENS_PER_PARAM = 3  # training tokens (repeats counted) a parameter needs to beat a smaller model trained longer
MAX_EPOCHS = 50  # passes over a text that still help, with dropout
MIN_STEPS = 1500  # a run takes at least this many steps where its time allows: past it, larger batches
MIN_BATCH_TOKENS = 16 * 64  # the smallest batch the rule gives, in tokens: 16 sequences of 64, 4 of 256
# The fast recipe (config/shakespeare_char_cpu_fast.toml), with the learning rate decayed to 0.
RECIPE = {"pos": "rope", "optimizer": "muon", "muon_lr": 0.015, "muon_momentum": 0.9, "learning_rate": 1.5e-3,
          "min_lr": 0.0, "weight_decay": 0.1, "bias": False}
# Evaluations spread over a run with no preset, and one at the start: at most EVALS, fewer where they would
# take more than EVAL_SHARE of the time, but at least MIN_EVALS (each reading fewer batches where need be).
EVALS, MIN_EVALS, EVAL_SHARE = 12, 4, 0.03
USABLE = 0.97  # of a budget, for steps and evaluations: the rest for saving, the exit and a slower last quarter
EVAL_TOKENS = 20 * 32 * 128  # tokens per loss estimate of a val split too large to read whole, whatever the batch
SIZED = ("n_layer", "n_embd", "block_size", "batch_size")  # a run with no preset chooses these, unless all are given
# A timed run with no preset compiles where the faster steps repay the compiling: per device type, (a step's
# speed-up, seconds to compile), measured on an H100 (docs/results.md); a CPU's: docs/own_text.md.
COMPILING = {"cuda": (1.37, 41.0)}
FIRST_GUESS_FLOPS = 100e9  # the rate the first run a sizing times is chosen for: two CPU cores' (the 4 x 128 model)
SIZING_SHARE = 0.1  # of a budget, the most the sizing spends timing more runs than the first
NOISE = 0.1  # a step this machine timed before that the loop finds a tenth shorter: remembered so
# What decides a step's time, with the model's shape and the machine: a Speeds key.
TIMED = ("batch_size", "grad_accum", "optimizer", "muon_ns_steps", "grad_clip", "compile")


def parse_duration(text):
    """Seconds in '90s', '5m', '2h', '1h30m', '1.5h' or a plain number of seconds."""
    cleaned = text.strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+(\.\d*)?", cleaned):
        cleaned += "s"
    parts = re.findall(r"(\d+(?:\.\d*)?)([hms])", cleaned)
    if not parts or "".join(n + u for n, u in parts) != cleaned:
        raise UserError(f"max_time must be a duration such as 90s, 5m, 2h or 1h30m, got {text!r}")
    seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    if not seconds <= MAX_BUDGET:
        raise UserError(f"max_time {text!r} is longer than a run can plan for (at most 1000h); give a shorter one")
    return seconds


# --- The rule -----------------------------------------------------------------------------


def shape_settings(n_layer, n_embd):
    """The shape's settings, heads and context as SHAPES says (fewer heads where they would not divide n_embd)."""
    n_head = max(1, n_embd // (32 if n_embd <= 256 else 64))
    while n_embd % n_head:
        n_head -= 1
    return {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "block_size": 64 if n_embd < 128 else 256}


def block_params(n_layer, n_embd):
    """Parameters inside the blocks: attention (4 C^2) and feed-forward (8 C^2) per layer."""
    return 12 * n_layer * n_embd**2


def model_flops_per_token(n_layer, n_embd, block_size, vocab_size):
    """Training FLOPs per token of a model not built yet: its blocks and the embedding it shares with the head."""
    return train_flops_per_token(block_params(n_layer, n_embd) + vocab_size * n_embd, n_layer, n_embd, block_size)


def choose_run(train_tokens, val_tokens, vocab_size, flops_per_s, seconds, given=None):
    """({setting: value}, a reason to print): the model and training for this data and budget at flops_per_s,
    the training rate measured here, chosen around `given`, the settings of SIZED, n_head and dropout set."""
    given, data_tokens = given or {}, MAX_EPOCHS * train_tokens  # what the text can usefully give

    def shape(n_layer, n_embd):  # one of SHAPES, with what was given (a width that n_head divides)
        heads_given = given.get("n_head", 1)
        n_embd = given.get("n_embd", heads_given * max(1, round(n_embd / heads_given)))
        settings = shape_settings(given.get("n_layer", n_layer), n_embd)
        settings["block_size"] = given.get("block_size", min(settings["block_size"], val_tokens // 2))
        return settings

    def tokens(s, most=data_tokens):  # what the budget can train a model so shaped on
        return min(most, flops_per_s * seconds / model_flops_per_token(s["n_layer"], s["n_embd"], s["block_size"],
                                                                      vocab_size))

    def fed(s):  # enough tokens per parameter, and MIN_STEPS steps even at the smallest batch (or the whole text)
        n, smallest_batch = tokens(s), given.get("batch_size", MIN_BATCH_TOKENS / s["block_size"])
        enough_steps = n >= data_tokens or n >= MIN_STEPS * s["block_size"] * smallest_batch
        return enough_steps and n >= TOKENS_PER_PARAM * block_params(s["n_layer"], s["n_embd"])

    shapes = [shape(*s) for s in SHAPES]
    settings = next((s for s in reversed(shapes) if fed(s)), shapes[0])  # the largest the budget and text feed
    block, total = settings["block_size"], tokens(settings)
    epochs = total / train_tokens
    # A batch for MIN_STEPS steps; a run that the text ends before the time spends the time left on more steps.
    steps = MIN_STEPS * tokens(settings, math.inf) / total
    # Dropout: none up to 8 passes, 0.1 more each time they double, at most 0.2, and 0.06 less than that each
    # time the tokens per parameter double from the fewest the rule allows (a model with many still learns).
    per_param = total / block_params(settings["n_layer"], settings["n_embd"])
    most = 0.2 - 0.06 * math.log2(max(per_param, TOKENS_PER_PARAM) / TOKENS_PER_PARAM)
    dropout = given.get("dropout", round(max(0.0, min(0.1 * math.log2(epochs / 8), most)), 2))
    # Rounded to a multiple of 8: down where the text is read often enough for dropout, whose runs gain from more,
    # noisier steps (the Cyrillic text: docs/own_text.md); else to the nearest.
    to_8 = math.floor if dropout else round
    batch = given.get("batch_size", max(1, MIN_BATCH_TOKENS // block, min(128, 8 * to_8(total / (block * steps) / 8))))
    eval_iters = 0 if val_tokens <= EVAL_TOKENS else math.ceil(EVAL_TOKENS / (batch * block))  # 0: whole, exact
    decay = 0.0 if dropout else 0.1  # Muon's weight decay, only without dropout: on a text read often, both do worse
    settings.update(RECIPE, batch_size=batch, dropout=dropout, muon_weight_decay=decay, eval_iters=eval_iters)
    return settings, f"about {total / 1e6:.3g}M tokens of training ({epochs:.1f} passes over the text)"


def size_run(cfg, sources, sizes, seconds_left, world, measure):
    """(cfg with the model and training choose_run picks, except what the command line set; a line saying
    so). sizes: (train tokens, val tokens, vocabulary); measure(cfg)[0]: a step's seconds, each of world
    processes. choose_run goes by the rate of the run it chose before (at first, FIRST_GUESS_FLOPS) until the
    choice stands (the rate grows with the model and batch, falls with dropout) or SIZING_SHARE of the time is spent."""
    rope = cfg.mixer == "multihead" and cfg.score == "dot"  # the recipe's rotary angles turn q·k's q and k

    def free(settings):  # what the command line did not set
        return {k: v for k, v in settings.items() if k not in sources and (rope or k != "pos")}

    given = {k: getattr(cfg, k) for k in (*SIZED, "n_head", "dropout") if k in sources}
    seconds = USABLE * (1 - EVAL_SHARE) * seconds_left  # what the steps will have: the plan's, less evaluations
    settings, tried, started = choose_run(*sizes, FIRST_GUESS_FLOPS, seconds, given)[0], [], time.perf_counter()
    for _ in range(5):
        trial, t0 = dataclasses.replace(cfg, **free(settings)), time.perf_counter()
        step_s = measure(trial)[0]
        spent = time.perf_counter() - started
        if seconds_left - spent < step_s:  # not a step left to train
            raise UserError(f"max_time {cfg.max_time or DEFAULT_BUDGET} is too short to size a run for this data: "
                            f"timing {trial.n_layer} layers x {trial.n_embd} (a vocabulary of {sizes[2]:,}) took "
                            f"{time.perf_counter() - t0:.1f} s; give more time, or the whole shape (--n_layer, "
                            "--n_embd, --block_size, --batch_size)")
        flops = model_flops_per_token(trial.n_layer, trial.n_embd, trial.block_size, sizes[2])
        rate = world * trial.batch_size * trial.grad_accum * trial.block_size * flops / step_s
        settings, reason = choose_run(*sizes, rate, seconds, given)
        chosen = [settings[k] for k in (*SIZED, "dropout")]
        if chosen == [getattr(trial, k) for k in (*SIZED, "dropout")] or chosen in tried \
                or spent + time.perf_counter() - t0 > SIZING_SHARE * seconds_left:
            break  # it stands, it came back, or another timing would take more than its share
        tried.append(chosen)
    cfg = dataclasses.replace(cfg, **free(settings))
    kept = sorted(k for k in settings if k in sources)  # the rule's estimate is then of another run: not said
    said = (f"no preset: sized for the data ({sizes[0]:,} training tokens): {cfg.n_layer} layers x {cfg.n_embd} "
            f"wide, block {cfg.block_size}, batch {cfg.batch_size}, dropout {cfg.dropout:g}, {cfg.optimizer}, "
            f"{cfg.pos} positions{', compiled' * cfg.compile}"
            + (f" ({', '.join(kept)} as given)" if kept else f": {reason}"))
    return cfg, said


def size_for_data(cfg, sources, data, procs, time_budget, measure):
    """cfg sized for data (meta.json, the splits) and what is left of the time (time_budget's, or
    DEFAULT_BUDGET's) by size_run, said on rank 0; the time budget learns the most steps worth taking."""
    meta, splits = data
    seconds = time_budget.seconds if time_budget else parse_duration(DEFAULT_BUDGET)
    sizes = len(splits["train"]), len(splits["val"]), meta["vocab_size"]
    left = seconds - procs.broadcast((process_age(),))[0]  # rank 0's clock: all size alike
    speedup, compiling = COMPILING.get(procs.device_type, (1.0, 0.0))
    compiled = (left - compiling) * speedup  # what is left after compiling, in seconds at the eager rate measured
    if time_budget is not None and time_budget.max_steps is None and "compile" not in sources:  # where it pays
        cfg = dataclasses.replace(cfg, compile=compiled > left and not compiler_missing(procs.device_type))
    cfg, said = size_run(cfg, sources, sizes, compiled if cfg.compile else left, procs.world, measure)
    procs.say(said)
    if time_budget is not None:
        most = most_steps(sizes[0], procs.world * cfg.batch_size * cfg.grad_accum * cfg.block_size)
        time_budget.max_steps = min(most, time_budget.max_steps or most)
    return cfg


def most_steps(train_tokens, tokens_per_step):
    """The steps worth taking on a text: MAX_EPOCHS passes over it."""
    return max(1, int(MAX_EPOCHS * train_tokens / tokens_per_step))


# --- The time ------------------------------------------------------------------------------


class Budget:
    """A run's time budget (--max_time, or DEFAULT_BUDGET): steps fitted to a probe (fit), then to the loop's
    own times (replan). max_steps: the most worth taking (--max_iters, or what the data can use); speeds:
    this machine's Speeds, which the loop's step times correct."""

    def __init__(self, cfg, sources, speeds=None):
        self.seconds, self.sources, self.speeds = parse_duration(cfg.max_time or DEFAULT_BUDGET), sources, speeds
        self.max_steps = cfg.max_iters if sources.get("max_iters") == "command line" else None
        self.spread = "eval_interval" not in sources  # the budget spreads the evaluations over the run
        self.planned = self.evals = None  # fit's steps, and its evaluations (the first one included)

    def fit(self, cfg, step_s, eval_s, elapsed, val_tokens=0):
        """(cfg with the steps that fit in what is left of the budget, a line saying so). Evaluations are
        spread over the run unless eval_interval is given; one of the whole val split (val_tokens long) reads
        part of it where the fewest would take half the time. elapsed: rank 0's clock, so all plan alike."""
        left, given = USABLE * self.seconds - elapsed, self.sources
        step_s = (self.speeds and self.speeds.loop_step(cfg)) or step_s  # the last loop's here: the speed today
        if self.spread and "eval_iters" not in given and (cfg.eval_iters or (MIN_EVALS + 1) * eval_s > left / 2):
            cfg, eval_s = fewer_batches_per_evaluation(cfg, left, eval_s, val_tokens)
        steps = plan_steps(left, step_s, eval_s, None if self.spread else cfg.eval_interval, self.max_steps)
        self.planned, self.evals = steps, spread_evaluations(left, eval_s) + 1
        if steps < 1 and self.max_steps != 0:  # (--max_iters=0: an evaluation, and no step)
            evals = self.evals if self.spread else 2  # the first, and the last at least
            raise UserError(f"max_time {cfg.max_time or DEFAULT_BUDGET} leaves {max(left, 0):.0f} s after "
                            f"start-up, less than a step ({step_s:.2f} s) and the {evals} evaluations a run "
                            f"needs ({eval_s:.2f} s each); give more time, or a smaller model")
        capped = " (--max_iters)" if given.get("max_iters") == "command line" and steps == cfg.max_iters else ""
        cfg = self.steps_and_evaluations(cfg, steps, math.ceil(steps / (self.evals - 1)))
        return cfg, (f"time budget {cfg.max_time or DEFAULT_BUDGET}: {cfg.max_iters:,} steps{capped} of "
                     f"{step_s * 1000:.0f} ms and an evaluation every {cfg.eval_interval:,} ({eval_s:.1f} s each) "
                     f"in the {left:.0f} s left")

    def replan(self, cfg, it, step_s, eval_s, now, evaluated):
        """(cfg with its steps fitted again at iteration it to the loop's mean step and evaluation times, a line
        saying so or None; evaluated: the evaluations made so far). A probe can be 20% off on a busy machine;
        past 3/4 of the run the plan only shrinks, as late steps can slow by 40% (a 2-core CPU)."""
        if self.speeds is not None and it >= max(50, cfg.max_iters // 4):  # enough of the loop to go by
            self.speeds.learn(cfg, step_s)
            self.speeds = None  # once
        left = USABLE * self.seconds - now
        room = None if self.max_steps is None else max(0, self.max_steps - it)
        steps = it + (plan_steps(left, step_s, eval_s, cfg.eval_interval, room, it) if room != 0 else 0)
        steps = steps if it <= 0.75 * cfg.max_iters else min(steps, cfg.max_iters)
        said = interval = None
        if abs(steps - cfg.max_iters) >= 0.01 * cfg.max_iters:
            said = (f"time budget: steps take {step_s * 1000:.0f} ms and evaluations {eval_s:.1f} s so far: "
                    f"{steps:,} steps in all (planned: {cfg.max_iters:,})")
            if self.planned and steps < self.planned / 2 <= cfg.max_iters:  # said once, as it falls past half
                said += (f"; under half the {self.planned:,} the run was sized for: the machine is slower than "
                         "when it was timed, so this run trains less than planned")
            if self.evals:  # those still to come over the steps still to come, never closer than over the whole
                interval = max(math.ceil((steps - it) / max(1, self.evals - evaluated)),
                               math.ceil(steps / (self.evals - 1)))
        return self.steps_and_evaluations(cfg, steps, interval), said

    def steps_and_evaluations(self, cfg, steps, eval_interval=None):
        """cfg with `steps` steps: the learning rate decays over them, warms up over at most a tenth of them,
        and evaluations come every eval_interval (None: as they did); except where the command line says."""
        changes = {"lr_decay_iters": steps, "warmup_iters": min(cfg.warmup_iters, max(1, steps // 10))}
        if eval_interval is not None and self.spread:
            changes["eval_interval"] = max(1, eval_interval)
        changes = {k: v for k, v in changes.items() if self.sources.get(k) != "command line"}
        return dataclasses.replace(cfg, max_iters=steps, **changes)


class LoopTimes:
    """The training loop's own times on the budget's clock, for replan: the time since the loop started,
    less its evaluations, over its steps. Each evaluation runs inside `with loop_times:`."""

    def __init__(self, it):
        self.start, self.first, self.eval_seconds, self.evals = process_age(), it, 0.0, 0

    def __enter__(self):
        self.eval_started = process_age()

    def __exit__(self, *exc):
        self.eval_seconds, self.evals = self.eval_seconds + process_age() - self.eval_started, self.evals + 1

    def means(self, it):
        """(seconds per step, seconds per evaluation, the clock now, the evaluations made) at iteration it,
        or None before the loop has both stepped and evaluated."""
        if not self.evals or it <= self.first:
            return None
        now = process_age()
        return (now - self.start - self.eval_seconds) / (it - self.first), self.eval_seconds / self.evals, now, \
            self.evals


class Speeds:
    """The seconds of a step, a forward pass and a checkpoint's save of each run timed on this machine (and
    the loop's own step), kept in the user's cache so that the same command chooses the same run untimed.
    Keyed by the machine (device.machine) and the run. A compiled run is timed afresh: timing compiles it."""

    def __init__(self, machine, vocab_size):
        self.path, self.machine, self.vocab_size = Path(cache_dir()) / "speeds.json", machine, vocab_size
        self.runs = self.read().get(machine, {})

    def key(self, cfg):
        shape = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig) if hasattr(cfg, f.name)}
        return json.dumps([shape, self.vocab_size, *(getattr(cfg, k) for k in TIMED)], sort_keys=True)

    def kept(self, cfg):
        """What this machine keeps of cfg: [step, forward, save(, the last loop's step)] seconds, or []."""
        return [] if cfg.compile else self.runs.get(self.key(cfg), [])

    def get(self, cfg):
        """(step, forward, save) seconds of cfg as this machine timed them, or None."""
        return tuple(self.kept(cfg)[:3]) or None

    def put(self, cfg, times):
        if not cfg.compile:
            self.runs[self.key(cfg)] = list(times)
            self.save()

    def measure(self, cfg, time_it):
        """cfg's (step, forward, save) seconds: as this machine timed them before, else time_it()'s, kept."""
        if (times := self.get(cfg)) is None:
            print(f"timing {cfg.n_layer} layers x {cfg.n_embd}, batch {cfg.batch_size} x {cfg.block_size}: a few "
                  "steps", flush=True)
            self.put(cfg, times := time_it())
        return times

    def learn(self, cfg, step_s):
        """The loop's mean step of cfg, step_s: the next run of cfg plans its steps by it (loop_step), and is
        chosen by it where it is shorter than the step kept by more than NOISE: a few timed steps can come out
        long (the machine busy, its caches cold), never short, and a busy hour must not shrink the next run."""
        if times := self.get(cfg):
            best = step_s if step_s < (1 - NOISE) * times[0] else times[0]
            self.put(cfg, (best, times[1] * best / times[0], times[2] * best / times[0], step_s))

    def loop_step(self, cfg):
        """The mean step the loop of the last run of cfg took here, or None."""
        times = self.kept(cfg)
        return times[3] if len(times) == 4 else None

    def read(self):
        """{machine: {run: times}} from the cache; nothing from a file that is missing, unreadable or damaged."""
        try:
            machines = json.loads(self.path.read_text(encoding="utf-8"))["machines"]
            return {m: {k: t for k, t in runs.items() if len(t) in (3, 4) and all(0 <= x < 1e6 for x in t)}
                    for m, runs in machines.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return {}

    def save(self):
        """What this run measured, merged into the cache; a cache that cannot be written keeps nothing."""
        with contextlib.suppress(OSError, filelock.Timeout):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with filelock.FileLock(f"{self.path}.lock", timeout=10):  # two runs at once: one after the other
                machines = self.read()
                machines[self.machine] = machines.get(self.machine, {}) | self.runs
                write_atomic(self.path, json.dumps({"format": 1, "machines": machines}, indent=1).encode("utf-8"))


def repeat_command(cfg):
    """The command that trains cfg (a train.TrainConfig, as decided) again without timing anything: the
    shape and steps chosen, and every other setting away from its default, into OUT_DIR_repeat."""
    default, always = type(cfg)(), {*SIZED, "n_head", "max_iters", "dtype"}
    skip = {"max_time", "out_dir", "overwrite", "dry_run"} | ({"init_from"} if cfg.init_from == "resume" else set())
    args = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in dataclasses.asdict(cfg).items()
            if k not in skip and (k in always or v != getattr(default, k))]
    return shlex.join(["python", "train.py", *args, f"--out_dir={cfg.out_dir}_repeat"])


def preview(cfg, say):
    """A dry run's last words, through say: how to train the run it planned. Its exit code."""
    say(f"to train it: {repeat_command(cfg)}\ndry run: nothing trained, nothing written")
    return 0


def save_repeat_command(cfg):
    """repeat_command(cfg), written to OUT_DIR/repeat.txt, and returned."""
    path, command = Path(cfg.out_dir) / "repeat.txt", repeat_command(cfg)
    try:
        write_atomic(path, (command + "\n").encode("utf-8"))
    except OSError as e:
        raise UserError(f"{write_error(path, e)}; the checkpoints are whole: free some space") from None
    return command


def fewer_batches_per_evaluation(cfg, seconds_left, eval_s, val_tokens=0):
    """(cfg, eval_s) with fewer batches per evaluation, so that the fewest a short run gets (MIN_EVALS and the
    first) take about EVAL_SHARE of its time, but at least EVAL_TOKENS / 8; eval_iters 0 reads val_tokens."""
    batches = cfg.eval_iters or val_tokens / (cfg.batch_size * cfg.block_size)
    least = math.ceil(EVAL_TOKENS / 8 / (cfg.batch_size * cfg.block_size))
    iters = math.ceil(min(batches, max(least, int(batches * EVAL_SHARE * seconds_left / ((MIN_EVALS + 1) * eval_s)))))
    if iters >= batches:  # all of it, as it was
        return cfg, eval_s
    return dataclasses.replace(cfg, eval_iters=iters), eval_s * iters / batches


def spread_evaluations(seconds_left, eval_s):
    """How many evaluations to spread over a run of seconds_left when each takes eval_s (EVALS)."""
    return max(MIN_EVALS, min(EVALS, int(EVAL_SHARE * seconds_left / max(eval_s, 1e-9))))


def plan_steps(seconds_left, step_s, eval_s, eval_interval=None, max_steps=None, start=0):
    """How many steps after step `start` fit in seconds_left (at most max_steps), each step_s, with an evaluation
    of eval_s at each multiple of eval_interval from `start` on and at the end (None: spread_evaluations + 1)."""

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


def time_steps(step, model, batch, autocast, optimizer, scaler, calls=None):
    """(seconds per training step, per forward pass of batch (x, y) in eval mode, to save a checkpoint), timed;
    model, optimizer and scaler are then put back as they were. calls: exactly that many of each (processes that
    synchronize in a step must run as many), else steps for half a second (a quarter came out long), the forward
    pass for a tenth (evaluations are a small share of a run)."""
    before = [(part, copy.deepcopy(part.state_dict())) for part in (model, optimizer, scaler)]

    def forward():
        with torch.no_grad(), autocast:
            model(*batch)[1].item()

    step_s = time_per_call(step, min_seconds=0.5, calls=calls)
    model.eval()
    forward_s = time_per_call(forward, min_seconds=0.1, warmup=1, calls=calls)
    model.train()
    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, io.BytesIO())
    save_s = 2 * (time.perf_counter() - t0)  # ckpt.pt, and best.pt when val improves
    for part, state in before:
        part.load_state_dict(state)
    optimizer.zero_grad(set_to_none=True)
    return step_s, forward_s, save_s


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
