"""What a run leaves `auto`, chosen once before its first step: the model and training for its data and the
time it has (--max_time). `choose_run` is the rule: the largest model that the compute the time buys here can
feed, and a batch and dropout to go with it. train.py times a few real steps of the model it would choose; a
speed far from the one it was chosen for, rounded to a power of two, chooses again, so that the same machine
makes the same choice. A timed run's schedule then runs on its clock (train.py's progress). The measurements:
docs/own_text.md.
"""

import dataclasses
import math
import re
import shlex
import time
from pathlib import Path

from config import AUTO, UserError
from tinygpt.files import write_atomic, write_error
from tinygpt.system import train_flops_per_token

DEFAULT_BUDGET = "5m"  # max_time for a run that leaves anything auto: a few minutes of a laptop's time
MAX_BUDGET = 1000 * 3600  # the longest budget planned for, in seconds (longer ones overflow the sizing's sums)
# Model sizes, smallest first, each about twice the parameters of the one before; heads 32 wide up to 256, 64
# beyond; the context 64 below a width of 128, 256 from it.
SHAPES = [(2, 64), (3, 96), (4, 128), (5, 160), (6, 192), (6, 256), (8, 320), (8, 384), (10, 512), (12, 768)]
TOKENS_PER_PARAM = 3  # training tokens (repeats counted) a parameter needs to beat a smaller model trained longer
MAX_EPOCHS = 50  # passes over a text that still help, with dropout
MIN_STEPS = 1500  # a run takes at least this many steps where its time allows: past it, larger batches
MIN_BATCH_TOKENS = 16 * 64  # the smallest batch the rule gives, in tokens: 16 sequences of 64, 4 of 256
SIZED = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "dropout", "optimizer", "pos")  # measured
CHOSEN = (*SIZED, "max_iters", "eval_iters")  # a run that leaves one of these auto is sized (fill_auto)
# The fast recipe's choices (config/shakespeare_char_cpu_fast.toml); its rates are TrainConfig's defaults.
RECIPE = {"optimizer": "muon", "pos": "rope"}
EVALS = 10  # a timed run evaluates at its start and at each tenth of its time
EVAL_SHARE = 0.03  # of a sized run's time, the most its evaluations take, each reading fewer batches to fit
USABLE = 0.97  # of a budget, for the steps and evaluations: the rest for the last save and the exit
EVAL_TOKENS = 20 * 32 * 128  # tokens per loss estimate of a val split too large to read whole, whatever the batch
# The rate the first model timed is chosen for: two CPU cores' in fp32, between the rates a 2-core Zen 3 runs its
# 1- and 5-minute choices at (2^35.3 to 2^36.0), so that both stand. A rate measured more than 2^STANDS (1.7x) below
# the rate its model was chosen for, or rounding above it, is chosen again at the measured rate's nearest power of
# two: timings vary 10-20% from minute to minute, and a choice whose own rate rounds above is smaller than the machine
# feeds. Why these bounds, with the runs behind them: docs/own_text.md, "The rule".
FIRST_GUESS_FLOPS = 2**35.75
TIMINGS = 3  # the most models the sizing times
SIZING_SHARE = 0.25  # of a budget, start-up included: past it the sizing times nothing more (a busy machine)
STANDS = 0.75


def parse_duration(text):
    """Seconds in '90s', '5m', '2h', '1h30m', '1.5h' or a plain number of seconds; None for none."""
    cleaned = text.strip().lower().replace(" ", "")
    if cleaned in ("", "none"):
        return None
    if re.fullmatch(r"\d+(\.\d*)?", cleaned):
        cleaned += "s"
    parts = re.findall(r"(\d+(?:\.\d*)?)([hms])", cleaned)
    if not parts or "".join(n + u for n, u in parts) != cleaned:
        raise UserError(f"max_time must be a duration such as 90s, 5m, 2h or 1h30m, or none; got {text!r}")
    seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    if not 0 < seconds <= MAX_BUDGET:
        raise UserError(f"max_time {text!r} must be more than 0 and at most 1000h")
    return seconds


def max_time(cfg):
    """cfg.max_time, or for auto: DEFAULT_BUDGET where max_iters is auto too, else none."""
    if cfg.max_time != AUTO:
        return cfg.max_time
    return DEFAULT_BUDGET if cfg.max_iters == AUTO else "none"


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


