"""A run sized for its data and its time: the rule, the budget's bookkeeping, early stopping,
the best model by default, and where a run's files go when nobody says."""

import dataclasses
import json
import math
import os
import re
import shlex
import signal
import time
from pathlib import Path

import pytest
import torch

import sample
import train
from config import UserError
from tinygpt import budget, files, system

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")
GFLOPS = 1e9


def choose(train_tokens, seconds=300, flops_per_s=50 * GFLOPS, vocab_size=65):
    """(the settings choose_run picks, the most steps worth taking on the text with their batch)."""
    settings, _ = budget.choose_run(train_tokens, train_tokens // 9, vocab_size, flops_per_s, seconds)
    return settings, budget.most_steps(train_tokens, settings["batch_size"] * settings["block_size"])


def size(settings):
    return budget.block_params(settings["n_layer"], settings["n_embd"])


# --- The rule -------------------------------------------------------------------------------


def test_less_data_gives_a_smaller_or_more_regularized_model():
    runs = [choose(tokens)[0] for tokens in (20_000, 100_000, 1_000_000, 30_000_000)]  # 100k: seen 27 times
    for smaller_data, larger_data in zip(runs, runs[1:]):
        assert size(smaller_data) <= size(larger_data)
        assert smaller_data["dropout"] >= larger_data["dropout"]
    # Where the text limits the run it differs from a large one; where the budget does
    # (a text seen a few times), the data's size no longer matters.
    for small in runs[:2]:
        assert size(small) < size(runs[-1]) or small["dropout"] > runs[-1]["dropout"]
    assert runs[0]["dropout"] > 0 and runs[-1]["dropout"] == 0  # a small text is seen many times; a large once
    # Muon's decay where there is no dropout, and only there: one regularizer or the other.
    assert [run["muon_weight_decay"] for run in runs] == [0.0 if run["dropout"] else 0.1 for run in runs]


def test_over_the_same_passes_a_model_with_more_tokens_per_parameter_gets_less_dropout():
    def dropout(train_tokens, n_embd):  # 3 layers, as many passes as a text can give (an hour)
        given = {"n_layer": 3, "n_embd": n_embd}
        return budget.choose_run(train_tokens, 5_000, 65, 50 * GFLOPS, 3600, given)[0]["dropout"]

    # The same model over the same 50 passes: the more text it has to memorize, the less dropout.
    assert dropout(20_000, 96) == 0.2 and 0 < dropout(100_000, 96) < 0.2 and dropout(400_000, 96) == 0
    assert dropout(100_000, 64) < dropout(100_000, 96)  # the same text, a smaller model


def test_more_time_gives_a_larger_model_on_plenty_of_data():
    sizes = [size(choose(30_000_000, seconds=s)[0]) for s in (60, 300, 3600, 36_000)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


@pytest.mark.parametrize("train_tokens", [20_000, 200_000, 1_000_000, 30_000_000])
def test_more_time_never_gives_a_smaller_model_or_less_training(train_tokens):
    plans = []
    for seconds in [*range(10, 1200, 10), 3600, 36_000]:
        chosen = choose(train_tokens, seconds=seconds)[0]
        flops = budget.model_flops_per_token(chosen["n_layer"], chosen["n_embd"], chosen["block_size"], 65)
        plans.append((size(chosen), min(budget.MAX_EPOCHS * train_tokens, 50 * GFLOPS * seconds / flops)))
    for shorter, longer in zip(plans, plans[1:]):  # (parameters, tokens trained on)
        # A larger model, worth its size (it trains on fewer tokens than the smaller one had), or more training.
        assert longer[0] > shorter[0] or (longer[0] == shorter[0] and longer[1] >= shorter[1]), (shorter, longer)
        assert longer[1] >= budget.TOKENS_PER_PARAM * longer[0] or longer[0] == plans[0][0]


def test_a_short_budget_chooses_a_model_it_can_give_max_steps_even_at_the_smallest_batch():
    larger_ones = 0
    for seconds in range(10, 600, 5):
        chosen = choose(30_000_000, seconds=seconds)[0]
        if (chosen["n_layer"], chosen["n_embd"]) == budget.SHAPES[0]:
            continue  # nothing smaller to choose
        larger_ones += 1
        flops = budget.model_flops_per_token(chosen["n_layer"], chosen["n_embd"], chosen["block_size"], 65)
        steps = 50 * GFLOPS * seconds / flops / budget.MIN_BATCH_TOKENS
        assert steps >= budget.MIN_STEPS, (seconds, chosen)
    assert larger_ones > 50


def test_evaluations_take_a_small_share_of_a_short_run_and_a_long_run_gets_them_all():
    assert budget.spread_evaluations(60, eval_s=0.5) == budget.MIN_EVALS  # 4 x 0.5 s of a minute
    assert budget.spread_evaluations(300, eval_s=2.5) == budget.MIN_EVALS
    assert budget.spread_evaluations(1200, eval_s=2.5) == budget.EVALS
    counts = [budget.spread_evaluations(seconds, 1.0) for seconds in (10, 100, 300, 1000, 10_000)]
    assert counts == sorted(counts)


def test_a_short_runs_evaluations_read_fewer_batches_down_to_an_eighth_of_the_tokens():
    cfg = train.TrainConfig(eval_iters=40, batch_size=16, block_size=128)  # 40 x 2,048 tokens: EVAL_TOKENS
    fewer, eval_s = budget.fewer_batches_per_evaluation(cfg, 55, eval_s=2.1)  # Tiny Shakespeare, 1 minute
    assert fewer.eval_iters < 40 and (budget.MIN_EVALS + 1) * eval_s <= budget.EVAL_SHARE * 55
    assert eval_s == pytest.approx(2.1 * fewer.eval_iters / 40)
    assert budget.fewer_batches_per_evaluation(cfg, 1200, eval_s=2.1)[0].eval_iters == 40  # 20 minutes: all
    least = budget.fewer_batches_per_evaluation(cfg, 5, eval_s=2.1)[0].eval_iters
    assert least * 16 * 128 >= budget.EVAL_TOKENS / 8 > (least - 1) * 16 * 128
    batches = [budget.fewer_batches_per_evaluation(cfg, s, 2.1)[0].eval_iters for s in (5, 30, 60, 300, 1200)]
    assert batches == sorted(batches)


def test_an_evaluation_reads_the_same_number_of_tokens_whatever_the_batch():
    read = []
    for seconds in (60, 1200, 36_000):  # more time: larger batches
        chosen = budget.choose_run(30_000_000, 3_000_000, 65, 50 * GFLOPS, seconds)[0]
        tokens_per_batch = chosen["batch_size"] * chosen["block_size"]
        read.append((chosen["batch_size"], chosen["eval_iters"] * tokens_per_batch))
        assert budget.EVAL_TOKENS <= read[-1][1] < budget.EVAL_TOKENS + tokens_per_batch
    assert len({batch for batch, _ in read}) == 3, read
    assert budget.choose_run(100_000, budget.EVAL_TOKENS, 65, 50 * GFLOPS, 60)[0]["eval_iters"] == 0  # read whole


def test_the_rule_chooses_around_what_was_given():
    given = {"block_size": 256, "batch_size": 8, "n_embd": 96}
    settings, _ = budget.choose_run(1_000_000, 100_000, 65, 50 * GFLOPS, 300, given)
    assert {k: settings[k] for k in given} == given and 96 % settings["n_head"] == 0
    five_heads, _ = budget.choose_run(1_000_000, 100_000, 65, 50 * GFLOPS, 300, {"n_head": 5})
    assert five_heads["n_embd"] % 5 == 0


def test_a_faster_device_gives_a_larger_model():
    assert size(choose(30_000_000, flops_per_s=20e12)[0]) > size(choose(30_000_000, flops_per_s=50 * GFLOPS)[0])


def test_the_sizing_counts_only_the_seconds_its_steps_will_have(monkeypatch):
    counted = []
    real = budget.choose_run
    monkeypatch.setattr(budget, "choose_run", lambda *args: counted.append(args[4]) or real(*args))
    budget.size_run(train.TrainConfig(), {}, (1_000_000, 100_000, 65), 60.0, 1, lambda c: (0.05, 0.5))
    assert counted and counted == [pytest.approx(60.0 * budget.USABLE * (1 - budget.EVAL_SHARE))] * len(counted)


def test_size_run_settles_where_the_rate_measured_for_a_choice_gives_that_choice():
    measured = []

    def measure(cfg):  # seconds a step on a CPU where it costs 30 ms plus 2 ms a sequence, a third more with dropout
        measured.append(cfg)
        sequence_s = 0.002 * cfg.n_layer * cfg.n_embd**2 / (4 * 128**2)
        return (0.03 + sequence_s * cfg.batch_size) * (1.33 if cfg.dropout else 1), 1.0

    seconds = 300 / (budget.USABLE * (1 - budget.EVAL_SHARE))  # so that the rule sizes for 300 s of steps
    keys = ("n_layer", "n_embd", "block_size", "batch_size", "dropout")
    for train_tokens in (20_000, 1_000_000, 30_000_000):
        measured.clear()
        cfg, _ = budget.size_run(train.TrainConfig(), {}, (train_tokens, train_tokens // 9, 65), seconds, 1, measure)
        flops = budget.model_flops_per_token(cfg.n_layer, cfg.n_embd, cfg.block_size, 65)
        rate = cfg.batch_size * cfg.block_size * flops / measure(cfg)[0]
        again, _ = budget.choose_run(train_tokens, train_tokens // 9, 65, rate, 300)
        assert [again[k] for k in keys] == [getattr(cfg, k) for k in keys], train_tokens
        first, _ = budget.choose_run(train_tokens, train_tokens // 9, 65, budget.FIRST_GUESS_FLOPS, 300)
        assert measured[0].dropout == first["dropout"]  # measured as the first guess would train, not the default's


def test_a_model_from_128_wide_reads_256_positions_and_its_smallest_batch_holds_as_many_tokens():
    assert [budget.shape_settings(*shape)["block_size"] for shape in budget.SHAPES[:4]] == [64, 64, 256, 256]
    # Ten hours on a small text: its passes end the run, so the time left goes to the most steps, at the smallest batch.
    chosen = [choose(train_tokens, seconds=36_000)[0] for train_tokens in (20_000, 100_000)]
    assert [(c["block_size"], c["batch_size"] * c["block_size"]) for c in chosen] == [(64, 1024), (256, 1024)]


def test_a_context_given_longer_than_the_smallest_batch_still_gets_a_batch():
    settings, _ = budget.choose_run(1_000_000, 100_000, 65, 5 * GFLOPS, 60, given={"block_size": 4096})
    assert settings["batch_size"] >= 1


def test_a_small_text_caps_the_steps_at_what_it_can_give():
    settings, max_steps = choose(20_000, seconds=36_000)
    tokens_per_step = settings["batch_size"] * settings["block_size"]
    assert max_steps * tokens_per_step <= budget.MAX_EPOCHS * 20_000 + tokens_per_step


def test_time_left_after_the_passes_a_text_can_give_goes_to_more_smaller_steps():
    plans = [choose(100_000, seconds=s) for s in (1200, 2400, 3600, 36_000)]  # each 5 x 160 over 50 passes
    assert len({(p["n_layer"], p["n_embd"], p["dropout"]) for p, _ in plans}) == 1
    batches, steps = [p["batch_size"] for p, _ in plans], [s for _, s in plans]
    smallest = budget.MIN_BATCH_TOKENS // plans[-1][0]["block_size"]
    assert batches == sorted(batches, reverse=True) and batches[0] > batches[-1] == smallest
    assert steps == sorted(steps) and steps[0] < steps[-1]


def test_a_text_read_often_enough_for_dropout_gets_at_least_min_steps_and_others_the_nearest_batch():
    """With dropout the batch rounds down, so the run takes MIN_STEPS steps or more; without, to the nearest 8."""
    under = {True: 0, False: 0}  # plans under MIN_STEPS steps, with dropout and without
    for train_tokens in (100_000, 300_000, 1_000_000, 30_000_000):
        for gflops in range(20, 400, 7):
            s, _ = choose(train_tokens, flops_per_s=gflops * GFLOPS)
            batch, block = s["batch_size"], s["block_size"]
            flops = budget.model_flops_per_token(s["n_layer"], s["n_embd"], block, 65)
            tokens = min(budget.MAX_EPOCHS * train_tokens, gflops * GFLOPS * 300 / flops)
            steps = tokens / (batch * block)
            if batch > budget.MIN_BATCH_TOKENS // block:  # rounded, not the smallest batch
                if s["dropout"]:
                    assert steps >= budget.MIN_STEPS, (train_tokens, gflops, s)
                under[bool(s["dropout"])] += steps < budget.MIN_STEPS
                assert steps >= budget.MIN_STEPS * (batch - 4) / batch  # at most half a multiple of 8 away
    assert under[False] > 0 and under[True] == 0


def test_a_batch_given_on_the_command_line_counts_in_the_cap_on_steps(monkeypatch):
    monkeypatch.setattr(budget, "process_age", lambda: 0.0)
    cfg, given = train.TrainConfig(batch_size=4, max_time="10h"), {"batch_size": "command line"}
    data = ({"vocab_size": 65}, {"train": range(20_000), "val": range(2_000)})
    plan = budget.Budget(cfg, given)
    sized = budget.size_for_data(cfg, given, data, train.device.Processes(0, 1, "cpu"), plan, lambda c: (0.01, 0.1))
    assert sized.batch_size == 4
    assert plan.max_steps == budget.most_steps(20_000, 4 * sized.block_size)  # MAX_EPOCHS passes of batch 4


def test_the_context_fits_a_tiny_val_split():
    settings, _ = budget.choose_run(2_000, 200, 65, 50 * GFLOPS, 300)
    assert settings["block_size"] <= 100


# --- The budget's bookkeeping -------------------------------------------------------------------


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("5m", 300), ("2h", 7200), ("1h30m", 5400), ("1.5h", 5400),
                                           ("300", 300), (" 2m ", 120)])
def test_durations(text, seconds):
    assert budget.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5 minutes", "m5", "1x", "5m5"])
def test_a_bad_duration_is_a_user_error(text):
    with pytest.raises(UserError, match="max_time"):
        budget.parse_duration(text)


@pytest.mark.parametrize("start", [0, 30, 33])  # a plan made at step 0, or again later (at an evaluation or not)
@pytest.mark.parametrize("eval_interval", [None, 7, 100])
def test_planned_steps_and_evaluations_fill_the_time_without_passing_it(eval_interval, start):
    step_s, eval_s, seconds = 0.05, 0.4, 120
    steps = budget.plan_steps(seconds, step_s, eval_s, eval_interval, start=start)

    def used(steps):  # an evaluation at the start, every eval_interval steps, and at the end
        evals = (budget.spread_evaluations(seconds, eval_s) + 1 if eval_interval is None
                 else len({start + steps, *(i for i in range(start, start + steps) if i % eval_interval == 0)}))
        return steps * step_s + evals * eval_s

    assert used(steps) <= seconds + 1e-9 and used(steps + 1) > seconds - 1e-9  # full: one more would not fit
    assert budget.plan_steps(seconds, step_s, eval_s, eval_interval, max_steps=10) == 10


def test_fitting_a_preset_to_time_keeps_what_the_command_line_set():
    cfg = train.TrainConfig(max_iters=2000, lr_decay_iters=2000, eval_interval=250, warmup_iters=100, max_time="2m")
    sources = {"max_iters": "p.toml", "lr_decay_iters": "p.toml", "eval_interval": "p.toml", "max_time": "command line",
               "warmup_iters": "command line"}
    fitted, _ = budget.Budget(cfg, sources).fit(cfg, step_s=0.01, eval_s=0.5, elapsed=3.0)
    assert fitted.max_iters == fitted.lr_decay_iters == budget.plan_steps(budget.USABLE * 120 - 3.0, 0.01, 0.5, 250)
    assert fitted.eval_interval == 250 and fitted.warmup_iters == 100


@pytest.mark.parametrize("given, expected", [({}, 6), ({"eval_iters": "command line"}, 40),
                                             ({"eval_interval": "p.toml"}, 40)])  # a preset's evaluations: its own
def test_only_evaluations_the_budget_spreads_read_fewer_batches(given, expected):
    cfg = train.TrainConfig(eval_iters=40, batch_size=16, block_size=128, max_time="1m")
    fitted, _ = budget.Budget(cfg, given).fit(cfg, step_s=0.05, eval_s=2.1, elapsed=60 * budget.USABLE - 55)
    assert fitted.eval_iters == expected


@pytest.mark.parametrize("spread", [True, False])
def test_no_time_left_is_a_user_error_whose_numbers_add_up(spread):
    cfg = train.TrainConfig(max_time="10s", eval_interval=50)
    given = {"eval_iters": "command line"} | ({} if spread else {"eval_interval": "p.toml"})
    with pytest.raises(UserError) as e:
        budget.Budget(cfg, given).fit(cfg, step_s=5.0, eval_s=3.0, elapsed=0.0)
    left, step_s, evals, eval_s = map(float, re.search(
        r"leaves (\d+) s after start-up, less than a step \(([\d.]+) s\) and the (\d+) evaluations a run needs "
        r"\(([\d.]+) s each\)", str(e.value)).groups())
    assert step_s + evals * eval_s > left  # what it says does not fit, does not


def test_a_slow_machine_evaluates_part_of_a_small_val_split_rather_than_refuse_its_own_plan():
    """The README's own-text command at 60s on a busy machine: the sizing chose the run, whose evaluations of
    the whole val split (75,000 tokens) timed at 23.3 s each, and 5 of them cannot fit in 44 s."""
    cfg = train.TrainConfig(max_time="60s", eval_iters=0, batch_size=16, block_size=128)
    fitted, said = budget.Budget(cfg, {}).fit(cfg, step_s=0.76, eval_s=23.31, elapsed=60 * budget.USABLE - 44,
                                              val_tokens=75_000)
    assert 0 < fitted.eval_iters < 75_000 / (16 * 128) and fitted.max_iters > 20
    assert budget.Budget(cfg, {}).fit(cfg, step_s=0.01, eval_s=0.1, elapsed=0.0, val_tokens=75_000)[0].eval_iters == 0


class FakeClock:
    """The budget's clock (budget.process_age), moved only by training steps and evaluations:
    the probe says a step takes 10 ms and an evaluation 0.1 s; the loop's steps take step_s."""

    def __init__(self, monkeypatch):
        self.now, self.step_s, self.probes, self.steps, self.slower = 0.0, 0.01, [], 0, {}  # slower: {from step: s}
        real_step, real_estimate, real_set_up = train.train_step, train.estimate_loss, train.set_up

        def set_up(*args, **kwargs):
            self.now = 0.0  # a new run: its process has just started
            return real_set_up(*args, **kwargs)

        def probe(run, speeds=None):
            if speeds is None or speeds.get(run.cfg) is None:  # timed, not remembered
                self.probes.append(run.cfg)
                if speeds is not None:
                    speeds.put(run.cfg, (0.01, 0.0, 0.0))
            return 0.01, 0.1

        def train_step(*args, **kwargs):
            self.steps += 1
            self.step_s = self.slower.get(self.steps, self.step_s)
            self.now += self.step_s
            return real_step(*args, **kwargs)

        def estimate_loss(*args, **kwargs):
            self.now += 0.1
            return real_estimate(*args, **kwargs)

        monkeypatch.setattr(train, "set_up", set_up)
        monkeypatch.setattr(train, "probe", probe)
        monkeypatch.setattr(train, "train_step", train_step)
        monkeypatch.setattr(train, "estimate_loss", estimate_loss)
        monkeypatch.setattr(budget, "process_age", lambda: self.now)


@pytest.fixture
def clock(monkeypatch):
    return FakeClock(monkeypatch)


def read_log(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]


def test_no_preset_sizes_the_run_then_fits_its_steps_to_the_budget(data_dir, tmp_path, clock, capsys):
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=4s", "--patience=0"]) == 0
    out = capsys.readouterr().out
    assert "no preset: sized for the data" in out and "time budget 4s" in out
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    expected = budget.plan_steps(budget.USABLE * 4, 0.01, 0.1)
    assert saved["lr_decay_iters"] == saved["max_iters"]
    assert abs(saved["max_iters"] - expected) <= 1  # fitted again from steps as fast as the probe's: kept
    assert saved["optimizer"] == "muon" and saved["pos"] == "rope"  # the rule's recipe
    timed = [dataclasses.astuple(c) for c in clock.probes]
    assert len(set(timed)) == len(timed)  # the run the sizing chose and timed is not timed again for the budget
    evals = [r["iter"] for r in read_log(tmp_path) if "val_loss" in r]
    assert evals[-1] == saved["max_iters"] and len(evals) == budget.spread_evaluations(budget.USABLE * 4, 0.1) + 1
    assert clock.now <= budget.USABLE * 4 + 1e-9


def test_the_command_line_overrides_the_rule(data_dir, tmp_path, clock):
    args = [f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=2s", "--n_layer=1", "--batch_size=3",
            "--max_iters=7"]
    assert train.main(args) == 0
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert (saved["n_layer"], saved["batch_size"], saved["max_iters"]) == (1, 3, 7)


def test_the_probe_times_real_steps_and_leaves_the_model_as_it_was(data_dir, tmp_path, capsys, monkeypatch):
    """No fake steps: the probe runs the run's own steps and evaluations, then puts everything back, so
    the run's first evaluation is that of the untouched model (the same loss as a run without a budget)."""
    started = time.monotonic()
    monkeypatch.setattr(budget, "process_age", lambda: time.monotonic() - started)  # a fresh process's clock
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'b'}", "--max_time=4s"]) == 0
    assert "time budget 4s:" in capsys.readouterr().out
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'p'}", "--max_iters=1"]) == 0
    budgeted, plain = (read_log(tmp_path / run)[0] for run in ("b", "p"))
    assert budgeted["iter"] == plain["iter"] == 0 and budgeted["val_loss"] == plain["val_loss"]
    saved = files.load_checkpoint(tmp_path / "b" / "ckpt.pt")["train_config"]
    assert saved["max_iters"] == saved["lr_decay_iters"] != 20  # fitted to the time, not tiny.toml's 20


def test_a_preset_with_max_time_keeps_its_model_and_gets_steps_for_the_time(data_dir, tmp_path, clock):
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=3s"]) == 0
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert (saved["n_layer"], saved["n_embd"]) == (2, 32)  # tiny.toml's
    assert saved["max_iters"] == budget.plan_steps(budget.USABLE * 3, 0.01, 0.1, saved["eval_interval"])
    assert len(clock.probes) == 1  # only the steps were measured: no model to choose


@pytest.mark.parametrize("step_s", [0.005, 0.02])
def test_steps_slower_or_faster_than_the_probe_said_are_fitted_again_as_the_run_goes(
        data_dir, tmp_path, clock, capsys, step_s):
    clock.step_s = step_s  # the probe said 10 ms
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=3s"]) == 0
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    planned = budget.plan_steps(budget.USABLE * 3, 0.01, 0.1, saved["eval_interval"])
    assert f"planned: {planned:,}" in capsys.readouterr().out
    assert (saved["max_iters"] < planned) if step_s > 0.01 else (saved["max_iters"] > planned)
    assert saved["lr_decay_iters"] == saved["max_iters"]
    # The run ended within its budget, and less than a step and an evaluation short of it.
    assert budget.USABLE * 3 - step_s - 0.1 < clock.now <= budget.USABLE * 3 + 1e-9


def test_steps_that_slow_down_late_in_a_run_shorten_it_to_end_on_time(data_dir, tmp_path, clock, capsys):
    args = [TINY, f"--data_dir={data_dir}", "--max_time=3s"]
    assert train.main([*args, f"--out_dir={tmp_path / 'steady'}"]) == 0
    planned = files.load_checkpoint(tmp_path / "steady" / "ckpt.pt")["iter"]
    clock.steps, clock.slower = 0, {int(0.8 * planned): 0.015}  # half as slow again from 80% of the way
    assert train.main([*args, f"--out_dir={tmp_path / 'slowed'}"]) == 0
    saved = files.load_checkpoint(tmp_path / "slowed" / "ckpt.pt")
    assert saved["iter"] == saved["train_config"]["max_iters"] == saved["train_config"]["lr_decay_iters"] < planned
    assert clock.now <= budget.USABLE * 3 + 0.1  # past the plan's end by less than an evaluation
    assert [r["iter"] for r in read_log(tmp_path / "slowed") if "val_loss" in r][-1] == saved["iter"]  # scored


def test_a_plan_cut_to_the_step_it_is_at_still_evaluates_that_step(data_dir, tmp_path, clock):
    """Steps that turn slow at once late in a run leave no time for another: the run ends where it is,
    and its last steps are still evaluated (else best.pt would miss them)."""
    args = [TINY, f"--data_dir={data_dir}", "--max_time=3s", "--eval_interval=1000"]
    assert train.main([*args, f"--out_dir={tmp_path / 'steady'}"]) == 0
    planned = files.load_checkpoint(tmp_path / "steady" / "ckpt.pt")["iter"]
    clock.steps, clock.slower = 0, {int(0.9 * planned) + 1: 0.1}  # ten times slower for the last tenth
    assert train.main([*args, f"--out_dir={tmp_path / 'slowed'}"]) == 0
    saved = files.load_checkpoint(tmp_path / "slowed" / "ckpt.pt")
    evaluated = [r["iter"] for r in read_log(tmp_path / "slowed") if "val_loss" in r]
    assert evaluated[-1] == saved["iter"] == saved["train_config"]["max_iters"] < planned


@pytest.mark.parametrize("preset", [[], [TINY]], ids=["sized for the data", "a preset"])
def test_a_run_stopped_and_resumed_ends_with_the_weights_of_one_that_was_not(data_dir, tmp_path, clock,
                                                                             monkeypatch, preset):
    args = [*preset, f"--data_dir={data_dir}", "--max_time=3s", "--dropout=0.1", "--patience=0",
            "--muon_weight_decay=0.1"]  # dropout's masks, and Muon's decay (which the rule gives where there is none)
    assert train.main([*args, f"--out_dir={tmp_path / 'whole'}"]) == 0

    real_step, steps = train.train_step, []

    def interrupted_step(*a, **k):  # Ctrl-C arrives during the 20th step
        steps.append(1)
        if len(steps) == 20:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*a, **k)

    monkeypatch.setattr(train, "train_step", interrupted_step)
    assert train.main([*args, f"--out_dir={tmp_path / 'split'}"]) == 130
    monkeypatch.setattr(train, "train_step", real_step)
    clock.probes.clear()
    assert train.main([*preset, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'split'}", "--init_from=resume"]) == 0
    assert clock.probes == []  # the resumed run kept the steps it planned: nothing measured again
    whole = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=True)
    split = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    assert whole["iter"] == split["iter"] == whole["train_config"]["max_iters"] > 20
    assert all(torch.equal(whole["model"][k], split["model"][k]) for k in whole["model"])


def test_max_iters_with_max_time_is_the_most_steps_the_budget_may_fit(data_dir, tmp_path, clock, capsys):
    args = [TINY, f"--data_dir={data_dir}", "--max_time=3s"]
    assert train.main([*args, f"--out_dir={tmp_path / 'a'}", "--max_iters=5"]) == 0
    assert "time budget 3s: 5 steps (--max_iters)" in capsys.readouterr().out
    assert files.load_checkpoint(tmp_path / "a" / "ckpt.pt")["iter"] == 5
    assert train.main([*args, f"--out_dir={tmp_path / 'b'}", "--max_iters=100000"]) == 0
    assert "(--max_iters)" not in capsys.readouterr().out  # the time, not --max_iters, set the steps
    saved = files.load_checkpoint(tmp_path / "b" / "ckpt.pt")
    assert 10 < saved["iter"] == saved["train_config"]["max_iters"] < 3 / 0.01  # what fits, not 100,000
    assert clock.now <= budget.USABLE * 3 + 1e-9


# --- The same command, the same run ---------------------------------------------------------------


def test_a_dry_run_says_the_choice_and_the_plan_and_writes_nothing(data_dir, tmp_path, clock, capsys):
    out_dir = tmp_path / "out"
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--max_time=4s", "--dry_run"]) == 0
    said = capsys.readouterr().out
    assert "no preset: sized for the data" in said and "time budget 4s: " in said
    assert "to train it: python train.py " in said and said.rstrip().endswith("nothing trained, nothing written")
    assert not out_dir.exists()


def test_the_same_command_chooses_the_same_run_from_what_this_machine_timed_before(data_dir, tmp_path, monkeypatch,
                                                                                   capsys):
    monkeypatch.setattr(budget, "process_age", lambda: 0.0)
    timings = []

    def noisy(*args, **kwargs):  # each timing of a step a different figure, as on a busy machine
        timings.append(1)
        return 0.002 * (1 + len(timings) % 4), 0.001, 0.001

    monkeypatch.setattr(budget, "time_steps", noisy)
    chosen = []
    for _ in range(5):
        assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=60s", "--dry_run"]) == 0
        chosen.append([line for line in capsys.readouterr().out.splitlines() if not line.startswith("timing ")])
        if len(chosen) == 1:
            first = len(timings)
    assert first >= 1 and len(timings) == first  # timed once, then remembered
    assert all(said == chosen[0] for said in chosen)  # the choice and the plan, word for word


def test_the_repeat_command_trains_the_same_run_again_without_timing_anything(data_dir, tmp_path, clock, capsys):
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'timed'}", "--max_time=4s"]) == 0
    command = (tmp_path / "timed" / "repeat.txt").read_text(encoding="utf-8").strip()
    assert command in capsys.readouterr().out
    argv = shlex.split(command)
    assert argv[:2] == ["python", "train.py"] and not any(a.startswith("--max_time") for a in argv)
    clock.probes.clear()
    assert train.main(argv[2:]) == 0
    assert clock.probes == []  # nothing timed
    timed, again = ({k: v for k, v in files.load_checkpoint(tmp_path / run / "ckpt.pt")["train_config"].items()
                     if k not in ("out_dir", "max_time")} for run in ("timed", "timed_repeat"))
    assert again == timed
    losses = [[r["val_loss"] for r in read_log(tmp_path / run) if "val_loss" in r] for run in ("timed", "timed_repeat")]
    assert losses[0] == losses[1]


