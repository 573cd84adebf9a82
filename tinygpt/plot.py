"""Draws training runs: loss curves, and attention weights.

    python -m tinygpt.plot losses out/ladder/06_residual out/ladder/07_layernorm --out=losses.png
    python -m tinygpt.plot attention --out_dir=out/shakespeare_char_cpu --prompt="ROMEO: But soft" --out=a.png
    python -m tinygpt.plot attention out/ladder/04_multihead out/ladder/04b_multihead_additive --prompt="ROMEO:"
    python -m tinygpt.plot losses --help

losses     train and val loss against the step, from each run's OUT_DIR/log.jsonl
attention  for a prompt, the attention weights of every layer (rows) and head (columns) of a checkpoint: queries
           down, keys across, so the causal triangle shows; two runs or more are drawn side by side

Needs matplotlib (pip install matplotlib); it writes files and never opens a window.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from config import UserError, help_text, load_config, option
from model import CausalAverage, MultiHeadAttention, tril_mask
from tinygpt import system
from tinygpt.files import check_path, checkpoint_path, write_atomic, write_error
from tinygpt.weights import model_from_checkpoint

SHORT = 48  # prompts up to this many tokens get their characters as tick labels
SHOWN = {"\n": "↵", " ": "␣", "\t": "⇥"}  # characters that would be invisible as labels


@dataclass
class LossesConfig:
    runs: list[str] = option([], "run directories holding log.jsonl (or the logs); also given without --runs=")
    out: str = option("losses.png", "the image to write (.png, .svg or .pdf)")
    splits: list[str] = option(["train", "val"], "which losses to draw: train, val, or both (comma-separated)")
    ymax: float | None = option(None, "top of the loss axis, to zoom past the first steps (none: fit all)")
    title: str = option("", "a title above the plot")


@dataclass
class AttentionConfig:
    out_dir: list[str] = option(["out/shakespeare_char"], "the run directories holding the checkpoints, drawn "
                                                          "side by side; also given without --out_dir=")
    checkpoint: str = option("", "which checkpoint in each run: best.pt (the lowest val loss) or ckpt.pt (the "
                             "latest); empty: best.pt when it exists")
    prompt: str = option("", "the text whose attention to draw, at most block_size tokens")
    out: str = option("attention.png", "the image to write (.png, .svg or .pdf)")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or a UserError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("python -m tinygpt.plot draws with matplotlib, which is not installed: "
                        "pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    return plt


# --- Loss curves ---------------------------------------------------------------------


def read_evals(run):
    """The eval records (iter, train_loss, val_loss) in a run's log.jsonl, in order."""
    check_path(run, "--runs")
    path = Path(run) / "log.jsonl" if not run.endswith(".jsonl") else Path(run)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a file given where a run belongs
        raise UserError(f"{path} not found; name a directory train.py wrote to (its --out_dir)") from None
    except (IsADirectoryError, UnicodeDecodeError):
        raise UserError(f"{path} is not a log written by train.py") from None
    evals = []
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise UserError(f"{path} line {n} is not JSON; is it a log written by train.py?") from None
        if not isinstance(record, dict) or "val_loss" not in record:
            continue  # a step's record
        for key in ("iter", "train_loss", "val_loss"):
            if not isinstance(record.get(key), (int, float)) or isinstance(record.get(key), bool):
                raise UserError(f"{path} line {n}: an evaluation whose {key} is {record.get(key)!r}; is it a log "
                                "written by train.py?")
        evals.append(record)
    if not evals:
        raise UserError(f"{path} has no evaluations yet; train.py writes one every eval_interval steps")
    return evals


def draw_losses(plt, logs, splits, ymax=None, title=""):
    """A figure: per run one color; val solid, train dashed, against the step."""
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100, layout="constrained")
    styles = {"val": "-", "train": "--"}
    for i, (label, evals) in enumerate(logs.items()):
        steps = [r["iter"] for r in evals]
        for split in splits:
            ax.plot(steps, [r[f"{split}_loss"] for r in evals], styles[split], color=f"C{i % 10}",
                    marker="o" if len(steps) < 30 else None, markersize=3)
        ax.plot([], [], "-", color=f"C{i % 10}", label=label)  # the legend: one entry per run...
    for split in splits:
        ax.plot([], [], styles[split], color="gray", label=f"{split} loss")  # ...and one per line style
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    if ymax is not None:
        ax.set_ylim(top=ymax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title)  # "": as drawn without one
    return fig


