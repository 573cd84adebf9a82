"""Your own text, trained well: the automatic run against the presets and its neighbours.

    python bench/own_text.py --license=fdl-1.3.txt --cyrillic=DIR --rust=DIR   # the whole panel: hours
    python bench/own_text.py --texts=python --runs=auto          # one text, one run: needs no download
    python bench/own_text.py ... --max_time=1m --runs=auto,cpu_fast  # every text at another budget
    python bench/own_text.py --report_only=true                   # the table again, from the runs on disk

A panel of texts nobody here wrote, of very different sizes and kinds, each from files
anyone can get (docs/own_text.md gives the downloads): the GNU FDL 1.3 (--license: a file,
23 KB, https://www.gnu.org/licenses/fdl-1.3.txt), Vim's tutorial in Russian, Ukrainian and
Bulgarian (--cyrillic: a folder holding Vim 9.0's tutor.ru.utf-8, tutor.uk.utf-8 and
tutor.bg.utf-8, from https://github.com/vim/vim/tree/v9.0.1378/runtime/tutor; Cyrillic,
171 KB), Tiny Shakespeare (--shakespeare: python prepare.py downloads it; 1.1 MB), the
Rust book, reference and Cargo guide as text (--rust: the html folder of rustup's rust-docs
component; English prose and code, about 5 MB), and the Python standard library's source
(--python: a Lib folder; by default this Python's own; program text, 31 MB). A text's
folder in --out, once made, is used again without its source. For each, with the same
time budget (--max_time, everything included): the automatic choice (no preset);
each CPU preset; and the automatic choice's neighbours: one model size smaller and
larger (budget.SHAPES), and half and double the steps (twice and half the batch, so
the budget is the same). Each run is `python train.py ...` in its own process, one
at a time: time it on an otherwise idle machine. The table gives each run's best.pt
scored on the whole val split, in bits per character, and its wall time.
"""

import html.parser
import json
import math
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's modules

from config import UserError, load_config, option  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tinygpt import budget, system  # noqa: E402
from tinygpt.files import load_checkpoint, load_data  # noqa: E402
from tinygpt.score import mean_loss  # noqa: E402

PYTHON_LIB = Path(sysconfig.get_paths()["stdlib"])  # every Python has its own
PRESETS = {"cpu": "config/shakespeare_char_cpu.toml", "cpu_fast": "config/shakespeare_char_cpu_fast.toml"}
GRID = ("smaller", "larger", "half_steps", "double_steps")
TEXT_NAMES = ("license", "cyrillic", "shakespeare", "rust", "python")  # TEXTS, below


@dataclass
class BenchConfig:
    texts: list[str] = option(list(TEXT_NAMES), "which texts of the panel, comma-separated")
    license: str = option("", "the GNU FDL 1.3 as text: curl -O https://www.gnu.org/licenses/fdl-1.3.txt")
    cyrillic: str = option("", "a folder with Vim's tutor.ru.utf-8, tutor.uk.utf-8, tutor.bg.utf-8 (docs/own_text.md)")
    shakespeare: str = option("data/shakespeare_char/input.txt", "Tiny Shakespeare: python prepare.py downloads it")
    rust: str = option("", "the Rust docs' html folder: rustup component add rust-docs, then its share/doc/rust/html")
    python: str = option("", "a Python standard library's folder (empty: this Python's own, from sysconfig)")
    runs: list[str] = option(["auto", *PRESETS, *GRID], "which runs, comma-separated: auto, the presets, the grid")
    max_time: str = option("5m", "the time budget of every run")
    out: str = option("out/own_text", "where the texts, data sets and runs go")
    report_only: bool = option(False, "print the table from the runs in --out, training nothing")


# --- The texts ----------------------------------------------------------------------------


class TextOfHTML(html.parser.HTMLParser):
    """The text a browser shows of an HTML page, without scripts, styles or navigation."""

    SKIP, BREAK = {"script", "style", "nav", "head"}, {"p", "div", "pre", "li", "h1", "h2", "h3", "h4", "tr", "br"}

    def __init__(self):
        super().__init__()
        self.parts, self.skipping = [], 0

    def handle_starttag(self, tag, attrs):
        self.skipping += tag in self.SKIP

    def handle_endtag(self, tag):
        self.skipping -= tag in self.SKIP and self.skipping > 0
        if tag in self.BREAK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)