def test_the_loops_own_step_plans_the_next_run_and_chooses_it_only_when_shorter_past_the_noise():
    speeds = budget.Speeds("this machine", 65)
    one, two = train.TrainConfig(n_layer=1), train.TrainConfig(n_layer=2)
    speeds.put(one, (0.1, 0.03, 0.01))
    speeds.put(two, (0.2, 0.06, 0.01))
    assert speeds.loop_step(one) is None
    for loop in (0.1 * (1 - budget.NOISE / 2), 0.3):  # within the noise; a busy hour
        speeds.learn(one, loop)
        again = budget.Speeds("this machine", 65)
        assert again.get(one) == (0.1, 0.03, 0.01) and again.loop_step(one) == loop  # chosen as before, planned anew
    speeds.learn(one, 0.05)
    again = budget.Speeds("this machine", 65)
    assert again.get(one) == pytest.approx((0.05, 0.015, 0.005)) and again.get(two) == (0.2, 0.06, 0.01)
    assert budget.Speeds("another machine", 65).get(one) is None and budget.Speeds("this machine", 66).get(one) is None
    cfg = train.TrainConfig(n_layer=1, max_time="60s")
    planned = budget.Budget(cfg, {}, again).fit(cfg, step_s=0.1, eval_s=0.5, elapsed=0.0)[0].max_iters
    by_the_loop = budget.Budget(cfg, {}).fit(cfg, step_s=0.05, eval_s=0.5, elapsed=0.0)[0].max_iters
    assert planned == by_the_loop  # planned by the last loop's step, not the one timed