def plot_losses(cfg):
    """The loss-curve figure for cfg (LossesConfig)."""
    if not cfg.runs:
        raise UserError("name at least one run: python -m tinygpt.plot losses OUT_DIR [OUT_DIR ...]")
    splits = [s.strip() for item in cfg.splits for s in item.split(",") if s.strip()]
    if not splits or any(s not in ("train", "val") for s in splits):
        raise UserError(f"--splits must be train, val or both, got {','.join(cfg.splits)!r}")
    names = [Path(r).parent.name if r.endswith(".jsonl") else Path(r).name for r in cfg.runs]
    labels = [n if names.count(n) == 1 else r for n, r in zip(names, cfg.runs)]  # whole paths where names repeat
    logs = {label: read_evals(run) for label, run in zip(labels, cfg.runs)}
    lowest = min(r[f"{s}_loss"] for evals in logs.values() for r in evals for s in splits)
    if cfg.ymax is not None and cfg.ymax <= lowest:  # the axis would show no curve, or turn upside down
        raise UserError(f"--ymax={cfg.ymax:g} is not above the lowest loss drawn ({lowest:.4f}); raise it or omit it")
    return draw_losses(pyplot(), logs, list(dict.fromkeys(splits)), cfg.ymax, cfg.title)


# --- Attention heatmaps --------------------------------------------------------------------


@torch.no_grad()
def attention_weights(model, idx):
    """(L, H, T, T): each layer's attention weights for idx (1, T); row t is query t's."""
    mixers = [block.mixer for block in model.blocks]
    if not mixers or mixers[0] is None:
        raise UserError(f"this model's positions do not communicate (n_layer {model.config.n_layer}, mixer "
                        f"{model.config.mixer!r}), so it has no attention to draw")
    attentions = [mixer for mixer in mixers if isinstance(mixer, MultiHeadAttention)]
    for mixer in attentions:
        mixer.keep_weights = True  # the written-out path, which keeps its weights
    try:
        model(idx)
    finally:
        for mixer in attentions:
            mixer.keep_weights = False
    mask = tril_mask(idx.size(1), idx.size(1)).float()  # (T, T)
    average = (mask / mask.sum(-1, keepdim=True))[None]  # (1, T, T): causal averaging's fixed 1/(t+1) per key
    layers = [average if isinstance(mixer, CausalAverage) else mixer.weights[0].float() for mixer in mixers]
    return torch.stack(layers).cpu()  # (L, H, T, T), H = 1 for one Head or an average


def draw_attention(plt, weights, labels, title=""):
    """(figure, grid of axes) with one heatmap per layer (row) and head (column)."""
    L, H, _, _ = weights.shape
    cell = heatmap_inches(L, H)
    fig = plt.figure(figsize=(cell * H + 1.2, cell * L + 0.6), dpi=100, layout="constrained")
    return fig, draw_heatmaps(fig, weights, labels, title)


def heatmap_inches(L, H):
    return max(2.0, min(3.2, 13 / max(L, H)))  # per heatmap: smaller when there are many


def draw_heatmaps(panel, weights, labels, title=""):
    """The grid of axes, drawn into panel (a figure, or one of its subfigures)."""
    from matplotlib.colors import PowerNorm

    L, H, T, _ = weights.shape
    longest = max(len(label) for label in labels)  # single characters stand upright; longer tokens turn
    grid = panel.subplots(L, H, squeeze=False, sharex=True, sharey=True)
    # A square-root scale: most weights are small, and a linear one would show only the largest.
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    for layer in range(L):
        for head in range(H):
            ax = grid[layer, head]
            image = ax.imshow(weights[layer, head].numpy(), cmap="magma", norm=norm, interpolation="nearest")
            ax.set_title(f"layer {layer + 1}, head {head + 1}" if H > 1 else f"layer {layer + 1}", fontsize=9)
            if T <= SHORT:
                ax.set_xticks(range(T), labels, fontsize=7, rotation=90 if longest > 1 else 0)
                ax.set_yticks(range(T), labels, fontsize=7)
            ax.tick_params(length=0)
    panel.supxlabel("key (the position attended to)", fontsize=9)
    panel.supylabel("query (the position attending)", fontsize=9)
    panel.colorbar(image, ax=grid, shrink=0.6, label="attention weight")
    if title:
        panel.suptitle(title, fontsize=10)
    return grid


