"""The pictures and the table: plot.py draws a tiny run's losses and attention,
and ladder.py trains rungs and tabulates them."""

import json
import shutil
import struct
import sys

import ladder
import pytest
import torch

import train
from model import GPT, GPTConfig
from tinygpt import plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--n_embd=16", "--block_size=8", "--batch_size=2", "--max_iters=3", "--eval_interval=3",
        "--eval_iters=2", "--log_interval=1", "--warmup=0.3"]


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    """A run of config/tiny.toml (2 layers, 2 heads): a log with evaluations at 0, 5, 10, and a checkpoint."""
    out = tmp_path_factory.mktemp("plots_run") / "tiny"
    args = ["config/tiny.toml", f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=10", "--eval_interval=5"]
    assert train.main(args) == 0
    return out


@pytest.fixture(scope="module")
def additive_run(data_dir, tmp_path_factory):
    """The same run with additive scores in place of the dot product."""
    out = tmp_path_factory.mktemp("plots_run") / "tiny_additive"
    args = ["config/tiny.toml", f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=10", "--eval_interval=5",
            "--score=additive"]
    assert train.main(args) == 0
    return out


@pytest.fixture
def plt():
    pyplot = pytest.importorskip("matplotlib.pyplot", reason="matplotlib is optional: pip install matplotlib")
    yield pyplot
    pyplot.close("all")


def png_size(path):
    """(width, height) of a PNG file, read from its header after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def heatmaps(fig):
    return [ax for ax in fig.axes if ax.get_images()]  # the colorbar's axes hold no image


# --- Loss curves -------------------------------------------------------------------------


def test_losses_of_a_run_make_a_png(plt, run, tmp_path):
    out = tmp_path / "losses.png"
    assert plot.main(["losses", str(run), f"--out={out}"]) == 0
    width, height = png_size(out)
    assert 400 <= width <= 2000 and 300 <= height <= 2000


def test_losses_of_two_runs_draw_each_runs_train_and_val_curve(plt, run):
    fig = plot.plot_losses(plot.LossesConfig(runs=[str(run), str(run / "log.jsonl")]))
    ax = fig.axes[0]
    curves = [line for line in ax.get_lines() if len(line.get_xdata()) > 0]
    assert len(curves) == 4  # two runs, train and val
    assert [list(c.get_xdata()) for c in curves] == [[0, 5, 10]] * 4  # one point per evaluation
    val = [json.loads(line)["val_loss"] for line in (run / "log.jsonl").read_text().splitlines() if "val_loss" in line]
    assert list(curves[1].get_ydata()) == val
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [str(run), str(run / "log.jsonl"), "train loss", "val loss"]  # the same name: whole paths


def test_without_matplotlib_plot_says_how_to_install_it(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert plot.main(["losses", str(run), f"--out={tmp_path / 'x.png'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:") and "pip install matplotlib" in err
    assert not (tmp_path / "x.png").exists()


# --- Attention ------------------------------------------------------------------------------


@pytest.mark.parametrize("mixer, heads, score", [("multihead", 2, "dot"), ("head", 1, "dot"), ("average", 1, "dot"),
                                                 ("multihead", 2, "additive"), ("head", 1, "additive")])
def test_attention_rows_sum_to_one_and_are_zero_above_the_diagonal(mixer, heads, score):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=8, mixer=mixer, score=score)
    model = GPT(config).eval()
    weights = plot.attention_weights(model, torch.randint(0, 11, (1, 7)))
    assert weights.shape == (3, heads, 7, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, heads, 7))
    visible = torch.ones(7, 7, dtype=torch.bool).tril()  # query t sees keys 0..t
    assert (weights[..., ~visible] == 0).all()
    assert (weights[..., visible] > 0).all()


def test_attention_leaves_the_model_on_its_fused_path():
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)).eval()
    plot.attention_weights(model, torch.zeros(1, 4, dtype=torch.long))
    assert model.blocks[0].mixer.keep_weights is False


def test_attention_of_a_run_makes_a_png(plt, run, tmp_path):
    out = tmp_path / "attention.png"
    assert plot.main(["attention", f"--out_dir={run}", "--prompt=the cat sat", f"--out={out}"]) == 0
    width, height = png_size(out)
    assert 400 <= width <= 3000 and 300 <= height <= 3000


def test_attention_with_no_run_named_draws_the_run_train_py_makes_with_none(plt, run, tmp_path, monkeypatch):
    shutil.copytree(run, tmp_path / "out" / "shakespeare_char")  # where python train.py, given nothing, writes
    monkeypatch.chdir(tmp_path)
    assert plot.main(["attention", "--prompt=the cat sat", "--out=a.png"]) == 0
    assert png_size(tmp_path / "a.png")[0] > 0


def test_attention_grid_has_one_heatmap_per_layer_and_head(plt, run):
    fig = plot.plot_attention(plot.AttentionConfig(out_dir=[str(run)], prompt="the cat"))
    assert len(heatmaps(fig)) == 2 * 2  # config/tiny.toml: n_layer 2, n_head 2
    image = heatmaps(fig)[-1].get_images()[0].get_array()
    assert image.shape == (7, 7) and image[0, 1:].sum() == 0  # queries down, keys across: query 0 sees key 0

    fig, grid = plot.draw_attention(plt, torch.rand(2, 3, 5, 5).tril(), list("abcde"))
    assert grid.shape == (2, 3)  # layers down, heads across
    assert [t.get_text() for t in grid[1, 0].get_xticklabels()] == list("abcde")


def test_a_windowed_model_draws_a_band():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, window=3)).eval()
    weights = plot.attention_weights(model, torch.randint(0, 11, (1, 8)))
    band = torch.ones(8, 8, dtype=torch.bool).tril() & torch.ones(8, 8, dtype=torch.bool).triu(-2)  # 3 newest keys
    assert (weights[..., ~band] == 0).all() and (weights[..., band] > 0).all()


def test_attention_of_two_runs_draws_dot_product_and_additive_heads_side_by_side(plt, run, additive_run, tmp_path):
    fig = plot.plot_attention(plot.AttentionConfig(out_dir=[str(run), str(additive_run)], prompt="the cat"))
    panels = fig.subfigs
    assert len(panels) == 2 and len(heatmaps(fig)) == 2 * (2 * 2)  # each run: 2 layers x 2 heads
    assert "dot-product scores" in panels[0]._suptitle.get_text() and str(run) in panels[0]._suptitle.get_text()
    assert "additive scores" in panels[1]._suptitle.get_text()
    left, right = (heatmaps(panel)[0].get_images()[0].get_array() for panel in panels)
    assert left.shape == right.shape == (7, 7) and not (left == right).all()  # the same prompt, other weights

    out = tmp_path / "side_by_side.png"
    assert plot.main(["attention", str(run), str(additive_run), "--prompt=the cat", f"--out={out}"]) == 0
    (one_width, _), (two_width, _) = png_size_of(plt, run, tmp_path), png_size(out)
    assert two_width > 1.5 * one_width


def png_size_of(plt, run, tmp_path):
    out = tmp_path / "one.png"
    assert plot.main(["attention", str(run), "--prompt=the cat", f"--out={out}"]) == 0
    return png_size(out)


def test_a_model_without_attention_has_nothing_to_draw():
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=0, mixer="none"))
    with pytest.raises(plot.UserError, match="no attention"):
        plot.attention_weights(model, torch.zeros(1, 3, dtype=torch.long))


# --- Bad input: one error line, exit 2, nothing written ---------------------------------


@pytest.mark.parametrize("args, message", [
    ([], "name what to draw"),
    (["pictures"], "losses or attention"),
    (["losses"], "at least one run"),
    (["losses", "{tmp}/nowhere"], "log.jsonl not found"),
    (["losses", "{run}", "--splits=test"], "--splits"),
    (["losses", "{run}", "--out={tmp}/picture.jpg"], ".png, .svg or .pdf"),
    (["attention", "--out_dir={tmp}/nowhere", "--prompt=the"], "not found"),
    (["attention", "--out_dir={run}"], "--prompt is empty"),
    (["attention", "--out_dir={run}", "--prompt=the CAT"], "'C', 'A', 'T'"),
    (["attention", "--out_dir={run}", "--prompt=the cat sat on the mat"], "longer than the model's block_size"),
    (["attention", "{run}", "--prompt=the", "--colour=red"], "unknown key"),
])
def test_bad_input_is_one_error_line(args, message, run, tmp_path, capsys):
    out = tmp_path / "picture.png"
    args = [a.format(run=run, tmp=tmp_path) for a in args]
    if args and not any(a.startswith("--out=") for a in args):
        args.append(f"--out={out}")
    assert plot.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_a_bad_log_line_is_named(run, tmp_path, capsys):
    (tmp_path / "log.jsonl").write_text((run / "log.jsonl").read_text() + "{not json\n")
    assert plot.main(["losses", str(tmp_path), f"--out={tmp_path / 'x.png'}"]) == 2
    lines = len((run / "log.jsonl").read_text().splitlines()) + 1
    assert f"log.jsonl line {lines} is not JSON" in capsys.readouterr().err


def test_a_file_named_where_a_run_belongs_is_one_error_line(run, tmp_path, capsys):
    assert plot.main(["losses", str(run / "ckpt.pt"), f"--out={tmp_path / 'x.png'}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {run / 'ckpt.pt' / 'log.jsonl'} not found; name a directory train.py wrote to " \
                  "(its --out_dir)\n"
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("ymax", ["-1", "0", "LOWEST"])
def test_a_ymax_not_above_the_lowest_loss_drawn_is_one_error_line(ymax, run, tmp_path, capsys):
    lowest = min(r[f"{s}_loss"] for r in plot.read_evals(str(run)) for s in ("train", "val"))
    ymax = str(lowest) if ymax == "LOWEST" else ymax
    assert plot.main(["losses", str(run), f"--ymax={ymax}", f"--out={tmp_path / 'x.png'}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --ymax={float(ymax):g} is not above the lowest loss drawn ({lowest:.4f}); raise it or "
                   "omit it\n")
    assert not (tmp_path / "x.png").exists()


def test_a_ymax_just_above_the_lowest_loss_drawn_is_the_top_of_the_axis(plt, run):
    lowest = min(r["val_loss"] for r in plot.read_evals(str(run)))
    fig = plot.plot_losses(plot.LossesConfig(runs=[str(run)], splits=["val"], ymax=lowest + 0.01))
    assert fig.axes[0].get_ylim()[1] == pytest.approx(lowest + 0.01)


def test_a_model_without_attention_is_one_error_line(data_dir, tmp_path, capsys):
    out = tmp_path / "bigram"
    assert train.main(["config/ladder/01_bigram.toml", f"--data_dir={data_dir}", f"--out_dir={out}", *TINY]) == 0
    assert plot.main(["attention", str(out), "--prompt=the", f"--out={tmp_path / 'x.png'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no attention to draw" in err


# --- The ladder --------------------------------------------------------------------------------


def test_ladder_trains_two_rungs_and_writes_the_table(data_dir, tmp_path, capsys):
    args = ["--rungs=01_bigram,3", f"--out={tmp_path}", f"--data_dir={data_dir}", *TINY]
    assert ladder.main(args) == 0
    table = (tmp_path / "ladder.md").read_text()
    assert table in capsys.readouterr().out
    lines = table.splitlines()
    assert "3 steps of 2 x 8 tokens" in lines[0] and "machine:" in lines[0]
    header = lines.index("| rung | parameters | train loss | val loss | tokens/s | peak memory | wall time |")
    rows = [line.strip("| ").split(" | ") for line in lines[header + 2:] if line.startswith("|")]
    assert [r[0] for r in rows] == ["01_bigram", "03_head"]
    assert all(r[5].endswith(" MiB") and float(r[5].split()[0].replace(",", "")) > 0 for r in rows)
    assert "peak memory: the peak resident memory of the process that trained the rung" in table

    saved = json.loads((tmp_path / "ladder.json").read_text())
    assert [r["rung"] for r in saved["rows"]] == ["01_bigram", "03_head"]
    bigram = saved["rows"][0]
    assert bigram["iters"] == 3 and bigram["wall_s"] > 0
    assert bigram["peak_memory_of"] == "rss" and bigram["peak_memory_bytes"] > 2**20  # torch alone takes more
    assert bigram["parameters"] == 2 * 64 * 16  # the embedding and the output head, V x C each (V padded to 64)
    last = json.loads((tmp_path / "01_bigram/log.jsonl").read_text().splitlines()[-1])
    assert rows[0][3] == f"{last['val_loss']:.4f}" == f"{bigram['val_loss']:.4f}"

    # Run again: both rungs are done, so nothing trains and the table is the same.
    before = (tmp_path / "03_head/ckpt.pt").stat().st_mtime_ns
    assert ladder.main(args) == 0
    assert capsys.readouterr().out.count("skipped") == 2
    assert (tmp_path / "03_head/ckpt.pt").stat().st_mtime_ns == before
    assert json.loads((tmp_path / "ladder.json").read_text())["rows"] == saved["rows"]


def eval_steps(run_dir):
    return [r["iter"] for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if "val_loss" in r]


def test_ladder_resumes_a_rung_stopped_part_way_and_keeps_other_settings_runs(data_dir, tmp_path, capsys):
    args = ["--rungs=2", f"--out={tmp_path}", f"--data_dir={data_dir}", *TINY]  # 3 steps
    assert ladder.main(args) == 0
    assert ladder.main([*args, "--max_iters=6"]) == 2  # another budget's run is not overwritten...
    assert "other settings (max_iters 3 there, 6 now)" in capsys.readouterr().err
    assert eval_steps(tmp_path / "02_average") == [0, 3]

    # ...but a run of the same settings stopped part way (as Ctrl-C leaves it) goes on from there.
    path = tmp_path / "02_average" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["train_config"]["max_iters"] = 6  # now it is step 3 of a 6-step run
    torch.save(ckpt, path)
    assert ladder.main([*args, "--max_iters=6"]) == 0
    assert "02_average: resuming" in capsys.readouterr().out
    assert eval_steps(tmp_path / "02_average") == [0, 3, 6]

    assert ladder.main([*args, "--force"]) == 0  # --force trains from scratch, on the settings given
    assert eval_steps(tmp_path / "02_average") == [0, 3]


@pytest.mark.parametrize("args, message", [
    (["--rungs=12"], "no rung '12'"),
    (["--rungs=4c"], "no rung '4c'"),
    (["--budget=tpu"], "budget must be cpu or gpu"),
    (["--out_dir=x"], "the ladder sets --out_dir itself"),
    (["--max_iter=3"], "unknown key 'max_iter'"),
    (["--max_iters=many"], "max_iters must be int"),
    (["config/ladder/01_bigram.toml"], "takes only --key=value options"),
])
def test_ladder_bad_input_is_one_error_line(args, message, tmp_path, capsys):
    assert ladder.main([*args, f"--out={tmp_path}/ladder"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "ladder").exists()


@pytest.mark.parametrize("rungs", ["--rungs=", "--rungs=,"])
def test_ladder_empty_rungs_is_an_error_naming_the_rungs(rungs, tmp_path, capsys):
    # --data_dir names no data: without the check the first rung would fail on it, not train
    assert ladder.main([rungs, f"--out={tmp_path}/ladder", f"--data_dir={tmp_path}/none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --rungs is empty; name rungs by number or name, e.g. --rungs=3,4, or leave it out "
                          "for all; the rungs are 01_bigram, 02_average, 03_head, ") and err.count("\n") == 1, err
    assert not (tmp_path / "ladder").exists()


@pytest.mark.parametrize("below", ["", "/ladder"])
def test_ladder_out_that_is_a_file_is_named_as_out(below, data_dir, tmp_path, capsys):
    (tmp_path / "table.md").write_text("kept")
    out = tmp_path / f"table.md{below}"
    assert ladder.main(["--rungs=1", f"--out={out}", f"--data_dir={data_dir}", *TINY]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {out} cannot be a directory: {tmp_path / 'table.md'} is a file; pick another --out\n"
    assert (tmp_path / "table.md").read_text() == "kept"


def test_rungs_are_named_by_file_number_or_name():
    assert [p.stem for p in ladder.pick_rungs(["01_bigram,3", "multihead", "08"])] == [
        "01_bigram", "03_head", "04_multihead", "08_full"]
    assert [p.stem for p in ladder.pick_rungs(["9c,4b", "03b", "modern_window32", "9"])] == [
        "03b_head_additive", "04b_multihead_additive", "09_modern", "09b_modern_window32", "09c_modern_window16"]
    assert len(ladder.pick_rungs([])) == 13


def test_gpu_budget_is_the_reference_run_with_each_rungs_depth():
    def settings(stem):
        preset = ladder.PRESETS / f"{stem}.toml"
        return ladder.load_config(train.TrainConfig, [str(preset), *ladder.budget_args("gpu", preset)])

    full, head = settings("08_full"), settings("03_head")
    assert (full.n_layer, full.n_head, full.n_embd, full.block_size, full.batch_size) == (6, 6, 384, 256, 64)
    assert (full.max_iters, full.device, full.dropout) == (5000, "auto", 0.2)  # the 10M model overfits: dropout
    assert (head.n_layer, head.mixer, head.n_embd, head.dropout) == (1, "head", 384, 0.0)  # no residuals: shallow
    assert ladder.load_config(train.TrainConfig, [str(ladder.PRESETS / "08_full.toml")]).dropout == 0.0  # CPU

    modern, window = settings("09_modern"), settings("09b_modern_window32")
    assert (modern.n_layer, modern.dropout, modern.optimizer, modern.pos) == (6, 0.2, "muon", "rope")
    assert (window.window, window.block_size) == (128, 256)  # half the context, as 32 is of 64
    additive = settings("04b_multihead_additive")  # its (B, H, T, S, hs) tensor, in four pieces
    assert (additive.batch_size, additive.grad_accum, additive.score) == (16, 4, "additive")
