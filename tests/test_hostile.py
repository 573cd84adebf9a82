"""The newer features under hostile use: each case ends in one `error:` line and exit 2, or succeeds
where success is right, and nothing already written is lost."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import sample
import train
from model import GPT, GPTConfig
from tinygpt import files, gpt2, weights
from tinygpt.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")


def one_error_line(capsys, *fragments):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def finished_run(data_dir, tmp_path):
    out = tmp_path / "out"
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=4", "--eval_interval=2"]) == 0
    return out


def contents(out):
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name != "lock"}


# --- Data lost ------------------------------------------------------------------------------------------


def test_a_budget_too_short_refuses_before_an_overwrite_touches_the_old_run(data_dir, finished_run, capsys):
    before = contents(finished_run)
    capsys.readouterr()
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={finished_run}", "--overwrite=true",
                       "--max_time=0.001s", "--max_iters=auto"]) == 2
    one_error_line(capsys, "max_time 0.001s is spent before the run starts")
    assert contents(finished_run) == before  # log.jsonl and ckpt.pt as they were


def test_a_stop_during_start_up_is_one_line_and_loses_nothing(data_dir, finished_run, capsys, monkeypatch):
    def stopped(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs before this ends
        raise AssertionError("SIGTERM did not stop the start-up")

    monkeypatch.setattr(train, "measure", stopped)  # the sizing's timing, where start-up spends its seconds
    before = contents(finished_run)
    capsys.readouterr()
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={finished_run}", "--overwrite=true",
                       "--max_time=1m"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert err.strip() == "stopped by SIGTERM while starting, before its first step", err
    assert contents(finished_run) == before
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


# --- Tracebacks ------------------------------------------------------------------------------------------


def test_a_text_of_fifty_characters_trains_with_no_preset(tmp_path, capsys, monkeypatch):
    import prepare
    from tinygpt import system

    (tmp_path / "tiny.txt").write_text("To be, or not to be, that is the question: whether\n", encoding="utf-8")
    assert prepare.main(["--input", str(tmp_path / "tiny.txt"), "--out_dir", str(tmp_path / "data")]) == 0
    started = time.monotonic()
    monkeypatch.setattr(system, "process_age", lambda: time.monotonic() - started)  # as if a fresh process
    assert train.main([f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}", "--max_time=10s"]) == 0
    assert "auto: " in capsys.readouterr().out


@pytest.mark.parametrize("max_time", ["9" * 400, "9" * 400 + "h", "1e400"])
def test_a_budget_no_run_could_have_is_one_line(data_dir, tmp_path, capsys, max_time):
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", f"--max_time={max_time}"]) == 2
    one_error_line(capsys, "max_time")


def test_a_model_of_one_position_samples(tmp_path, capsys):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=3, block_size=1, n_layer=1, n_head=1, n_embd=8)
    state = {"format": 1, "model": GPT(config).state_dict(), "model_config": config.__dict__,
             "meta": {"tokenizer": "char", **CharTokenizer("ab\n").meta(), "vocab_size": 3}}
    (tmp_path / "out").mkdir()
    torch.save(state, tmp_path / "out" / "ckpt.pt")
    assert sample.main([f"--out_dir={tmp_path / 'out'}", "--start=ab", "--max_new_tokens=20"]) == 0
    text = capsys.readouterr().out.split(sample.SEPARATOR)[0]
    assert text.startswith("ab") and len(text) >= 22  # the prompt and 20 new characters (and a newline after)


@pytest.mark.parametrize("config", [[1, 2], None, {"n_layer": "2"}, {"n_head": 0}, {"n_embd": 32.0},
                                    {"n_layer": 10**9}, {"n_embd": 30, "n_head": 4}])
def test_a_gpt2_directory_whose_config_is_wrong_is_one_line(tmp_path, capsys, config):
    good = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64, "vocab_size": 50257}
    (tmp_path / "config.json").write_text(json.dumps({**good, **config} if isinstance(config, dict) else config),
                                          encoding="utf-8")
    with pytest.raises(train.UserError, match="config.json"):
        gpt2.gpt_config(gpt2.read_config(tmp_path), str(tmp_path))


# --- Silent surprises ----------------------------------------------------------------------------------


def test_a_resumed_run_keeps_its_own_settings_over_its_presets_and_the_command_line_changes_them():
    own = {"max_iters": 57, "max_time": "3s", "warmup_iters": 5}  # (an older run's warmup_iters: not read)
    resumed = train.load_config(train.TrainConfig, [TINY], base=own)  # tiny.toml says max_iters = 20
    assert (resumed.max_iters, resumed.max_time, resumed.warmup) == (57, "3s", 0.25)  # tiny's warmup: not the run's
    given = train.load_config(train.TrainConfig, [TINY, "--max_iters=80"], base=own)
    assert given.max_iters == 80  # what the command line says, it gets


@pytest.mark.parametrize("max_time, says", [("1m", "on a resumed run"), ("banana", "must be a duration")])
def test_max_time_on_a_resume_is_refused_with_one_line(data_dir, finished_run, capsys, max_time, says):
    before = contents(finished_run)
    capsys.readouterr()
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={finished_run}", "--init_from=resume",
                       f"--max_time={max_time}"]) == 2
    one_error_line(capsys, says)
    assert contents(finished_run) == before


def test_max_time_as_a_number_in_a_preset_is_told_how_to_write_it(tmp_path):
    (tmp_path / "p.toml").write_text("max_time = 90\n", encoding="utf-8")
    with pytest.raises(train.UserError, match='put it in quotes, max_time = "90"'):
        train.load_config(train.TrainConfig, [str(tmp_path / "p.toml")])


def test_no_preset_with_everything_the_sizing_chooses_given_times_nothing(data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "measure", lambda *a: pytest.fail("timed a run with nothing to choose"))
    given = ["--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=8", "--batch_size=4", "--dropout=0",
             "--optimizer=adamw", "--pos=learned", "--max_iters=6", "--eval_iters=2"]
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", *given]) == 0
    assert "auto: " not in capsys.readouterr().out
    config = files.load_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert (config["optimizer"], config["pos"], config["max_time"]) == ("adamw", "learned", "auto")  # untimed


def test_sizing_probes_and_keeps_what_was_given_and_says_what_it_chose():
    from tinygpt import budget

    probed = []

    def measure(cfg):
        probed.append(cfg)
        return 0.01, 0.001, 0.1

    cfg = train.TrainConfig(n_layer=1, n_embd=100, max_time="5m")
    chosen, said, _ = budget.size_run(cfg, (100_000, 10_000, 65), measure, 300)
    assert probed and all((c.n_layer, c.n_embd, c.n_embd % c.n_head) == (1, 100, 0) for c in probed)
    assert "n_layer" not in chosen and "n_embd" not in chosen and 100 % chosen["n_head"] == 0
    assert (chosen["optimizer"], chosen["pos"]) == ("muon", "rope") and "sized for 5m" in said


def test_a_budget_too_short_to_size_for_its_data_is_refused_after_one_probe():
    from tinygpt import budget

    probed = []

    def slow(cfg):  # timing steps as slow as a 100k-token vocabulary makes them
        probed.append(cfg)
        return 0.5, 2.0, 0.3

    with pytest.raises(train.UserError, match="too short for this data here"):
        budget.size_run(train.TrainConfig(max_time="15s"), (100_000, 10_000, 100_000), slow, 0.6)
    assert len(probed) == 1


def test_a_slow_first_timing_ends_the_sizing_with_its_choice_rather_than_a_refusal():
    """A busy machine: timing the first model took more than the sizing's share of the budget. It times
    nothing more and goes with what that rate chooses; the plan then fits the steps to what is left."""
    from tinygpt import budget

    probed = []

    def slow_to_time(cfg):  # steps that a quiet moment would show fast, timed slowly
        probed.append(cfg)
        return 0.0001, 0.0001, 0.5  # more than the sizing's share of 3 s

    sized, _, _ = budget.size_run(train.TrainConfig(max_time="3s"), (1_000_000, 100_000, 65), slow_to_time, 3)
    assert len(probed) == 1 and (sized["n_layer"], sized["n_embd"]) != (probed[0].n_layer, probed[0].n_embd)


def test_a_block_longer_than_the_text_is_refused_before_any_timing(data_dir, tmp_path, capsys, monkeypatch):
    from tinygpt import budget

    monkeypatch.setattr(budget, "time_per_call", lambda *a, **k: pytest.fail("timed a block the text cannot fill"))
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--block_size=100000"]) == 2
    one_error_line(capsys, "block_size")


# --- Messages that point the wrong way ----------------------------------------------------------------


def test_a_checkpoint_given_by_its_path_is_read_there(finished_run, capsys):
    assert sample.main([f"--out_dir={finished_run}", f"--checkpoint={finished_run / 'ckpt.pt'}",
                        "--max_new_tokens=3"]) == 0


@pytest.mark.parametrize("content", [b"hello, world\n", b"\x89PNG\r\n\x1a\n" + bytes(100), b'{"a": 1}'])
def test_a_file_that_is_no_checkpoint_is_called_so_not_a_risk(finished_run, capsys, content):
    (finished_run / "best.pt").write_bytes(content)
    assert sample.main([f"--out_dir={finished_run}", "--max_new_tokens=3"]) == 2
    one_error_line(capsys, "is not a checkpoint", "ckpt.pt")


def test_a_truncated_best_pt_points_at_ckpt_pt(finished_run, capsys):
    data = (finished_run / "best.pt").read_bytes()
    (finished_run / "best.pt").write_bytes(data[: len(data) // 2])
    assert sample.main([f"--out_dir={finished_run}", "--max_new_tokens=3"]) == 2
    one_error_line(capsys, "truncated or damaged", f"pass --checkpoint=ckpt.pt if {finished_run / 'ckpt.pt'} is there")


def test_start_file_with_no_path_says_so(finished_run, capsys):
    assert sample.main([f"--out_dir={finished_run}", "--start=FILE:"]) == 2
    one_error_line(capsys, "names no file")


@pytest.mark.parametrize("switch", ["--mixer=average", "--score=additive"])
def test_no_preset_with_attention_rope_cannot_turn_keeps_learned_positions(data_dir, tmp_path, monkeypatch, switch):
    from tinygpt import system

    started = time.monotonic()
    monkeypatch.setattr(system, "process_age", lambda: time.monotonic() - started)
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=5", "--n_embd=32",
                       switch]) == 0  # sized
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["model_config"]["pos"] == "learned"


def test_fine_tuning_refuses_a_shape_the_weights_do_not_have_even_the_default_one(data_dir, finished_run, tmp_path,
                                                                                 capsys):
    capsys.readouterr()
    assert train.main([TINY, f"--data_dir={data_dir}", f"--init_from={finished_run / 'ckpt.pt'}",
                       f"--out_dir={tmp_path / 'ft'}", "--n_layer=6", "--n_embd=384"]) == 2  # 6 is the default
    one_error_line(capsys, "--n_layer=6", "contradicts")


def test_a_resume_on_another_data_set_says_the_data_set_changed(finished_run, tmp_path, capsys):
    import prepare

    (tmp_path / "other.txt").write_text("xyz " * 300, encoding="utf-8")
    assert prepare.main(["--input", str(tmp_path / "other.txt"), "--out_dir", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    assert train.main([TINY, f"--data_dir={tmp_path / 'other'}", f"--out_dir={finished_run}",
                       "--init_from=resume"]) == 2
    one_error_line(capsys, "the data set changed")


def test_plotting_a_log_whose_evaluation_lacks_train_loss_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from tinygpt import plot

    (tmp_path / "log.jsonl").write_text('{"iter": 0, "val_loss": 2.0}\n', encoding="utf-8")
    assert plot.main(["losses", str(tmp_path), f"--out={tmp_path / 'l.png'}"]) == 2
    one_error_line(capsys, "line 1", "train_loss")