def rust_docs_text(cfg):
    docs = given(cfg, "rust")
    pages = [p for book in ("book", "reference", "cargo") for p in sorted((docs / book).rglob("*.html"))
             if p.name not in ("print.html", "toc.html", "404.html")]
    if not pages:
        raise UserError(f"--rust {docs}: no book, reference or cargo pages there; {TEXTS['rust'][1]}")
    texts = []
    for page in pages:
        parser = TextOfHTML()
        parser.feed(page.read_text(encoding="utf-8", errors="replace"))
        texts.append("".join(parser.parts).strip() + "\n")
    return "\n".join(texts)


def python_source_text(cfg):
    files = sorted(p for p in Path(cfg.python or PYTHON_LIB).rglob("*.py") if "site-packages" not in p.parts)
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def files_text(*paths):
    return "\n".join(Path(p).read_text(encoding="utf-8") for p in paths)


def given(cfg, name):
    """The path the option --NAME gives, or one error line saying where to get it."""
    if not getattr(cfg, name):
        raise UserError(f"the {name} text needs --{name}: {TEXTS[name][1]}")
    return Path(getattr(cfg, name))


TUTOR = "https://raw.githubusercontent.com/vim/vim/v9.0.1378/runtime/tutor"  # Vim 9.0's tutorials
CYRILLIC = ("ru", "uk", "bg")
TEXTS = {  # name: (what it is, where to get it, how to make it from the options)
    "license": ("GNU FDL 1.3, English legal text",
                "curl -O https://www.gnu.org/licenses/fdl-1.3.txt, then --license=fdl-1.3.txt",
                lambda cfg: files_text(given(cfg, "license"))),
    "cyrillic": ("Vim's tutorial in Russian, Ukrainian, Bulgarian",
                 f"a folder with tutor.ru.utf-8, tutor.uk.utf-8 and tutor.bg.utf-8: curl -O {TUTOR}/tutor.ru.utf-8, "
                 "and uk, bg",
                 lambda cfg: files_text(*(given(cfg, "cyrillic") / f"tutor.{lang}.utf-8" for lang in CYRILLIC))),
    "shakespeare": ("Tiny Shakespeare, English verse",
                    "python prepare.py downloads it to data/shakespeare_char/input.txt",
                    lambda cfg: files_text(given(cfg, "shakespeare"))),
    "rust": ("the Rust book, reference and Cargo guide, English prose and code",
             'rustup component add rust-docs, then --rust="$(rustc --print sysroot)/share/doc/rust/html"',
             rust_docs_text),
    "python": ("the Python standard library's source", "a folder of Python source, e.g. a Python's Lib",
               python_source_text),
}


def prepared(name, cfg):
    """data/NAME for the text, made (text, then prepare.py) if it is not there yet."""
    out = Path(cfg.out)
    text_path, data_dir = out / "texts" / f"{name}.txt", out / "data" / name
    if not (data_dir / "meta.json").is_file():
        if not text_path.is_file():
            what, source, make = TEXTS[name]
            try:
                text = make(cfg)
            except OSError as e:
                raise UserError(f"text {name} ({what}): {e}; {source}") from None
            text_path.parent.mkdir(parents=True, exist_ok=True)
            text_path.write_text(text, encoding="utf-8")
        command = [sys.executable, "prepare.py", "--input", str(text_path), "--out_dir", str(data_dir)]
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return data_dir


# --- The runs -----------------------------------------------------------------------------


def neighbour(run, auto_cfg, train_tokens):
    """The train.py settings of a grid run: the automatic run's, one thing changed. Like the
    automatic run, it takes at most budget.MAX_EPOCHS passes over the text."""
    keys = ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "dropout", "pos", "optimizer", "muon_lr",
            "muon_momentum", "learning_rate", "min_lr", "weight_decay", "bias", "eval_iters")
    settings = {k: auto_cfg[k] for k in keys}
    if run in ("smaller", "larger"):
        i = budget.SHAPES.index((auto_cfg["n_layer"], auto_cfg["n_embd"])) + (1 if run == "larger" else -1)
        if not 0 <= i < len(budget.SHAPES):
            return None
        n_layer, n_embd = budget.SHAPES[i]
        settings.update(n_layer=n_layer, n_embd=n_embd, n_head=budget.shape_settings(n_layer, n_embd)["n_head"])
    else:  # the same budget: twice the batch is half the steps, half the batch twice the steps
        settings["batch_size"] = max(1, auto_cfg["batch_size"] * 2 if run == "half_steps"
                                     else auto_cfg["batch_size"] // 2)
    settings["max_iters"] = budget.most_steps(train_tokens, settings["batch_size"] * settings["block_size"])
    return [f"--{k}={v}" for k, v in settings.items()]


def train_args(run, data_dir, run_dir, cfg, train_tokens):
    common = [f"--data_dir={data_dir}", f"--out_dir={run_dir}", f"--max_time={cfg.max_time}", "--overwrite=true"]
    if run == "auto":
        return common
    if run in PRESETS:
        return [PRESETS[run], *common]
    auto = Path(cfg.out) / "runs" / data_dir.name / "auto" / "ckpt.pt"
    if not auto.is_file():
        raise UserError(f"the {run} run is built on the automatic one: run --runs=auto for {data_dir.name} first")
    settings = neighbour(run, load_checkpoint(auto)["train_config"], train_tokens)
    return None if settings is None else [*settings, *common]


@torch.no_grad()
def whole_val_loss(run_dir, data_dir):
    """Mean loss per token of run_dir/best.pt on the whole val split, as python -m tinygpt.score scores a file."""
    ckpt = load_checkpoint(run_dir / "best.pt")
    model = GPT(GPTConfig(**{**ckpt["model_config"], "dropout": 0.0}))
    model.load_state_dict(ckpt["model"])
    model.eval()
    _, splits = load_data(data_dir)
    return mean_loss(model, splits["val"], model.config.block_size, 32, "cpu"), ckpt


def train(args, run_dir):
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "train.py", *args]
    t0 = time.perf_counter()
    with open(run_dir / "stdout.txt", "w", encoding="utf-8") as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if code != 0:
        raise UserError(f"{' '.join(command)} failed (exit {code}); see {run_dir / 'stdout.txt'}")
    (run_dir / "result.json").write_text(json.dumps({"command": command, "wall_s": wall}) + "\n", encoding="utf-8")


