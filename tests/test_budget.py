"""What a run leaves auto, chosen for its data and its time: the rule, the timing, the clock a timed run's schedule
runs on; early stopping, the best model by default, and where a run's files go when nobody says."""

import dataclasses
import json
import math
import os
import shlex
import signal
from pathlib import Path

import pytest
import torch

import sample
import train
from config import AUTO, UserError
from tinygpt import budget, files, optim, system

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
    matrix = [torch.nn.Parameter(torch.zeros(4, 4))]
    decays = [optim.muon(matrix, train.TrainConfig(dropout=run["dropout"])).param_groups[0]["weight_decay"]
              for run in runs]  # muon_weight_decay's auto
    assert decays == [0.0 if run["dropout"] else 0.1 for run in runs]


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


def test_the_rule_chooses_around_what_was_given():
    given = {"block_size": 256, "batch_size": 8, "n_embd": 96}
    settings, _ = budget.choose_run(1_000_000, 100_000, 65, 50 * GFLOPS, 300, given)
    assert {k: settings[k] for k in given} == given and 96 % settings["n_head"] == 0
    for heads in (5, 6):  # a width those heads divide, into heads of an even size: rotary positions need pairs
        settings, _ = budget.choose_run(1_000_000, 100_000, 65, 50 * GFLOPS, 300, {"n_head": heads})
        assert settings["n_embd"] % (2 * heads) == 0


@pytest.mark.parametrize("given, filled", [("--n_head=6", "pos=rope,"), ("--n_head=5", "pos=rope,"),
                                           ("--n_embd=99", "pos=learned,"), ("--window=96", "block_size=96,"),
                                           ("--n_layer=0", "auto: n_head=")])
def test_what_is_filled_around_a_setting_given_goes_with_it(data_dir, tmp_path, clock, capsys, given, filled):
    """Not an error about a setting nobody gave: rotary positions turn pairs of a head's channels (a width given
    with heads of an odd size gets learned ones), a window given needs a context as long, and a bigram (no
    blocks) has no parameters in them to feed."""
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=60s", given, "--dry_run"]) == 0
    assert filled in capsys.readouterr().out


def test_a_faster_device_gives_a_larger_model():
    assert size(choose(30_000_000, flops_per_s=20e12)[0]) > size(choose(30_000_000, flops_per_s=50 * GFLOPS)[0])


def test_evaluations_read_the_same_tokens_whatever_the_batch_and_a_small_val_split_whole():
    read = []
    for batch, block in ((8, 64), (16, 256), (128, 256)):
        cfg = train.TrainConfig(batch_size=batch, block_size=block)
        iters = budget.eval_batches(cfg, 3_000_000)
        read.append(iters * batch * block)
        assert budget.EVAL_TOKENS <= read[-1] < budget.EVAL_TOKENS + batch * block
    assert budget.eval_batches(train.TrainConfig(batch_size=16, block_size=64), budget.EVAL_TOKENS) == 0  # whole


def test_a_short_runs_evaluations_read_fewer_batches_to_take_a_small_share_of_its_time():
    cfg, per_token = train.TrainConfig(batch_size=16, block_size=128), 1e-5  # 20 ms a batch: 40 of them, 0.8 s
    fewer = [budget.eval_batches(cfg, 3_000_000, per_token, seconds) for seconds in (5, 30, 60, 300, 1200)]
    assert fewer == sorted(fewer) and fewer[0] == 1 and fewer[-1] == 40  # twenty minutes: all 40
    batch_s = (budget.EVALS + 1) * 2 * per_token * 16 * 128  # a batch more in each evaluation of both splits
    assert fewer[2] * batch_s - batch_s <= budget.EVAL_SHARE * 60 < fewer[2] * batch_s + batch_s  # a minute's


def test_evaluations_are_sized_by_the_forward_pass_as_timed_in_the_precision_they_run_in():
    """On a bf16 CPU evaluations run in fp32, a forward pass there as long as two thirds of a bf16 step rather than
    a third: half as many batches keep them to EVAL_SHARE of the time."""
    def filled(forward_share):
        measure = lambda cfg: timing(cpu_step(cfg), forward_share)  # noqa: E731
        return budget.fill_auto(train.TrainConfig(max_time="5m"), (1_000_000, 100_000, 65), measure)[0]

    bf16, fp32 = filled(1 / 3), filled(2 / 3)
    assert dataclasses.replace(fp32, eval_iters=bf16.eval_iters) == bf16  # the same run otherwise
    assert 1 < fp32.eval_iters < bf16.eval_iters <= 2 * fp32.eval_iters


