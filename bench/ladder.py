"""Trains every rung of the ladder (config/ladder/*.toml) on one budget, and tabulates them.

    python bench/ladder.py                 # the CPU budget (the presets as written): rungs 1-8 in 30 minutes, 2 cores
    python bench/ladder.py --budget=gpu    # the 5000-step reference settings (block 256, 384 wide)
    python bench/ladder.py --rungs=3,4 --max_iters=500 --out=out/try   # train.py's options pass through

Each rung trains with train.py into OUT/RUNG, in a process of its own so that its
peak memory is its own. Then the table (rung, parameters, final train and val loss,
median tokens/s, peak memory, wall time) is printed and written to OUT/ladder.md and
OUT/ladder.json. Run the same command again and a finished rung is skipped, one
stopped part way (Ctrl-C) resumes; --force trains them again.
"""

import contextlib
import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's modules

import torch  # noqa: E402
from machine import machine  # noqa: E402

import train  # noqa: E402
from config import UserError, help_text, load_config, option  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tinygpt import system  # noqa: E402
from tinygpt.files import (  # noqa: E402  # noqa: E402
    check_block_size,
    load_checkpoint,  # noqa: E402
    load_data,
    write_atomic,
    write_error,
)
from tinygpt.system import check_model_fits, choose_device, pick_dtype  # noqa: E402

PRESETS = ROOT / "config" / "ladder"

# Each budget's settings on top of the presets. The CPU budget is the presets as
# written; the GPU one is the reference run's shape (config/shakespeare_char.toml).
BUDGETS = {
    "cpu": {},
    "gpu": {"device": "auto", "n_embd": 384, "n_head": 6, "block_size": 256, "batch_size": 64,
            "max_iters": 5000, "eval_interval": 250},
}
GPU_DEEP_LAYERS = 6  # on the GPU budget the residual rungs get the reference's depth; the others keep theirs
# Dropout suits the GPU budget, where the 10M model overfits, and not the CPU one, where the 0.8M
# model underfits: on the GPU the rungs from the full GPT (rung 8) on get the reference's 0.2.
FULL_GPT_RUNG, GPU_DROPOUT = 8, 0.2
# Additive scores hold a (B, H, T, S, hs) tensor: 6.4 GB a layer at batch 64 and block 256 in fp32.
# On the GPU budget those rows take their 64 sequences a step in 4 micro-batches of 16.
GPU_ADDITIVE_ACCUM = 4
LADDER_OWNS = ("out_dir", "init_from", "overwrite")  # train.py options the ladder sets itself
COLUMNS = ("rung", "parameters", "train loss", "val loss", "tokens/s", "peak memory", "wall time")
USAGE = "usage: python bench/ladder.py [--budget=cpu|gpu] [--rungs=RUNG,...] [--out=DIR] [--force] [TRAIN.PY OPTIONS]"
DESCRIPTION = "Trains every rung in config/ladder/ on one budget and tabulates them."


@dataclass
class LadderConfig:
    budget: str = option("cpu", "cpu (the presets as written) or gpu (the 5000-step reference settings)",
                         choices=tuple(BUDGETS))
    rungs: list[str] = option([], "rungs to train, by name or number, e.g. 03_head,4 (none: all)")
    out: str = option("", "where the runs and the table go (empty: out/ladder, or out/ladder_gpu)")
    force: bool = option(False, "train finished or differently configured rungs again, from scratch")


# --- Choosing the rungs ------------------------------------------------------------------


def rung_label(number):
    """A rung's number as people say it: '08' and '8' are 8, '04b' is 4b (a row beside rung 4)."""
    return number.lstrip("0") or "0"


def pick_rungs(wanted):
    """The presets named in wanted (03_head, 3, head; 04b_multihead_additive, 4b, ...), in ladder order;
    all if none. The files' names sort in the order of the lesson: 04_multihead, 04b_..., 05_..."""
    presets = sorted(PRESETS.glob("*.toml"))
    if not presets:
        raise UserError(f"no presets in {PRESETS}; the ladder needs config/ladder/*.toml")
    names = {p: {p.stem, p.stem.split("_", 1)[-1], rung_label(p.stem.split("_", 1)[0])} for p in presets}
    chosen = set()
    for item in wanted:
        for name in filter(None, (n.strip() for n in item.split(","))):
            hits = {p for p in presets if (rung_label(name) if re.fullmatch(r"\d+[a-z]?", name) else name) in names[p]}
            if not hits:
                raise UserError(f"--rungs: no rung {name!r}; the rungs are {', '.join(p.stem for p in presets)}")
            chosen |= hits
    if wanted and not chosen:  # --rungs= given but empty: not "all", which leaving it out says
        raise UserError(f"--rungs is empty; name rungs by number or name, e.g. --rungs=3,4, or leave it out for all; "
                        f"the rungs are {', '.join(p.stem for p in presets)}")
    return sorted(chosen) if chosen else presets