def test_a_damaged_or_unwritable_cache_costs_only_what_it_remembered(tmp_path, monkeypatch):
    cfg = train.TrainConfig()
    path = Path(system.cache_dir()) / "speeds.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"machines": {"m": {"a": [1, 2]}', encoding="utf-8")
    speeds = budget.Speeds("m", 65)
    assert speeds.get(cfg) is None
    speeds.put(cfg, (0.1, 0.01, 0.02))
    assert budget.Speeds("m", 65).get(cfg) == (0.1, 0.01, 0.02)  # the damaged file replaced
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a file"))  # no directory can be made there
    speeds = budget.Speeds("m", 65)
    speeds.put(cfg, (0.1, 0.01, 0.02))
    assert speeds.get(cfg) == (0.1, 0.01, 0.02) and budget.Speeds("m", 65).get(cfg) is None


@pytest.mark.parametrize("step_s, seconds", [(0.002, 2), (0.05, 4)])  # 2 s: the grown plan's steps are real
def test_a_plan_that_grows_or_shrinks_spreads_its_evaluations_and_warmup_again(data_dir, tmp_path, clock, capsys,
                                                                             step_s, seconds):
    clock.step_s = step_s  # the probe said 10 ms
    args = [f"--data_dir={data_dir}", f"--out_dir={tmp_path}", f"--max_time={seconds}s", "--patience=0"]
    assert train.main(args) == 0
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    evals = [r["iter"] for r in read_log(tmp_path) if "val_loss" in r]
    spread = budget.spread_evaluations(budget.USABLE * seconds, 0.1)
    assert budget.MIN_EVALS <= len(evals) <= spread + 2 and evals[-1] == saved["max_iters"]  # the first, the last
    assert saved["warmup_iters"] <= max(1, saved["max_iters"] // 10)
    assert capsys.readouterr().out.count("under half the") == (step_s > 0.01)  # a slowed run says so, once


def test_a_plan_cut_near_its_end_keeps_its_evaluations_as_far_apart_as_over_the_whole_run():
    """Evaluations still to come are spread over the steps still to come, but never closer than the whole run's
    spread: near the end that would be an evaluation every step, and a repeat command that said so."""
    cfg = train.TrainConfig(max_time="60s")
    plan = budget.Budget(cfg, {})
    cfg, _ = plan.fit(cfg, step_s=0.05, eval_s=0.5, elapsed=0.0)
    late = int(0.95 * cfg.max_iters)
    cut, said = plan.replan(cfg, late, 0.05, 0.5, now=60 * budget.USABLE - 1.0, evaluated=plan.evals - 1)
    assert said and late < cut.max_iters < cfg.max_iters
    assert cut.eval_interval >= math.ceil(cut.max_iters / (plan.evals - 1))


# --- Early stopping and the best model -----------------------------------------------------------


def scripted_val_losses(monkeypatch, values):
    """Evaluations report these val losses in turn (train loss alike)."""
    values = iter(values)

    def estimate_loss(*args, **kwargs):
        v = next(values)
        return {"train": v, "val": v}

    monkeypatch.setattr(train, "estimate_loss", estimate_loss)


def test_a_run_stops_when_val_loss_has_not_improved_for_patience_evaluations(data_dir, tmp_path, monkeypatch, capsys):
    scripted_val_losses(monkeypatch, [3.0, 2.0, 1.5, 1.6, 1.55, 1.7, 1.4, 1.3])
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=70", "--eval_interval=10",
            "--patience=3"]
    assert train.main(args) == 0
    assert "stopped early at iteration 50" in capsys.readouterr().out
    assert [r["iter"] for r in read_log(tmp_path) if "val_loss" in r] == [0, 10, 20, 30, 40, 50]
    best = files.load_checkpoint(tmp_path / "best.pt")
    assert (best["iter"], best["val_loss"]) == (20, 1.5)  # best.pt holds the best, not the last
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["iter"] == 50