def test_the_sizing_counts_only_the_seconds_its_steps_will_have(monkeypatch):
    counted = []
    real = budget.choose_run
    monkeypatch.setattr(budget, "choose_run", lambda *args: counted.append(args[4]) or real(*args))
    budget.size_run(train.TrainConfig(max_time="1m"), (1_000_000, 100_000, 65), lambda c: timing(0.05), 60.0)
    assert counted and counted == [pytest.approx(60.0 * budget.USABLE * (1 - budget.EVAL_SHARE))] * len(counted)


def timing(step_s, forward_share=1 / 3):
    """What train.measure returns: seconds per step, and per forward pass of the batch (a third of a step's FLOPs)."""
    return step_s, forward_share * step_s


def cpu_step(cfg):
    """Seconds a step on a CPU where it costs 30 ms plus 2 ms a sequence, a third more with dropout."""
    sequence_s = 0.002 * cfg.n_layer * cfg.n_embd**2 / (4 * 128**2)
    return (0.03 + sequence_s * cfg.batch_size) * (1.33 if cfg.dropout else 1)


@pytest.mark.parametrize("speed", [1 / 64, 1, 64])  # a machine 64x slower than cpu_step's, as fast, 64x faster
def test_size_run_settles_where_the_rate_measured_for_a_choice_stands_by_that_choice(speed):
    measured = []

    def measure(cfg):
        measured.append(cfg)
        return timing(cpu_step(cfg) / speed)

    seconds = 300 / (budget.USABLE * (1 - budget.EVAL_SHARE))  # so that the rule sizes for 300 s of steps
    keys = ("n_layer", "n_embd", "block_size", "batch_size", "dropout")
    for train_tokens in (20_000, 1_000_000, 30_000_000):
        measured.clear()
        chosen, _, per_token = budget.size_run(train.TrainConfig(max_time="5m"),
                                               (train_tokens, train_tokens // 9, 65), measure, seconds)
        cfg = dataclasses.replace(train.TrainConfig(), **chosen)
        flops = budget.model_flops_per_token(cfg.n_layer, cfg.n_embd, cfg.block_size, 65)
        rate = flops / 3 / per_token  # the rate the choice was made at
        again, _ = budget.choose_run(train_tokens, train_tokens // 9, 65, rate, 300)
        assert [again[k] for k in keys] == [getattr(cfg, k) for k in keys], train_tokens
        measured_rate = cfg.batch_size * cfg.block_size * flops / measure(cfg)[0]
        assert -budget.STANDS <= math.log2(measured_rate / rate) <= 0.5  # and it stood
        assert measured[-1] == dataclasses.replace(measured[-1], **chosen)  # the choice is the run timed last
        assert (chosen["optimizer"], chosen["pos"]) == ("muon", "rope")  # the fast recipe's


def test_a_machine_timed_at_the_first_guess_keeps_the_rules_choice_there_in_either_dtype():
    """The rate the sizing starts from is two CPU cores' in fp32, whatever the dtype: where the timing agrees with
    it, the choice is the rule's at that rate."""
    sizes, seconds, keys = (1_000_000, 100_000, 65), 60.0, ("n_layer", "n_embd", "block_size", "batch_size")
    rule, _ = budget.choose_run(*sizes, budget.FIRST_GUESS_FLOPS, budget.USABLE * (1 - budget.EVAL_SHARE) * seconds)
    for dtype in ("float32", "bfloat16"):

        def measure(cfg):  # exactly the rate guessed
            flops = budget.model_flops_per_token(cfg.n_layer, cfg.n_embd, cfg.block_size, 65)
            return timing(cfg.batch_size * cfg.block_size * flops / budget.FIRST_GUESS_FLOPS)

        chosen, _, _ = budget.size_run(train.TrainConfig(max_time="1m", dtype=dtype), sizes, measure, seconds)
        assert [chosen[k] for k in keys] == [rule[k] for k in keys]


def test_a_two_core_fp32_machine_chooses_the_larger_model_its_rate_feeds_at_5_minutes():
    """A 2-core Zen 3 in fp32, 5 minutes of Tiny Shakespeare: 3 x 96 at block 64 runs at 2^35.8 and 4 x 128 at
    block 256 at 2^36. At the guess, 2^35.75, the rule gives 4 x 128 (batch 8), which stands; a guess of 2^35.5
    chose 3 x 96, whose own rate stood there, and trained to a 1.2% higher loss."""
    sizes, seconds = (1_003_854, 111_540, 65), 300.0

    def measure(cfg):
        flops = budget.model_flops_per_token(cfg.n_layer, cfg.n_embd, cfg.block_size, 65)
        return timing(cfg.batch_size * cfg.block_size * flops / 2 ** (35.8 if cfg.n_layer < 4 else 36.0))

    chosen, _, _ = budget.size_run(train.TrainConfig(max_time="5m", dtype="float32"), sizes, measure, seconds)
    assert (chosen["n_layer"], chosen["n_embd"], chosen["block_size"], chosen["batch_size"]) == (4, 128, 256, 8)


def test_the_same_machine_chooses_the_same_run_however_its_timings_wander():
    """Each timing a few percent off, as on a machine whose other work comes and goes: the speed the sizing goes by
    is rounded to a power of two, so the choice is the same every time."""
    choices = set()
    for trial in range(20):
        noise = 1 + 0.04 * math.sin(trial)  # within 4% of the quiet figure

        def measure(cfg, noise=noise):
            return timing(cpu_step(cfg) * noise)

        chosen, _, _ = budget.size_run(train.TrainConfig(max_time="5m"), (1_000_000, 100_000, 65), measure, 290.0)
        choices.add(tuple(sorted(chosen.items())))
    assert len(choices) == 1


def test_a_choice_made_again_stands_where_its_own_rate_lands_a_little_below_the_rounding_edge():
    """A 2-core Zen 5 in bf16, 1 minute: the first model timed runs at 2^37.6, so the run is chosen again at 2^38;
    that choice runs at 2^37.45, below 2^37.5, where rounding alone would go back to a smaller model. It stands: the
    same machine, timed a little faster or slower, makes the same choice."""
    sizes, seconds, keys = (1_000_000, 100_000, 65), 60.0, ("n_layer", "n_embd", "block_size", "batch_size")
    timed = []

    def measure(cfg):
        timed.append(cfg)
        flops = budget.model_flops_per_token(cfg.n_layer, cfg.n_embd, cfg.block_size, 65)
        return timing(cfg.batch_size * cfg.block_size * flops / 2 ** (37.6 if cfg == timed[0] else 37.45))

    chosen, _, _ = budget.size_run(train.TrainConfig(max_time="1m", dtype="bfloat16"), sizes, measure, seconds)
    rule, _ = budget.choose_run(*sizes, 2**38, budget.USABLE * (1 - budget.EVAL_SHARE) * seconds)
    assert [chosen[k] for k in keys] == [rule[k] for k in keys]
    assert len({tuple(getattr(c, k) for k in keys) for c in timed}) == 2  # the guess's model, then this one


def test_a_first_model_timed_on_either_side_of_a_rounding_edge_leads_to_the_same_choice():
    """A 2-core Zen 5 in bf16, 5 minutes of Tiny Shakespeare: the guess's model runs at 2^37.45 or 2^37.55 from one
    preview to the next, so the run is chosen again at 2^37 or at 2^38. The rate grows with the model: the one chosen
    at 2^37 runs at 2^37.7, which rounds above, so it is chosen again, at 2^38; that one runs at 2^37.9. Both
    previews choose the same run."""
    sizes, seconds, keys = (1_003_854, 111_540, 65), 300.0, ("n_layer", "n_embd", "block_size", "batch_size")
    choices = []
    for first in (37.45, 37.55):
        timed = []

        def measure(cfg, first=first, timed=timed):
            timed.append(cfg)
            flops = budget.model_flops_per_token(cfg.n_layer, cfg.n_embd, cfg.block_size, 65)
            rate = first if len(timed) == 1 else 37.7 if cfg.n_layer == 4 else 37.9
            return timing(cfg.batch_size * cfg.block_size * flops / 2**rate)

        chosen, _, _ = budget.size_run(train.TrainConfig(max_time="5m", dtype="bfloat16"), sizes, measure, seconds)
        choices.append([chosen[k] for k in keys])
        assert timed[0].n_layer == 4 and len(timed) <= budget.TIMINGS
    rule, _ = budget.choose_run(*sizes, 2**38, budget.USABLE * (1 - budget.EVAL_SHARE) * seconds)
    assert choices == [[rule[k] for k in keys]] * 2 and rule["n_layer"] == 5


def test_a_first_model_that_runs_faster_than_the_guess_rounds_to_is_chosen_again():
    """A first model that runs at 2^36.7, 1.9x the guess, is chosen again at 2^37: it is smaller than the machine
    feeds."""
    sizes, seconds, keys = (1_000_000, 100_000, 65), 60.0, ("n_layer", "n_embd", "block_size", "batch_size")

    def measure(cfg):
        flops = budget.model_flops_per_token(cfg.n_layer, cfg.n_embd, cfg.block_size, 65)
        return timing(cfg.batch_size * cfg.block_size * flops / 2**36.7)

    assert budget.FIRST_GUESS_FLOPS == 2**35.75 and 0.7 < budget.STANDS
    chosen, _, _ = budget.size_run(train.TrainConfig(max_time="1m", dtype="bfloat16"), sizes, measure, seconds)
    rule, _ = budget.choose_run(*sizes, 2**37, budget.USABLE * (1 - budget.EVAL_SHARE) * seconds)
    assert [chosen[k] for k in keys] == [rule[k] for k in keys]


@pytest.mark.parametrize("rate", [35.2, 35.4])
def test_a_first_model_that_runs_a_little_slower_than_the_guess_stands(rate):
    """A 2-core Zen 3 in fp32, 1 minute of Tiny Shakespeare: the guess's model (2 x 64, batch 48) runs at 2^35.2 to
    2^35.4 from one preview to the next, up to 1.5x below the guess. It stands either way: a rate that rounded down
    to 2^35 would choose a smaller batch in some previews and not in others."""
    sizes, seconds, keys = (1_003_854, 111_540, 65), 60.0, ("n_layer", "n_embd", "block_size", "batch_size")
    timed = []

    def measure(cfg):
        timed.append(cfg)
        flops = budget.model_flops_per_token(cfg.n_layer, cfg.n_embd, cfg.block_size, 65)
        return timing(cfg.batch_size * cfg.block_size * flops / 2**rate)

    chosen, _, _ = budget.size_run(train.TrainConfig(max_time="1m", dtype="float32"), sizes, measure, seconds)
    assert [chosen[k] for k in keys] == [2, 64, 64, 48] and len({repr(c) for c in timed}) == 1


@pytest.mark.parametrize("age", [57.1, 10.0, 9.8])  # start-up outlasted the budget, or nearly (97% of it is usable)
def test_a_budget_whose_start_up_outlasts_it_is_one_line_not_a_traceback(data_dir, tmp_path, monkeypatch, capsys,
                                                                          age):
    monkeypatch.setattr(system, "process_age", lambda: age)
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_time=10s"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: max_time 10s is spent before the run starts") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()  # nothing written, not even the directory


def test_a_text_of_one_block_and_a_second_of_budget_still_gets_a_choice():
    settings, _ = budget.choose_run(65, 65, 65, 50 * GFLOPS, 1e-6)  # no time and no text to speak of
    assert settings["batch_size"] >= 1 and 0 <= settings["dropout"] <= 0.2


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
    """With dropout the batch rounds down, so the run takes MIN_STEPS steps or more, unless that would leave no
    multiple of 8 (then 8, the nearest); without, to the nearest 8."""
    under = {True: 0, False: 0}  # plans under MIN_STEPS steps, with dropout (above 8 sequences) and without
    for train_tokens in (100_000, 300_000, 1_000_000, 30_000_000):
        for gflops in range(20, 400, 7):
            s, _ = choose(train_tokens, flops_per_s=gflops * GFLOPS)
            batch, block = s["batch_size"], s["block_size"]
            flops = budget.model_flops_per_token(s["n_layer"], s["n_embd"], block, 65)
            tokens = min(budget.MAX_EPOCHS * train_tokens, gflops * GFLOPS * 300 / flops)
            steps = tokens / (batch * block)
            if batch > budget.MIN_BATCH_TOKENS // block:  # rounded, not the smallest batch
                if s["dropout"] and batch > 8:
                    assert steps >= budget.MIN_STEPS, (train_tokens, gflops, s)
                if not s["dropout"] or batch > 8:
                    under[bool(s["dropout"])] += steps < budget.MIN_STEPS
                assert steps >= budget.MIN_STEPS * (batch - 4) / batch  # at most half a multiple of 8 away
    assert under[False] > 0 and under[True] == 0


def test_a_text_read_often_enough_for_dropout_that_wants_under_8_sequences_gets_8_not_the_smallest_batch():
    """The Cyrillic text (97,767 training tokens) at 5 minutes at the first guess's rate: 4 x 128 at block 256, about
    6.6 sequences a step wanted. Rounded down to the smallest batch, 4, on a 2-core Zen 3 in fp32: 2.06 bits per
    character in two runs; with 8, 1.99 to 2.02 in three (docs/own_text.md)."""
    seconds = budget.USABLE * (1 - budget.EVAL_SHARE) * 300
    settings, _ = budget.choose_run(97_767, 10_863, 165, budget.FIRST_GUESS_FLOPS, seconds)
    assert (settings["n_layer"], settings["n_embd"], settings["block_size"]) == (4, 128, 256)
    assert settings["dropout"] > 0 and settings["batch_size"] == 8


def test_a_batch_given_counts_in_the_most_steps_a_text_can_give():
    cfg = dataclasses.replace(train.TrainConfig(max_time="10h"), batch_size=4)
    chosen, _ = budget.fill_auto(cfg, (20_000, 2_000, 65), lambda c: timing(0.01))
    assert chosen.batch_size == 4
    assert chosen.max_iters == budget.most_steps(20_000, 4 * chosen.block_size)  # MAX_EPOCHS passes of batch 4


def test_the_context_fits_a_tiny_val_split():
    settings, _ = budget.choose_run(2_000, 200, 65, 50 * GFLOPS, 300)
    assert settings["block_size"] <= 100


# --- What is auto, and the clock ---------------------------------------------------------------------


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("5m", 300), ("2h", 7200), ("1h30m", 5400), ("1.5h", 5400),
                                           ("300", 300), (" 2m ", 120), ("none", None), ("", None)])