def choose_run(train_tokens, val_tokens, vocab_size, flops_per_s, seconds, given=None, longest=math.inf):
    """({setting: value}, a reason to print): the shape, context, batch and dropout for this data and budget at
    flops_per_s, the training rate measured here, chosen around `given` (those of them already set, and a window);
    a context of at most `longest` tokens (the learned positions of weights fine-tuned)."""
    given, data_tokens = given or {}, MAX_EPOCHS * train_tokens  # what the text can usefully give

    def shape(n_layer, n_embd):  # one of SHAPES, with what was given (a width that n_head divides into even heads)
        pairs = 2 * given.get("n_head", 1)
        n_embd = given.get("n_embd", pairs * max(1, round(n_embd / pairs)))
        settings = shape_settings(given.get("n_layer", n_layer), n_embd)
        block = max(settings["block_size"], given.get("window", 0))  # a window given fits in the context
        settings["block_size"] = given.get("block_size", min(block, val_tokens // 2, longest))
        return settings

    def tokens(s, most=data_tokens):  # what the budget can train a model so shaped on
        flops = model_flops_per_token(s["n_layer"], s["n_embd"], s["block_size"], vocab_size)
        return min(most, max(1.0, flops_per_s * seconds / flops))

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
    per_param = total / max(1, block_params(settings["n_layer"], settings["n_embd"]))  # n_layer 0: none
    most = 0.2 - 0.06 * math.log2(max(per_param, TOKENS_PER_PARAM) / TOKENS_PER_PARAM)
    dropout = given.get("dropout", round(max(0.0, min(0.1 * math.log2(epochs / 8), most)), 2))
    # Rounded to a multiple of 8: down where the text is read often enough for dropout, whose runs gain from more,
    # noisier steps (the Cyrillic text: docs/own_text.md), but never down to none; else to the nearest.
    wanted = total / (block * steps) / 8  # in multiples of 8 sequences
    eights = math.floor(wanted) if dropout and wanted >= 1 else round(wanted)
    batch = given.get("batch_size", max(1, MIN_BATCH_TOKENS // block, min(128, 8 * eights)))
    settings.update(given, batch_size=batch, dropout=dropout)
    return settings, f"about {total / 1e6:.3g}M tokens of training ({epochs:.1f} passes over the text)"


def most_steps(train_tokens, tokens_per_step):
    """The steps worth taking on a text: MAX_EPOCHS passes over it."""
    return max(1, int(MAX_EPOCHS * train_tokens / tokens_per_step))


def eval_batches(cfg, val_tokens, per_token=None, seconds=None):
    """Batches per loss estimate: EVAL_TOKENS' worth, or 0 (the whole val split) where it holds fewer; given the
    forward pass's seconds per token, fewer where EVALS + 1 estimates of both splits would take more than EVAL_SHARE
    of the seconds, down to one."""
    tokens = cfg.batch_size * cfg.block_size
    batches = min(val_tokens, EVAL_TOKENS) / tokens
    if per_token:
        batches = max(1, min(batches, EVAL_SHARE * seconds / ((EVALS + 1) * 2 * per_token * tokens)))
    return 0 if batches * tokens >= val_tokens else math.ceil(batches)


# --- Filling what is auto -------------------------------------------------------------------


def fill_auto(cfg, sizes, measure, world=1, clock=lambda: 0.0, longest=math.inf):
    """(cfg with every setting of CHOSEN left auto chosen, and max_time; a line saying which and why). sizes: (train
    tokens, val tokens, vocabulary); measure(cfg): the seconds per step of a new model of cfg on each of world
    processes, and per forward pass of a batch as evaluations run it, rank 0's; clock(): rank 0's seconds since its
    process started; longest: the longest context (choose_run). Sized for the whole budget, start-up included: the
    same choice however long that took, but a start-up past SIZING_SHARE of it times nothing more."""
    chose, reason, per_token = {"max_time": max_time(cfg)} if cfg.max_time == AUTO else {}, "", None
    cfg = dataclasses.replace(cfg, **chose)
    seconds = parse_duration(cfg.max_time) or parse_duration(DEFAULT_BUDGET)  # none: sized as for 5m
    if any(getattr(cfg, k) == AUTO for k in SIZED):
        late = lambda: clock() > SIZING_SHARE * seconds  # noqa: E731
        sized, reason, per_token = size_run(cfg, sizes, measure, seconds, world, late, longest)
        chose |= sized
    chose |= follow(dataclasses.replace(cfg, **chose), sizes, per_token, seconds, world)
    said = ", ".join(f"{k}={v}" for k, v in chose.items())
    return dataclasses.replace(cfg, **chose), f"auto: {said}{reason}"


def follow(cfg, sizes, per_token=None, seconds=None, world=1):
    """{setting: value} for what cfg leaves auto that follows from the rest: the steps (a timed run ends sooner) and
    the batches per evaluation (eval_batches)."""
    rules = {"max_iters": lambda: most_steps(sizes[0], world * cfg.batch_size * cfg.grad_accum * cfg.block_size),
             "eval_iters": lambda: eval_batches(cfg, sizes[1], per_token, seconds)}
    return {k: rule() for k, rule in rules.items() if getattr(cfg, k) == AUTO}


def size_run(cfg, sizes, measure, seconds, world=1, late=lambda: False, longest=math.inf):
    """({setting: value} for what cfg leaves auto of SIZED, a reason, an evaluation's seconds per token): choose_run
    for a budget of seconds at a rate of FLOP/s, its model timed here, until the rate measured stands (within STANDS
    below the rate it was chosen for, the first guess's included, or rounding to it), or the choice comes
    back, or TIMINGS models have been timed; else (timed twice, the faster taken: one slow timing moves nothing) it
    is chosen again at the measured rate, rounded to a power of two. A rate measured 10-20% off, as timings are,
    gives the same choice; so does a start-up a little longer or shorter. Once late() (a busy machine's start-up and
    timings have spent SIZING_SHARE of the budget), it is chosen at the rate measured last, timing nothing more."""
    given = {k: getattr(cfg, k) for k in (*SIZED, "window") if getattr(cfg, k) != AUTO}  # window: never auto
    recipe = {k: v for k, v in RECIPE.items() if k not in given}
    rate, tried, left = FIRST_GUESS_FLOPS, [], TIMINGS
    while True:
        settings, reason = choose_run(*sizes, rate, USABLE * (1 - EVAL_SHARE) * seconds, given, longest)
        trial = dataclasses.replace(cfg, **settings, **recipe)
        rope = trial.mixer == "multihead" and trial.score == "dot" and trial.n_embd // trial.n_head % 2 == 0
        if "pos" in recipe and not rope:  # rotary angles turn pairs of a head's q and k channels
            trial = dataclasses.replace(trial, pos="learned")
        trial = dataclasses.replace(trial, **follow(trial, sizes, world=world))
        flops = model_flops_per_token(trial.n_layer, trial.n_embd, trial.block_size, sizes[2])
        step_flops = world * trial.batch_size * trial.grad_accum * trial.block_size * flops  # every process's
        if trial in tried or not left:
            break  # it came back, or no more timings: chosen at the rate measured last
        (step_s, forward_s), tried, left = measure(trial), [*tried, trial], left - 1
        stands = lambda s: -STANDS <= math.log2(step_flops / s / rate) <= 0.5  # noqa: E731, B023  used at once
        if late():
            left = 0
        elif not stands(step_s):  # off: once more, the faster
            step_s = min(step_s, measure(trial)[0])
        if stands(step_s):
            break
        rate = 2 ** round(math.log2(step_flops / step_s))
    chosen = {k: getattr(trial, k) for k in SIZED if k not in given}
    # An evaluation's forward pass takes forward_s / step_s of a step's time (a third of its FLOPs, but on a CPU
    # in fp32): its seconds per token at the rate the choice stands on.
    per_token = forward_s / step_s * flops / rate
    return chosen, f" (sized for {cfg.max_time} on {sizes[0]:,} training tokens: {reason})", per_token


def time_per_call(fn, min_seconds, min_calls=3, warmup=2):
    """Median seconds per call of fn after warmup calls (allocations, caches): min_calls at least, min_seconds too."""
    for _ in range(warmup):
        fn()
    times, start = [], time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# --- The command that trains it again -----------------------------------------------------------


def repeat_command(cfg, steps=None, world=1):
    """The command that trains cfg (a train.TrainConfig, nothing auto) again, into OUT_DIR_repeat: every setting
    away from its default; for `steps`, step-based, those steps and evaluations at each tenth of them; on world
    processes, under torchrun (on one machine)."""
    if steps is not None:
        cfg = dataclasses.replace(cfg, max_iters=steps, max_time="none", eval_interval=max(1, steps // EVALS))
    # A fine-tune starts from the same weights again (a resumed one too: init_from is how a run began).
    default = type(cfg)()
    skip = {"out_dir", "overwrite", "dry_run"} | ({"init_from"} if cfg.init_from == "resume" else set())
    args = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in dataclasses.asdict(cfg).items()
            if k not in skip and v != getattr(default, k)]
    launch = ["python"] if world == 1 else ["torchrun", "--standalone", f"--nproc_per_node={world}"]
    return shlex.join([*launch, "train.py", *args, f"--out_dir={cfg.out_dir}_repeat"])


def save_repeat_command(cfg, steps, world=1):
    """repeat_command(cfg, steps, world), written to OUT_DIR/repeat.txt, and returned."""
    path, command = Path(cfg.out_dir) / "repeat.txt", repeat_command(cfg, steps, world)
    try:
        write_atomic(path, (command + "\n").encode("utf-8"))
    except OSError as e:
        raise UserError(f"{write_error(path, e)}; the checkpoints are whole: free some space") from None
    return command