def test_resuming_a_run_that_stopped_early_does_not_train_on(data_dir, tmp_path, monkeypatch, capsys):
    scripted_val_losses(monkeypatch, [3.0, 2.0, 2.5, 2.6])
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=70", "--eval_interval=10",
            "--patience=2"]
    assert train.main(args) == 0
    capsys.readouterr()
    assert train.main([*args, "--init_from=resume"]) == 0
    assert "stopped early at iteration 30" in capsys.readouterr().out
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["iter"] == 30


def test_patience_zero_never_stops_early(data_dir, tmp_path, monkeypatch):
    scripted_val_losses(monkeypatch, [1.0] + [2.0] * 7)
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=70", "--eval_interval=10"]
    assert train.main([*args, "--patience=0"]) == 0
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["iter"] == 70


def test_sample_reads_best_pt_when_it_exists_else_ckpt_pt(data_dir, tmp_path, capsys):
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=4"]) == 0
    assert files.checkpoint_path(tmp_path) == tmp_path / "best.pt"
    assert files.checkpoint_path(tmp_path, "ckpt.pt") == tmp_path / "ckpt.pt"
    (tmp_path / "ckpt.pt").write_text("not read: best.pt is")
    assert sample.main([f"--out_dir={tmp_path}", "--max_new_tokens=5"]) == 0
    assert sample.main([f"--out_dir={tmp_path}", "--max_new_tokens=5", "--checkpoint=ckpt.pt"]) == 2
    os.replace(tmp_path / "best.pt", tmp_path / "ckpt.pt")
    capsys.readouterr()
    assert sample.main([f"--out_dir={tmp_path}", "--max_new_tokens=5"]) == 0  # no best.pt: the latest