def test_durations(text, seconds):
    assert budget.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["5 minutes", "m5", "1x", "5m5", "0s", "1001h"])
def test_a_bad_duration_is_a_user_error(text):
    with pytest.raises(UserError, match="max_time"):
        budget.parse_duration(text)


def test_max_time_is_five_minutes_where_max_iters_is_auto_and_else_none():
    assert budget.max_time(train.TrainConfig()) == budget.DEFAULT_BUDGET
    preset = train.load_config(train.TrainConfig, [TINY])
    assert budget.max_time(preset) == "none"  # a preset sets everything: a run of its steps
    assert budget.max_time(dataclasses.replace(preset, max_iters=AUTO)) == budget.DEFAULT_BUDGET
    assert budget.max_time(dataclasses.replace(preset, n_layer=AUTO)) == "none"  # sized, for its steps
    assert budget.max_time(dataclasses.replace(preset, max_time="1m")) == "1m"


class FakeClock:
    """The runs' clock (system.process_age), moved only by training steps (step_s each) and evaluations (0.1 s);
    a model the sizing times takes 10 ms a step."""

    def __init__(self, monkeypatch):
        self.now, self.step_s, self.measured = 0.0, 0.01, []
        real_step, real_estimate, real_set_up = train.train_step, train.estimate_loss, train.set_up

        def set_up(*args, **kwargs):
            self.now = 0.0  # a new run: its process has just started
            return real_set_up(*args, **kwargs)

        def measure(cfg, data, procs):
            self.measured.append(cfg)
            self.now += 0.2
            return timing(0.01)

        def train_step(*args, **kwargs):
            self.now += self.step_s
            return real_step(*args, **kwargs)

        def estimate_loss(*args, **kwargs):
            self.now += 0.1
            return real_estimate(*args, **kwargs)

        monkeypatch.setattr(train, "set_up", set_up)
        monkeypatch.setattr(train, "measure", measure)
        monkeypatch.setattr(train, "train_step", train_step)
        monkeypatch.setattr(train, "estimate_loss", estimate_loss)
        monkeypatch.setattr(system, "process_age", lambda: self.now)


