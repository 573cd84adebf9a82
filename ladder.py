"""Trains every rung of the ladder (config/ladder/*.toml) on one budget, and tabulates them.

    python ladder.py                   # the CPU budget (the presets as written): under 30 minutes on 2 cores
    python ladder.py --budget=gpu      # the 5000-step reference settings (block 256, 384 wide)
    python ladder.py --rungs=3,4 --max_iters=500 --lr_decay_iters=500 --out=out/try   # train.py options pass through

Each rung trains with train.py into OUT/RUNG. Then the table (rung, parameters,
final train and val loss, median tokens/s, wall time) is printed and written to
OUT/ladder.md and OUT/ladder.json. Run the same command again and a finished rung
is skipped, one stopped part way (Ctrl-C) resumes; --force trains them again.
"""

import terminal  # first: Ctrl-C while torch loads (seconds) is one line, not a traceback  # isort: skip
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

import train
from checkpoint import load_checkpoint
from config import BOOL_WORDS, UserError, cli, help_text, load_config, option
from device import check_device, pick_device
from files import write_atomic, write_error
from model import GPT, GPTConfig
from tokenizer import cpu_count

PRESETS = Path(__file__).resolve().parent / "config" / "ladder"

# Each budget's settings on top of the presets. The CPU budget is the presets as
# written; the GPU one is the reference run's shape (config/shakespeare_char.toml).
BUDGETS = {
    "cpu": {},
    "gpu": {"device": "auto", "n_embd": 384, "n_head": 6, "block_size": 256, "batch_size": 64,
            "max_iters": 5000, "lr_decay_iters": 5000, "eval_interval": 250},
}
GPU_DEEP_LAYERS = 6  # on the GPU budget the residual rungs get the reference's depth; the others keep theirs
LADDER_OWNS = ("out_dir", "init_from", "overwrite")  # train.py options the ladder sets itself
COLUMNS = ("rung", "parameters", "train loss", "val loss", "tokens/s", "wall time")
USAGE = "usage: python ladder.py [--budget=cpu|gpu] [--rungs=RUNG,...] [--out=DIR] [--force] [TRAIN.PY OPTIONS]"
DESCRIPTION = "Trains every rung in config/ladder/ on one budget and tabulates them."


@dataclass
class LadderConfig:
    budget: str = option("cpu", "cpu (the presets as written) or gpu (the 5000-step reference settings)",
                         choices=tuple(BUDGETS))
    rungs: list[str] = option([], "rungs to train, by name or number, e.g. 03_head,4 (none: all)")
    out: str = option("", "where the runs and the table go (empty: out/ladder, or out/ladder_gpu)")
    force: bool = option(False, "train finished or differently configured rungs again, from scratch")


# --- The command line: the ladder's options, and train.py's passed through -----------------


def split_args(argv):
    """(the ladder's arguments, train.py's): each --key goes to the script that knows it."""
    own_fields = typing.get_type_hints(LadderConfig)
    train_fields = typing.get_type_hints(train.TrainConfig)
    own, overrides = [], []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            own.append(arg)
            continue
        if not arg.startswith("--"):
            raise UserError(f"command line: unexpected {arg!r}; ladder.py trains config/ladder/*.toml and "
                            "takes only --key=value options (python ladder.py --help)")
        name, has_value, _ = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name in LADDER_OWNS:
            raise UserError(f"command line: the ladder sets --{name} itself; use --out for the directory "
                            "and --force to train again")
        if name not in own_fields and name not in train_fields:
            raise UserError(f"command line: unknown key {name!r}: neither a ladder.py option "
                            f"({', '.join(own_fields)}) nor a train.py one (python train.py --help)")
        dest = own if name in own_fields else overrides
        dest.append(arg)
        is_bool = {**train_fields, **own_fields}[name] is bool
        if not has_value and args and (not is_bool or args[0].lower() in BOOL_WORDS):  # --key value
            dest.append(args.pop(0))
    return own, overrides


