"""Fine-tuning against training from scratch: steps and seconds to a val loss on another text.

    python prepare.py                            # Tiny Shakespeare -> data/shakespeare_char (once)
    python bench/finetune.py                     # docs/finetuning.md's table: on an idle CPU, one run at a time
    python bench/finetune.py --base=out/shakespeare_char_cpu_fast/ckpt.pt   # a Shakespeare model you have
    python bench/finetune.py --text=notes.txt --target=1.5

1. The base: a character model of Tiny Shakespeare, trained with --preset into
   OUT/base, unless --base names a checkpoint of one.
2. The other text (--text: a file, or a directory whose files are joined; the
   table in docs/finetuning.md used the license texts Debian ships in its
   base-files package, English prose nearly all in Shakespeare's characters) is
   prepared as characters into OUT/data; its last 10% is the held-out val split,
   which neither run trains on.
3. Two runs on it with the same preset, settings and seed: fine-tuning the base
   (--init_from) and training from scratch, each for --iters steps, each
   evaluating the whole val split every --eval_interval steps (eval_iters=0).
4. A table of steps and seconds to --target (0: the best val loss the scratch
   run reaches) for both, then python -m tinygpt.score's bits per character on the held-out
   text for the base, the fine-tuned and the scratch model.

Seconds are the logged step times summed up to the first evaluation at or below
the target (evaluation and checkpoints left out), as bench/recipes.py counts them.
"""

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's modules

from recipes import summarize  # noqa: E402
from recipes import train as run_train  # noqa: E402

import prepare  # noqa: E402
from config import UserError, load_config, option  # noqa: E402
from tinygpt import files, system, textfiles  # noqa: E402
from tinygpt.files import load_checkpoint  # noqa: E402
from tinygpt.tokenizer import tokenizer_from_meta  # noqa: E402


@dataclass
class BenchConfig:
    text: str = option("", "the other text: a UTF-8 file, or a directory whose files are joined (links skipped)")
    preset: str = option("config/shakespeare_char_cpu_fast.toml", "the preset of all three runs: model and recipe")
    base: str = option("", "a Tiny Shakespeare character checkpoint to start from (empty: train one with --preset)")
    base_iters: int = option(0, "steps of the base run (0: the preset's own)")
    iters: int = option(1000, "steps of the fine-tuning and the scratch run, the schedule ending there")
    eval_interval: int = option(50, "evaluate every this many steps: the resolution of steps to the target")
    target: float = option(0.0, "val loss to reach on the other text (0: the best the scratch run reaches)")
    seed: int = option(1337, "random seed of every run")
    threads: int = option(0, "torch threads per run (0: torch's default)")
    out_dir: str = option("out/bench_finetune", "where the data, the runs and held_out.txt go")


def other_text(path, out_dir):
    """The text to fine-tune on, as one file: a directory's files are joined, in name order."""
    path = Path(path) if path else None
    if path and path.is_file():
        return path
    if not path or not path.is_dir():
        raise UserError(f"--text {path} not found; pass a text of your own: --text=FILE (docs/finetuning.md's "
                        "table used Debian's license texts, the common-licenses folder of base-files)")
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.is_symlink())
    joined = out_dir / f"{path.name}.txt"
    joined.write_text("\n\n".join(textfiles.read_text(p, "--text").strip() for p in files) + "\n", encoding="utf-8")
    return joined


def bits_per_character(score_args, held_out):
    """python -m tinygpt.score's figure for one model on the held-out text (characters it never saw dropped)."""
    cmd = [sys.executable, "-m", "tinygpt.score", f"--input={held_out}", "--unknown=skip", *score_args]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
    return float(re.search(r"bits per character: ([\d.]+)", result.stdout)[1])


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


@system.cli
def main(argv):
    cfg = load_config(BenchConfig, argv, "bench/finetune.py", __doc__.strip().splitlines()[0])
    out = (ROOT / cfg.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seed = [f"--seed={cfg.seed}"]

    base = Path(cfg.base).resolve() if cfg.base else out / "base" / "ckpt.pt"
    if not cfg.base:
        base_cfg = type(cfg)(**{**cfg.__dict__, "iters": cfg.base_iters})
        run_train([cfg.preset, *seed], out / "base", base_cfg)
    if not base.is_file():
        raise UserError(f"--base {base} not found; pass a checkpoint of Tiny Shakespeare, or leave --base out")

    text = other_text(cfg.text, out)
    data = out / "data"
    if prepare.main(["--input", str(text), "--out_dir", str(data)]) != 0:
        raise UserError(f"prepare.py failed on {text}")
    meta, splits = files.load_data(data)
    held_out = out / "held_out.txt"
    held_out.write_text(tokenizer_from_meta(meta).decode(splits["val"]), encoding="utf-8")

    runs = {"fine-tuned": out / "finetuned", "scratch": out / "scratch"}
    common = [cfg.preset, f"--data_dir={data}", *seed]
    run_train([*common, f"--init_from={base}"], runs["fine-tuned"], cfg)
    run_train(common, runs["scratch"], cfg)

    with open(runs["scratch"] / "log.jsonl", encoding="utf-8") as log:
        scratch_val = [json.loads(line)["val_loss"] for line in log if "val_loss" in line]
    target = cfg.target or min(scratch_val)
    stats = {name: summarize(run_dir, target) for name, run_dir in runs.items()}

    print(f"\nother text: {text} ({meta['train_tokens']:,} train and {meta['val_tokens']:,} held-out characters); "
          f"preset {cfg.preset}, {cfg.iters} steps, seed {cfg.seed}; base {base}")
    print(f"target: val loss {target:.4f}{' (the best the scratch run reaches)' if not cfg.target else ''}\n")
    print(f"| run | val@0 | val@{cfg.iters} | steps to {target:.4f} | s to {target:.4f} | ms/iter |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in stats.items():
        print(f"| {name} | {s['val'][0]:.4f} | {fmt(s['val'].get(cfg.iters), '.4f')} | {fmt(s['reached'], 'd')} "
              f"| {fmt(s['seconds'], '.1f')} | {s['ms']:.1f} |")

    print(f"\npython -m tinygpt.score on the held-out text ({held_out}):\n")
    print("| model | bits per character |")
    print("|---|---:|")
    for name, args in (("Tiny Shakespeare (base)", [f"--out_dir={base.parent}", f"--checkpoint={base.name}"]),
                       ("fine-tuned", [f"--out_dir={runs['fine-tuned']}", "--checkpoint=best.pt"]),
                       ("scratch", [f"--out_dir={runs['scratch']}", "--checkpoint=best.pt"])):
        print(f"| {name} | {bits_per_character(args, held_out):.4f} |")
    known = set(load_checkpoint(base)["meta"]["vocab"])
    unseen = [ch for ch in held_out.read_text(encoding="utf-8") if ch not in known]
    print(f"\nThe base model never saw {len(set(unseen))} of the held-out text's characters ({len(unseen):,} of its "
          f"{meta['val_tokens']:,}); tinygpt.score dropped them for its figure (--unknown=skip).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