@pytest.fixture
def clock(monkeypatch):
    return FakeClock(monkeypatch)


def read_log(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]


def test_a_sizing_that_has_spent_its_share_of_the_budget_times_nothing_more():
    timed = []

    def measure(cfg):
        timed.append(cfg)
        return timing(20.0)  # far off the first guess: on time, it would be timed again, and its successor too

    cfg, sizes = train.TrainConfig(max_time="5m"), (1_000_000, 100_000, 65)
    budget.size_run(cfg, sizes, measure, 290.0)
    assert len(timed) >= 3
    timed.clear()
    budget.size_run(cfg, sizes, measure, 290.0, late=lambda: True)
    assert len(timed) == 1  # one timing, then chosen at the rate it measured


def test_a_busy_machine_whose_timings_are_slow_still_gets_its_run_on_time(data_dir, tmp_path, clock, monkeypatch,
                                                                          capsys):
    def slow(cfg, data, procs):  # each timing 3 s of a 10 s budget: three of them would spend it
        clock.measured.append(cfg)
        clock.now += 3.0
        return timing(0.01)

    monkeypatch.setattr(train, "measure", slow)
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=10s", "--patience=0"]) == 0
    assert len(clock.measured) == 1  # a quarter of the budget gone after the first: no more
    records = read_log(tmp_path)
    assert any("loss" in r for r in records) and records[-1]["iter"] > 0  # it trained
    assert "done: " in capsys.readouterr().out