def pick_rungs(wanted):
    """The presets named in wanted (03_head, 3 or head), in ladder order; all if none."""
    presets = sorted(PRESETS.glob("*.toml"))
    if not presets:
        raise UserError(f"no presets in {PRESETS}; the ladder needs config/ladder/*.toml")
    names = {p: {p.stem, p.stem.split("_", 1)[-1], str(int(p.stem.split("_", 1)[0]))} for p in presets}
    chosen = set()
    for item in wanted:
        for name in filter(None, (n.strip() for n in item.split(","))):
            hits = {p for p in presets if (str(int(name)) if name.isdigit() else name) in names[p]}
            if not hits:
                raise UserError(f"--rungs: no rung {name!r}; the rungs are {', '.join(p.stem for p in presets)}")
            chosen |= hits
    return sorted(chosen) if chosen else presets


def budget_args(budget, preset):
    """The --key=value settings that put preset on the budget."""
    settings = dict(BUDGETS[budget])
    if budget == "gpu" and load_config(train.TrainConfig, [str(preset)]).residual:
        settings["n_layer"] = GPU_DEEP_LAYERS
    return [f"--{k}={v}" for k, v in settings.items()]


# --- One rung ------------------------------------------------------------------------------


def run_state(out_dir, cfg):
    """('new' | 'finished' | 'stopped' | 'different', the differing settings) for the run in out_dir."""
    if not (out_dir / "ckpt.pt").exists():
        return "new", {}
    ckpt = load_checkpoint(out_dir / "ckpt.pt")
    now, then = dataclasses.asdict(cfg), ckpt["train_config"]
    diff = {k: (then.get(k), v) for k, v in now.items() if k not in LADDER_OWNS and then.get(k) != v}
    if diff:
        return "different", diff
    done = ckpt["iter"] >= cfg.max_iters and ckpt["val_loss"] is not None  # None: saved on a signal
    return ("finished" if done else "stopped"), {}


def read_wall(out_dir):
    """Seconds spent training the run in out_dir, over every resume (None: not trained by the ladder)."""
    try:
        return json.loads((out_dir / "wall_time.json").read_text())["wall_s"]
    except (OSError, ValueError, KeyError):
        return None


def train_rung(args, out_dir, resuming):
    """Runs train.py in this process (it seeds itself) and keeps its wall time; returns its exit code."""
    before = (read_wall(out_dir) or 0.0) if resuming else 0.0
    t0 = time.perf_counter()
    code = train.main(args)
    if out_dir.is_dir():
        wall = json.dumps({"wall_s": before + time.perf_counter() - t0}) + "\n"
        with contextlib.suppress(OSError):  # the time is a nicety: a full disk must not hide the run's exit code
            write_atomic(out_dir / "wall_time.json", wall.encode())
    return code


def summarize(name, out_dir):
    """The table's row for the finished run in out_dir."""
    records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    final = [r for r in records if "val_loss" in r][-1]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    model_config = load_checkpoint(out_dir / "ckpt.pt")["model_config"]
    return {"rung": name, "parameters": GPT(GPTConfig(**model_config)).num_params(), "iters": final["iter"],
            "train_loss": final["train_loss"], "val_loss": final["val_loss"],
            "tokens_per_s": statistics.median(speeds) if speeds else None, "wall_s": read_wall(out_dir),
            "out_dir": str(out_dir)}


# --- The table -----------------------------------------------------------------------------