def budget_args(budget, preset):
    """The --key=value settings that put preset on the budget."""
    settings = dict(BUDGETS[budget])
    if budget == "gpu":
        cfg = load_config(train.TrainConfig, [str(preset)])
        if cfg.residual:
            settings["n_layer"] = GPU_DEEP_LAYERS
        if int(re.match(r"\d+", preset.stem).group()) >= FULL_GPT_RUNG:
            settings["dropout"] = GPU_DROPOUT
        if cfg.window:  # the same share of the longer context
            settings["window"] = cfg.window * settings["block_size"] // cfg.block_size
        if cfg.score == "additive":
            settings["batch_size"] //= GPU_ADDITIVE_ACCUM
            settings["grad_accum"] = GPU_ADDITIVE_ACCUM
    return [f"--{k}={v}" for k, v in settings.items()]


# --- One rung ------------------------------------------------------------------------------


def run_state(out_dir, cfg):
    """('new' | 'finished' | 'stopped' | 'different', the differing settings) for the run in out_dir."""
    if not (out_dir / "ckpt.pt").exists():
        return "new", {}
    ckpt = load_checkpoint(out_dir / "ckpt.pt")
    now, then = dataclasses.asdict(cfg), ckpt["train_config"]
    device_type = torch.device(choose_device(cfg.device)).type
    now["dtype"] = str(pick_dtype(cfg.dtype, device_type, training=True)).removeprefix("torch.")  # as train.py keeps it
    defaults = dataclasses.asdict(train.TrainConfig())  # for options newer than the run: it had their default
    diff = {k: (then.get(k, defaults[k]), v) for k, v in now.items()
            if k not in LADDER_OWNS and then.get(k, defaults[k]) != v}
    if diff:
        return "different", diff
    done = ckpt["iter"] >= cfg.max_iters and ckpt["val_loss"] is not None  # None: saved on a signal
    return ("finished" if done else "stopped"), {}


def check_rung(cfg):
    """Every check train.py makes of cfg before it builds a model: the data holds more than a block, the
    model's switches go together, and its training fits in the device's memory."""
    name = choose_device(cfg.device)
    meta, splits = load_data(cfg.data_dir)
    check_block_size(splits, cfg.block_size, cfg.data_dir)
    mconf = train.model_config(cfg, meta["vocab_size"])
    dtype = pick_dtype(cfg.dtype, torch.device(name).type, training=True)
    check_model_fits(mconf, cfg.batch_size, cfg.block_size, name, dtype)