def test_no_preset_fills_what_is_auto_says_so_and_saves_the_values(data_dir, tmp_path, clock, capsys):
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=4s", "--patience=0"]) == 0
    out = capsys.readouterr().out
    assert "auto: " in out and "n_layer=" in out and "batch_size=" in out and "(sized for 4s on " in out
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert [k for k, v in saved.items() if v == AUTO] == ["muon_weight_decay", "device"]  # said where used
    assert saved["max_time"] == "4s"
    assert saved["optimizer"] == "muon" and saved["pos"] == "rope"  # the rule's recipe
    assert len(clock.measured) >= 1 and [k for k, v in dataclasses.asdict(clock.measured[-1]).items() if v == AUTO] \
        == ["muon_weight_decay", "device"]  # the model timed is a whole run


def test_a_timed_run_ends_on_its_clock_with_its_learning_rate_decayed_and_evaluates_at_each_tenth(
        data_dir, tmp_path, clock):
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=4s", "--patience=0",
                       "--log_interval=1"]) == 0
    records = read_log(tmp_path)
    evals = [r["iter"] for r in records if "val_loss" in r]
    assert len(evals) == budget.EVALS + 1 and evals[0] == 0  # the start, and each tenth of the time
    steps = [r for r in records if "loss" in r]
    assert steps[-1]["lr"] <= 0.2 * max(r["lr"] for r in steps)  # the schedule ended with the time
    assert budget.USABLE * 4 <= clock.now <= budget.USABLE * 4 + 2 * (clock.step_s + 0.1)  # a last evaluation
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")
    assert saved["iter"] == evals[-1] < saved["train_config"]["max_iters"]  # the time ended it, not the steps