def machine():
    """What ran the ladder, in words: the processor, cores, accelerator and torch."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu} ({cpu_count()} cores, {torch.get_num_threads()} torch threads){gpu}, torch {torch.__version__}"


def describe_budget(budget, cfg, overrides):
    """One line saying what every rung trained on, for above the table."""
    extra = f", with {' '.join(overrides)}" if overrides else ""
    loss_on = "the whole val split" if cfg.eval_iters == 0 else f"{cfg.eval_iters} val batches"
    return (f"budget {budget}{extra}: {cfg.max_iters} steps of {cfg.batch_size} x {cfg.block_size} tokens, "
            f"{cfg.n_embd} wide, {cfg.n_head} heads, learning rate {cfg.learning_rate:g}; "
            f"losses at the last step, on {loss_on}")


def minutes(seconds):
    return "?" if seconds is None else "{}:{:02d}".format(*divmod(round(seconds), 60))


def markdown(rows, header):
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    for r in rows:
        speed = "?" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        cells = (r["rung"], f"{r['parameters']:,}", f"{r['train_loss']:.4f}", f"{r['val_loss']:.4f}", speed,
                 minutes(r["wall_s"]))
        lines.append("| " + " | ".join(cells) + " |")
    walls = [r["wall_s"] for r in rows]
    total = f", {minutes(sum(walls))} in all" if None not in walls else ""
    lines += ["", f"tokens/s: the median logged training step; wall time: training and evaluation{total}."]
    return "\n".join(lines) + "\n"


@cli
def main(argv):
    own, overrides = split_args(argv)
    if {"-h", "--help"} & set(own):
        print(USAGE + help_text(LadderConfig, "ladder.py", DESCRIPTION).split("\n", 1)[1])
        print("\nAny train.py option (python train.py --help) passes through to every rung, e.g. --max_iters=500.")
        return 0
    cfg = load_config(LadderConfig, own)
    load_config(train.TrainConfig, overrides)  # a bad train.py option fails now, not at rung 5
    out = Path(cfg.out or ("out/ladder" if cfg.budget == "cpu" else f"out/ladder_{cfg.budget}"))

    # Plan every rung before training any, so a mistake shows now and not after twenty minutes.
    plan = []
    for preset in pick_rungs(cfg.rungs):
        out_dir = out / preset.stem
        shown = os.path.relpath(preset)  # config/ladder/... when run from the repository
        args = [str(preset) if shown.startswith("..") else shown, *budget_args(cfg.budget, preset), *overrides,
                f"--out_dir={out_dir}"]
        rung_cfg = load_config(train.TrainConfig, args)
        try:  # the whole rung, model and data included, so a mistake fails now and not at rung 5
            train.check_settings(rung_cfg, check_device(pick_device(rung_cfg.device)))
        except UserError as e:
            raise UserError(f"rung {preset.stem}: {e}") from None
        state, diff = run_state(out_dir, rung_cfg)
        if state == "different" and not cfg.force:
            shown = ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in list(diff.items())[:4])
            raise UserError(f"{out_dir} holds a run with other settings ({shown}); --force trains it again "
                            "from scratch, or pick another --out")
        if cfg.force and state != "new":
            args.append("--overwrite=true")
            state = "new"
        elif state == "stopped":
            args.append("--init_from=resume")
        plan.append((preset.stem, out_dir, args, state, rung_cfg))
    first_cfg = plan[0][4]

    rows = []
    for n, (name, out_dir, args, state, _) in enumerate(plan, 1):
        if state == "finished":
            print(f"[{n}/{len(plan)}] {name}: finished in {out_dir}, skipped (--force trains it again)")
        else:
            verb = "resuming" if state == "stopped" else "training"
            print(f"[{n}/{len(plan)}] {name}: {verb}: python train.py {' '.join(args)}", flush=True)
            code = train_rung(args, out_dir, resuming=state == "stopped")
            if code != 0:
                if code > 128:  # stopped by a signal, with a checkpoint to resume from
                    print(f"ladder stopped at {name}; run the same command again to go on from there")
                return code
        rows.append(summarize(name, out_dir))

    header = f"{describe_budget(cfg.budget, first_cfg, overrides)}; machine: {machine()}"
    table = markdown(rows, header)
    print(table, end="")
    record = {"budget": cfg.budget, "overrides": overrides, "machine": machine(), "rows": rows}
    try:
        write_atomic(out / "ladder.md", table.encode())
        write_atomic(out / "ladder.json", (json.dumps(record, indent=2) + "\n").encode())
    except OSError as e:
        raise UserError(f"{write_error(out, e)}; the runs are kept: free some space and run the same command again") \
            from None
    print(f"wrote {out / 'ladder.md'} and {out / 'ladder.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