def row(name, run, data_dir, run_dir):
    result = json.loads((run_dir / "result.json").read_text(encoding="utf-8"))
    loss, ckpt = whole_val_loss(run_dir, data_dir)
    t, m = ckpt["train_config"], ckpt["model_config"]
    steps = load_checkpoint(run_dir / "ckpt.pt")["iter"]  # best.pt's is the best evaluation's
    chars_per_token = 1.0  # character-level data: a token is a character
    return {"text": name, "run": run, "model": f"{m['n_layer']}x{m['n_embd']} b{m['block_size']}",
            "params": GPT(GPTConfig(**m)).num_params(), "batch": t["batch_size"], "dropout": t["dropout"],
            "steps": steps, "best_at": ckpt["iter"], "bpc": loss / math.log(2) / chars_per_token,
            "wall_s": result["wall_s"]}


def print_table(rows, cfg):
    print(f"\nbudget {cfg.max_time} per run; best.pt on the whole val split, bits per character\n")
    print("| text | run | model | parameters | batch | dropout | steps | best at | val bpc | vs auto | wall |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    auto = {r["text"]: r["bpc"] for r in rows if r["run"] == "auto"}
    for r in rows:
        vs = f"{r['bpc'] / auto[r['text']] - 1:+.1%}" if r["text"] in auto and r["run"] != "auto" else ""
        print(f"| {r['text']} | {r['run']} | {r['model']} | {r['params']:,} | {r['batch']} | {r['dropout']:g} "
              f"| {r['steps']:,} | {r['best_at']:,} | {r['bpc']:.4f} | {vs} | {r['wall_s']:.0f} s |")


@system.cli
def main(argv):
    cfg = load_config(BenchConfig, argv, "bench/own_text.py", __doc__.strip().splitlines()[0])
    out = Path(cfg.out)
    budget.parse_duration(cfg.max_time)
    texts, runs = ([n.strip() for item in it for n in item.split(",") if n.strip()] for it in (cfg.texts, cfg.runs))
    for name in texts:
        if name not in TEXTS:
            raise UserError(f"unknown text {name!r}; the panel has {', '.join(TEXTS)}")
    data_dirs = {name: prepared(name, cfg).resolve() for name in texts}  # a missing source ends it before a run
    rows = []
    for name, data_dir in data_dirs.items():
        meta = load_data(data_dir)[0]
        print(f"{name}: {TEXTS[name][0]}; {meta['train_tokens'] + meta['val_tokens']:,} characters, "
              f"vocabulary {meta['vocab_size']}", flush=True)
        for run in runs:
            run_dir = (out / "runs" / name / run).resolve()
            if not cfg.report_only:
                args = train_args(run, data_dir, run_dir, cfg, meta["train_tokens"])
                if args is None:
                    continue
                print(f"  {run}: python train.py {' '.join(args)}", flush=True)
                train(args, run_dir)
            if (run_dir / "result.json").is_file():
                rows.append(row(name, run, data_dir, run_dir))
                r = rows[-1]
                print(f"  {run}: {r['model']}, {r['steps']:,} steps, val {r['bpc']:.4f} bits/char, "
                      f"{r['wall_s']:.0f} s", flush=True)
    print_table(rows, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