@pytest.mark.parametrize("step_s", [0.005, 0.03])
def test_a_timed_run_that_steps_slower_or_faster_than_timed_still_ends_on_time(data_dir, tmp_path, clock, step_s):
    clock.step_s = step_s  # the sizing timed 10 ms
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=3s", "--max_iters=auto",
                       "--patience=0", "--log_interval=1"]) == 0
    steps = [r for r in read_log(tmp_path) if "loss" in r]
    assert budget.USABLE * 3 <= clock.now <= budget.USABLE * 3 + 2 * (step_s + 0.1)
    assert steps[-1]["lr"] <= 0.2 * max(r["lr"] for r in steps)
    assert abs(len(steps) - (budget.USABLE * 3 - budget.EVALS * 0.1) / step_s) <= 2  # as many as fit, the last
    # evaluation after them


def test_the_command_line_overrides_the_rule(data_dir, tmp_path, clock):
    args = [f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=2s", "--n_layer=1", "--batch_size=3",
            "--max_iters=7"]
    assert train.main(args) == 0
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert (saved["n_layer"], saved["batch_size"], saved["max_iters"]) == (1, 3, 7)
    assert all(c.n_layer == 1 and c.batch_size == 3 for c in clock.measured)


def test_a_preset_is_never_sized_and_trains_its_steps(data_dir, tmp_path, clock, capsys):
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}"]) == 0
    assert clock.measured == [] and "auto: " not in capsys.readouterr().out
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")
    assert saved["iter"] == saved["train_config"]["max_iters"] == 20 and saved["train_config"]["max_time"] == AUTO


def test_a_preset_with_max_time_keeps_its_model_and_runs_on_the_clock(data_dir, tmp_path, clock):
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=3s",
                       "--max_iters=auto"]) == 0
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")
    assert (saved["train_config"]["n_layer"], saved["train_config"]["n_embd"]) == (2, 32)  # tiny.toml's
    assert clock.measured == []  # nothing to choose that needs a timing
    assert saved["iter"] > 20 and clock.now >= budget.USABLE * 3