# --- Where a run goes ------------------------------------------------------------------------------


def test_out_dir_follows_the_data_when_nobody_sets_it(data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train.main([TINY, f"--data_dir={data_dir}", "--max_iters=2"]) == 0
    assert (tmp_path / "out" / Path(data_dir).name / "ckpt.pt").is_file()


def test_a_presets_out_dir_holds_only_with_its_own_data(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('data_dir = "data/a"\nout_dir = "out/p"\n')
    for argv, expected in [([str(preset)], "out/p"), ([str(preset), "--data_dir=data/b"], "out/b"),
                           ([str(preset), "--data_dir=data/b", "--out_dir=mine"], "mine"),
                           ([], "out/shakespeare_char")]:
        sources = {}
        cfg = train.load_config(train.TrainConfig, argv, sources=sources)
        assert files.run_out_dir(cfg, sources) == expected


@pytest.mark.parametrize("master", [True, False])
def test_under_torchrun_only_rank_0_says_a_replan(master):
    """Every process replans alike (rank 0's times); one line for the run, not one per process."""
    class Procs:
        def broadcast(self, numbers):
            return tuple(numbers)

    class Bar:
        total, written = 0, []

        def write(self, line):
            self.written.append(line)

    procs, bar = Procs(), Bar()
    procs.master = master
    cfg = train.TrainConfig(max_iters=1000, eval_interval=100, max_time="1m")
    times = type("Times", (), {"means": lambda self, it: (0.02, 0.1, 10.0, 1)})()  # steps twice as fast as planned
    run = type("Run", (), {"cfg": cfg, "it": 100, "procs": procs, "time_budget": budget.Budget(cfg, {})})()
    train.replan(run, times, bar)
    assert run.cfg.max_iters != 1000 and bar.total == run.cfg.max_iters  # replanned on every process
    assert len(bar.written) == master and all(line.startswith("time budget: ") for line in bar.written)