def run_attention(run, cfg):
    """(weights (L, H, T, T), token labels, title) for one run's checkpoint on cfg.prompt."""
    for flag, given in (("--out_dir", run), ("--checkpoint", cfg.checkpoint)):
        check_path(given, flag)
    path = checkpoint_path(run, cfg.checkpoint)
    model, tokenizer = model_from_checkpoint(path, "cpu")
    if unknown := tokenizer.unknown(cfg.prompt):
        raise UserError(f"--prompt has {len(unknown)} character(s) the model in {run} never saw: "
                        f"{', '.join(repr(ch) for ch in unknown[:10])}; remove them")
    ids = tokenizer.encode(cfg.prompt)
    if len(ids) > model.config.block_size:
        raise UserError(f"--prompt is {len(ids)} tokens, longer than the model's block_size "
                        f"{model.config.block_size} in {run}; shorten it")
    weights = attention_weights(model, torch.tensor([ids]))  # (L, H, T, T)
    labels = [SHOWN.get(text, text) for text in (tokenizer.decode([i]) for i in ids)]
    scores = {"average": "causal average", "none": "no attention", "additive": "additive scores"}
    what = scores.get(model.config.mixer, scores.get(model.config.score, "dot-product scores"))
    window = f", window {model.config.window}" if model.config.window else ""
    return weights, labels, f"{path}: {what}{window}"  # its attention in a few words: "additive scores, window 16"


def plot_attention(cfg):
    """The attention-grid figure for cfg (AttentionConfig): one grid per run, side by side."""
    if not cfg.prompt:
        raise UserError("--prompt is empty; give the text whose attention to draw, e.g. --prompt='ROMEO: But soft'")
    if not cfg.out_dir:
        raise UserError("name at least one run: python -m tinygpt.plot attention OUT_DIR [OUT_DIR ...] --prompt=TEXT")
    runs = [run_attention(run, cfg) for run in cfg.out_dir]
    plt = pyplot()
    if len(runs) == 1:
        [(weights, labels, title)] = runs
        return draw_attention(plt, weights, labels, f"attention of {title} on {cfg.prompt[:60]!r}")[0]
    rows = max(w.size(0) for w, _, _ in runs)
    cell = heatmap_inches(rows, max(w.size(1) for w, _, _ in runs))
    widths = [w.size(1) * cell + 1.2 for w, _, _ in runs]
    fig = plt.figure(figsize=(sum(widths), cell * rows + 0.9), dpi=100, layout="constrained")
    for panel, (weights, labels, title) in zip(fig.subfigures(1, len(runs), width_ratios=widths), runs):
        draw_heatmaps(panel, weights, labels, title)
    fig.suptitle(f"attention on {cfg.prompt[:60]!r}", fontsize=11)
    return fig


# --- The command line ------------------------------------------------------------------------

# what: (its options, its figure, the option a bare word names, its usage)
COMMANDS = {
    "losses": (LossesConfig, plot_losses, "runs", "OUT_DIR [OUT_DIR ...] [--key=value ...]"),
    "attention": (AttentionConfig, plot_attention, "out_dir", "OUT_DIR [OUT_DIR ...] --prompt=TEXT [--key=value ...]"),
}


def name_positionals(args, field):
    """args with each bare word that is no option's value turned into --field=word
    (no option here is a bare flag, so a bare --key is always followed by its value)."""
    named, expect_value = [], False
    for arg in args:
        named.append(f"--{field}={arg}" if not arg.startswith("-") and not expect_value else arg)
        expect_value = arg.startswith("--") and "=" not in arg
    return named


@system.cli
def main(argv):
    if not argv:
        raise UserError("name what to draw: python -m tinygpt.plot losses OUT_DIR ..., or python -m tinygpt.plot "
                        "attention --out_dir=DIR --prompt=TEXT (python -m tinygpt.plot --help)")
    if argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    what, rest = argv[0], argv[1:]
    if what not in COMMANDS:
        raise UserError(f"python -m tinygpt.plot draws losses or attention, not {what!r}; e.g. python -m "
                        "tinygpt.plot losses OUT_DIR")
    cls, draw, positional, usage = COMMANDS[what]
    if "-h" in rest or "--help" in rest:
        options = help_text(cls, "", "").split("options:", 1)[1]
        print(f"usage: python -m tinygpt.plot {what} {usage}\n\noptions:{options}")
        return 0
    cfg = load_config(cls, name_positionals(rest, positional))
    check_path(cfg.out, "--out")
    path = Path(cfg.out)
    kind = path.suffix.lstrip(".").lower()
    if kind not in ("png", "svg", "pdf"):  # before any work
        raise UserError(f"--out {cfg.out}: the name must end in .png, .svg or .pdf")
    fig = draw(cfg)
    try:  # whole or not at all: an existing image is replaced only by a finished one
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: fig.savefig(f, format=kind))
    except OSError as e:
        raise UserError(f"{write_error(path, e)}; pick another --out") from None
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