def test_max_iters_with_max_time_ends_the_run_at_whichever_comes_first(data_dir, tmp_path, clock):
    args = [TINY, f"--data_dir={data_dir}", "--max_time=3s", "--patience=0"]
    assert train.main([*args, f"--out_dir={tmp_path / 'a'}", "--max_iters=5"]) == 0
    assert files.load_checkpoint(tmp_path / "a" / "ckpt.pt")["iter"] == 5  # the steps first
    assert train.main([*args, f"--out_dir={tmp_path / 'b'}", "--max_iters=100000"]) == 0
    assert 10 < files.load_checkpoint(tmp_path / "b" / "ckpt.pt")["iter"] < 3 / 0.01  # the time first
    assert clock.now <= budget.USABLE * 3 + 2 * (0.01 + 0.1)


def test_a_timed_run_stopped_and_resumed_goes_on_with_the_clock_it_had(data_dir, tmp_path, clock, stop_at):
    args = [TINY, f"--data_dir={data_dir}", "--max_time=3s", "--max_iters=auto", "--patience=0", "--log_interval=1"]
    assert train.main([*args, f"--out_dir={tmp_path / 'whole'}"]) == 0
    stop_at(20)
    assert train.main([*args, f"--out_dir={tmp_path / 'split'}"]) == 128 + signal.SIGTERM
    stopped = files.load_checkpoint(tmp_path / "split" / "ckpt.pt")
    assert stopped["iter"] == 20 and 0 < stopped["spent"] < stopped["seconds"]
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'split'}", "--init_from=resume"]) == 0
    # (the preset again: the run's own settings go over it)
    assert clock.measured == []
    whole, split = (files.load_checkpoint(tmp_path / run / "ckpt.pt") for run in ("whole", "split"))
    assert abs(split["iter"] - whole["iter"]) <= 2 and split["spent"] >= split["seconds"]
    lrs = [r["lr"] for r in read_log(tmp_path / "split") if "loss" in r]
    assert [r["iter"] for r in read_log(tmp_path / "split") if "loss" in r] == list(range(1, split["iter"] + 1))
    assert lrs[-1] <= 0.2 * max(lrs)


@pytest.mark.parametrize("max_time", ["1m", "none"])
def test_a_resumed_run_keeps_the_max_time_it_started_with(data_dir, tmp_path, clock, stop_at, capsys, max_time):
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=3s", "--max_iters=auto"]
    stop_at(5)
    assert train.main(args) == 128 + signal.SIGTERM
    capsys.readouterr()
    assert train.main([*args, "--init_from=resume", f"--max_time={max_time}"]) == 2
    assert f"--max_time={max_time} on a resumed run" in capsys.readouterr().err


def test_a_dry_run_says_what_it_filled_and_how_to_train_it_and_writes_nothing(data_dir, tmp_path, clock, capsys):
    out_dir = tmp_path / "out"
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--max_time=4s", "--dry_run"]) == 0
    said = capsys.readouterr().out
    filled = said.split("auto: ")[1].split(" (sized for")[0]
    assert {item.split("=")[0] for item in filled.split(", ")} >= {*budget.SIZED, "max_iters", "eval_iters"}
    assert "to train it: python train.py " in said and said.rstrip().endswith("nothing trained or written")
    assert not out_dir.exists()


def test_the_same_command_chooses_the_same_run_however_the_timings_wander(data_dir, tmp_path, monkeypatch, capsys):
    timings = []

    def noisy(fn, min_seconds, min_calls=3, warmup=2):  # each timing a few percent off the one before
        timings.append(1)
        return 0.01 * (1 + 0.03 * (len(timings) % 3))

    monkeypatch.setattr(budget, "time_per_call", noisy)
    monkeypatch.setattr(system, "process_age", lambda: 1.0)
    chosen = []
    for _ in range(5):
        assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=60s", "--dry_run"]) == 0
        chosen.append(capsys.readouterr().out)
    assert len(timings) >= 10 and all(said == chosen[0] for said in chosen)  # the choice, word for word


def test_a_timed_run_writes_nothing_outside_its_out_dir(data_dir, tmp_path, monkeypatch, clock):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    clock.step_s = 0.04  # a quarter of the steps: what is written does not hang on how many
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_time=3s"]) == 0
    assert list(home.iterdir()) == []  # no cache, no state: the next run chooses by what it times itself