def read_record(out_dir):
    """What the ladder keeps of the run in out_dir: the seconds spent training it over every resume, and the
    largest peak resident memory of its processes ({} if the ladder did not train it)."""
    try:
        return json.loads((out_dir / "wall_time.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def read_wall(out_dir):
    return read_record(out_dir).get("wall_s")


def train_rung(args, out_dir, resuming):
    """Runs train.py in a child process and keeps its wall time; returns its exit code. A process of
    its own, because a process's peak memory never comes back down: in this one, each rung would show
    the largest peak of the rungs before it. train.py logs its peak with each evaluation."""
    before = (read_wall(out_dir) or 0.0) if resuming else 0.0
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args])
    # Ctrl-C reaches the child by itself (the terminal signals its whole process group); a SIGTERM
    # sent to the ladder alone is passed on. Either way the child saves a checkpoint and stops.
    previous = {s: signal.signal(s, lambda signum, frame: child.send_signal(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if hasattr(os, "wait4"):  # the child's own resource use: its peak resident memory
            status, usage = os.wait4(child.pid, 0)[1:]
            code, rss = os.waitstatus_to_exitcode(status), usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        else:
            code, rss = child.wait(), None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if out_dir.is_dir():
        rss = max(filter(None, [rss, read_record(out_dir).get("peak_rss") if resuming else None]), default=None)
        record = json.dumps({"wall_s": before + time.perf_counter() - t0, "peak_rss": rss}) + "\n"
        with contextlib.suppress(OSError):  # the record is a nicety: a full disk must not hide the run's exit code
            write_atomic(out_dir / "wall_time.json", record.encode())
    return code


def summarize(name, out_dir):
    """The table's row for the finished run in out_dir."""
    records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text(encoding="utf-8").splitlines()]
    final = [r for r in records if "val_loss" in r][-1]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    model_config = load_checkpoint(out_dir / "ckpt.pt")["model_config"]
    cuda = [r["peak_memory"] for r in records if "peak_memory" in r]  # train.py logs a GPU's, over its resumes
    peak = {"bytes": max(cuda), "of": "cuda"} if cuda else {"bytes": read_record(out_dir).get("peak_rss"), "of": "rss"}
    return {"rung": name, "parameters": GPT(GPTConfig(**model_config)).num_params(), "iters": final["iter"],
            "train_loss": final["train_loss"], "val_loss": final["val_loss"],
            "tokens_per_s": statistics.median(speeds) if speeds else None, "peak_memory_bytes": peak["bytes"],
            "peak_memory_of": peak["of"], "wall_s": read_wall(out_dir), "out_dir": str(out_dir)}


# --- The table -----------------------------------------------------------------------------


def describe_budget(budget, configs, overrides):
    """One line saying what every rung trained on, for above the table: configs {rung: TrainConfig}."""
    cfg = next(iter(configs.values()))
    extra = f", with {' '.join(overrides)}" if overrides else ""
    loss_on = "the whole val split" if cfg.eval_iters == 0 else f"{cfg.eval_iters} val batches"
    recipe = lambda c: (c.optimizer, c.learning_rate)  # noqa: E731
    own = [name for name, c in configs.items() if recipe(c) != recipe(cfg)]  # e.g. the modern GPT's Muon
    except_own = f" ({', '.join(own)}: the optimizer and learning rates of their presets)" if own else ""
    return (f"budget {budget}{extra}: {cfg.max_iters} steps of {cfg.batch_size} x {cfg.block_size} tokens, "
            f"{cfg.n_embd} wide, {cfg.n_head} heads, {cfg.optimizer} at learning rate {cfg.learning_rate:g}"
            f"{except_own}; losses at the last step, on {loss_on}")


def minutes(seconds):
    return "?" if seconds is None else "{}:{:02d}".format(*divmod(round(seconds), 60))


def markdown(rows, header):
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    for r in rows:
        speed = "?" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        memory = "?" if r.get("peak_memory_bytes") is None else f"{r['peak_memory_bytes'] / 2**20:,.0f} MiB"
        cells = (r["rung"], f"{r['parameters']:,}", f"{r['train_loss']:.4f}", f"{r['val_loss']:.4f}", speed,
                 memory, minutes(r["wall_s"]))
        lines.append("| " + " | ".join(cells) + " |")
    walls = [r["wall_s"] for r in rows]
    total = f", {minutes(sum(walls))} in all" if None not in walls else ""
    kinds = {r.get("peak_memory_of") for r in rows} - {None}
    memory = {"rss": "the peak resident memory of the process that trained the rung, in training or in "
                     "evaluation (4 batches at once), torch's own memory included (see the bigram's row)",
              "cuda": "the peak of GPU memory allocated to tensors while the rung trained"}
    lines += ["", f"tokens/s: the median logged training step; peak memory: "
              f"{'; or '.join(memory[k] for k in sorted(kinds)) or 'not measured'}; "
              f"wall time: training and evaluation, in a fresh process{total}."]
    return "\n".join(lines) + "\n"


@system.cli
def main(argv):
    if {"-h", "--help"} & set(argv):
        print(USAGE + help_text(LadderConfig, "bench/ladder.py", DESCRIPTION).split("\n", 1)[1])
        print("\nAny train.py option (python train.py --help) passes through to every rung, e.g. --max_iters=500.")
        return 0
    for before, arg in zip(["--"] + argv, argv):  # a word that is no option's value: a preset, which the ladder has
        if not arg.startswith("--") and not (before.startswith("--") and "=" not in before and before != "--"):
            raise UserError(f"command line: unexpected {arg!r}; the ladder trains config/ladder/*.toml and "
                            "takes only --key=value options (python bench/ladder.py --help)")
    overrides = []  # train.py's options, passed through to every rung
    cfg = load_config(LadderConfig, argv, rest=overrides)
    owned = [a for a in overrides if a[2:].partition("=")[0].replace("-", "_") in LADDER_OWNS]
    if owned:
        raise UserError(f"command line: the ladder sets {owned[0].partition('=')[0]} itself; use --out for the "
                        "directory and --force to train again")
    load_config(train.TrainConfig, overrides)  # a bad train.py option fails now, not at rung 5
    out = Path(cfg.out or ("out/ladder" if cfg.budget == "cpu" else f"out/ladder_{cfg.budget}"))
    blocked = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocked:  # else each rung's train.py would fail on it, naming its own --out_dir
        raise UserError(f"--out {out} cannot be a directory: {blocked} is a file; pick another --out")

    # Plan every rung before training any, so a mistake shows now and not after twenty minutes.
    plan = []
    for preset in pick_rungs(cfg.rungs):
        out_dir = out / preset.stem
        shown = os.path.relpath(preset)  # config/ladder/... when run from the repository
        args = [str(preset) if shown.startswith("..") else shown, *budget_args(cfg.budget, preset), *overrides,
                f"--out_dir={out_dir}"]
        rung_cfg = load_config(train.TrainConfig, args)
        try:  # the whole rung, model and data included, so a mistake fails now and not at rung 5
            check_rung(rung_cfg)
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

    configs = {name: rung_cfg for name, _, _, _, rung_cfg in plan}
    header = f"{describe_budget(cfg.budget, configs, overrides)}; machine: {machine()}"
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