def test_the_repeat_command_trains_the_same_model_for_the_steps_the_timed_run_took(data_dir, tmp_path, clock, capsys):
    clock.step_s = 0.04  # 4x slower than the sizing timed: the run takes fewer steps than it was sized for
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'timed'}", "--max_time=4s"]) == 0
    command = (tmp_path / "timed" / "repeat.txt").read_text(encoding="utf-8").strip()
    assert command in capsys.readouterr().out
    argv = shlex.split(command)
    assert argv[:2] == ["python", "train.py"] and "--max_time=none" in argv
    clock.measured.clear()
    assert train.main(argv[2:]) == 0
    assert clock.measured == []  # nothing timed
    timed, again = (files.load_checkpoint(tmp_path / run / "ckpt.pt") for run in ("timed", "timed_repeat"))
    assert again["iter"] == again["train_config"]["max_iters"] == timed["iter"]
    same = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "dropout", "optimizer", "pos", "eval_iters")
    assert all(again["train_config"][k] == timed["train_config"][k] for k in same)


def test_a_run_that_replaces_a_timed_one_leaves_no_repeat_command_of_it(data_dir, tmp_path, clock):
    clock.step_s = 0.04  # a quarter of the steps
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_time=4s"]) == 0
    assert (tmp_path / "repeat.txt").exists()
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--overwrite=true"]) == 0
    assert not (tmp_path / "repeat.txt").exists()  # it trained another model: its command would mislead


def test_the_repeat_command_of_a_timed_fine_tune_starts_from_the_same_weights(data_dir, tmp_path, clock):
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'base'}", "--max_iters=5"]) == 0
    weights = str(tmp_path / "base" / "best.pt")
    clock.step_s = 0.04
    tuned = [f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'tuned'}", f"--init_from={weights}", "--max_time=3s"]
    assert train.main(tuned) == 0
    argv = shlex.split((tmp_path / "tuned" / "repeat.txt").read_text(encoding="utf-8"))
    assert f"--init_from={weights}" in argv
    assert train.main(argv[2:]) == 0
    first = [next(json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()
                  if "val_loss" in line) for run in ("tuned", "tuned_repeat")]
    assert first[0]["iter"] == first[1]["iter"] == 0
    assert first[0]["val_loss"] == first[1]["val_loss"]  # the same weights, scored on the same batches


def test_a_sized_fine_tune_keeps_its_context_within_the_positions_the_weights_learned(data_dir, tmp_path, clock):
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'base'}", "--max_iters=5"]) == 0
    base = files.load_checkpoint(tmp_path / "base" / "best.pt")["model_config"]
    assert (base["pos"], base["block_size"]) == ("learned", 16)  # shorter than any context the sizing chooses
    clock.step_s = 0.04
    args = [f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'tuned'}", f"--init_from={tmp_path / 'base' / 'best.pt'}"]
    assert train.main([*args, "--max_time=3s"]) == 0
    assert files.load_checkpoint(tmp_path / "tuned" / "ckpt.pt")["train_config"]["block_size"] == 16
    rope = dataclasses.replace(train.TrainConfig(max_time="1m"), pos="rope")  # no positions learned: no limit
    assert budget.fill_auto(rope, (1_000_000, 100_000, 65), lambda c: (0.05, 0.02))[0].block_size > 16


def test_a_resumed_fine_tune_keeps_the_weights_it_began_from_in_its_checkpoint_and_repeat_command(
        data_dir, tmp_path, clock, stop_at):
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'base'}", "--max_iters=5"]) == 0
    weights, out = str(tmp_path / "base" / "best.pt"), tmp_path / "tuned"
    clock.step_s = 0.04
    stop_at(20)
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={out}", f"--init_from={weights}", "--max_time=3s"]) == 143
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={out}", "--init_from=resume"]) == 0
    assert files.load_checkpoint(out / "ckpt.pt")["train_config"]["init_from"] == weights
    assert f"--init_from={weights}" in shlex.split((out / "repeat.txt").read_text(encoding="utf-8"))


def test_the_repeat_command_of_a_resumed_timed_run_trains_it_from_the_start():
    cfg = dataclasses.replace(train.TrainConfig(), n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=16,
                              max_time="30s", out_dir="out/x", init_from="resume")
    assert not any(arg.startswith("--init_from") for arg in shlex.split(budget.repeat_command(cfg, 100)))


def test_the_repeat_command_of_a_run_under_torchrun_starts_as_many_processes():
    cfg = dataclasses.replace(train.TrainConfig(), n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=16,
                              max_time="30s", out_dir="out/x")
    alone, together = (shlex.split(budget.repeat_command(cfg, 100, world)) for world in (1, 4))
    assert alone[:2] == ["python", "train.py"] and "--max_iters=100" in alone
    assert together[:4] == ["torchrun", "--standalone", "--nproc_per_node=4", "train.py"]
    assert together[4:] == alone[2:]  # the same settings: the same tokens a step on as many processes


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


