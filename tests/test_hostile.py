"""The newer features under hostile use: each case ends in one `error:` line and exit 2, or succeeds
where success is right, and nothing already written is lost."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

import prepare
import sample
import train
from model import GPT, GPTConfig
from tinygpt import export, files, gpt2, plot, score, textfiles
from tinygpt.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")


def one_error_line(capsys, *fragments):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def trained_once(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "out"
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=4", "--eval_interval=2"]) == 0
    return out


@pytest.fixture
def finished_run(trained_once, tmp_path):
    """A finished run of its own for each test (tests change its files): a copy of the one trained once."""
    return Path(shutil.copytree(trained_once, tmp_path / "out"))


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


def test_a_text_of_fifty_characters_trains_with_no_preset(tmp_path, capsys):
    import prepare

    (tmp_path / "tiny.txt").write_text("To be, or not to be, that is the question: whether\n", encoding="utf-8")
    assert prepare.main(["--input", str(tmp_path / "tiny.txt"), "--out_dir", str(tmp_path / "data")]) == 0
    # Steps, not a budget, which a busy machine's start-up could spend: the shape is still chosen for the text.
    assert train.main([f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}", "--max_iters=20"]) == 0
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


# A path no file can be at: a name too long for any file system, or a symbolic link that leads to itself.
LONG = "a" * 100_000
PATHS = [  # (script, its arguments with the path bad in them (run: a trained out_dir), the option the message names)
    ("prepare", lambda run, data, bad: ["--input", bad], "--input"),
    ("prepare", lambda run, data, bad: ["--input", text_of(data), "--out_dir", bad], "--out_dir"),
    ("sample", lambda run, data, bad: [f"--out_dir={bad}"], "--out_dir"),
    ("sample", lambda run, data, bad: [f"--out_dir={run}", f"--checkpoint={bad}"], "--checkpoint"),
    ("sample", lambda run, data, bad: [f"--init_from={bad}"], "--init_from"),
    ("sample", lambda run, data, bad: [f"--out_dir={run}", f"--start=FILE:{bad}"], "--start"),
    ("sample", lambda run, data, bad: [f"--out_dir={run}", f"--prompts={bad}"], "--prompts"),
    ("score", lambda run, data, bad: [f"--out_dir={run}", f"--input={bad}"], "--input"),
    ("score", lambda run, data, bad: [f"--out_dir={bad}", f"--input={text_of(data)}"], "--out_dir"),
    ("export", lambda run, data, bad: [f"--out_dir={bad}", f"--to={run}_hf"], "--out_dir"),
    ("export", lambda run, data, bad: [f"--out_dir={run}", f"--to={bad}"], "--to"),
    ("train", lambda run, data, bad: [TINY, f"--data_dir={data}", f"--init_from={bad}", f"--out_dir={run}_ft"],
     "--init_from"),
    ("plot", lambda run, data, bad: ["losses", bad, f"--out={run}.png"], "--runs"),
    ("plot", lambda run, data, bad: ["losses", str(run), f"--out={bad}"], "--out"),
]
MAINS = {"prepare": prepare.main, "sample": sample.main, "score": score.main, "export": export.main,
         "train": train.main, "plot": plot.main}


def text_of(data_dir):
    return str(Path(data_dir).parent / "input.txt")  # the text conftest's data_dir was prepared from


@pytest.mark.parametrize("kind, says", [("long", "is too long a name"), ("loop", "is a loop of symbolic links")])
@pytest.mark.parametrize("script, args, option", PATHS, ids=[f"{script}{option}" for script, _, option in PATHS])
def test_a_path_no_file_can_be_at_is_one_error_line_naming_its_option(finished_run, data_dir, tmp_path, capsys,
                                                                      kind, says, script, args, option):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    bad = str(tmp_path / (LONG if kind == "long" else "loop"))
    capsys.readouterr()
    assert MAINS[script](args(finished_run, data_dir, bad)) == 2
    err = capsys.readouterr().err
    one_error_line_in(err, f"error: {option}=", says)
    assert len(err) < 500  # the name cut short


def one_error_line_in(err, *fragments):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err[:1000]
    for fragment in fragments:
        assert fragment in lines[0], lines[0][:1000]


def test_an_export_to_a_symbolic_link_loop_is_called_a_loop_not_another_export(finished_run, tmp_path, capsys):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    capsys.readouterr()
    assert export.main([f"--out_dir={finished_run}", f"--to={tmp_path / 'loop'}"]) == 2
    one_error_line(capsys, f"--to={tmp_path / 'loop'} is a loop of symbolic links; pick another --to")
    assert os.readlink(tmp_path / "loop") == str(tmp_path / "loop")  # left as it was


def test_check_path_says_why_a_data_dir_or_out_dir_cannot_be_used(tmp_path):
    """What train.py's --data_dir and --out_dir are checked with, as prepare's, sample's and export's are."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "new\nline").symlink_to(tmp_path / "new\nline")
    (tmp_path / "notes.txt").write_text("a file", encoding="utf-8")
    for path, says in [(str(tmp_path / LONG), "is too long a name"), (str(tmp_path / "loop"), "is a loop"),
                       (str(tmp_path / "new\nline"), "is a loop"),  # its newline shown as \n: still one line
                       (str(tmp_path / "notes.txt" / "run"), f"is inside {tmp_path / 'notes.txt'}, which is a file"),
                       (str(tmp_path / "notes.txt"), "is a file, not a directory")]:
        with pytest.raises(train.UserError, match="^--data_dir=.* " + says) as e:
            files.check_path(path, "--data_dir", directory=True)
        message = str(e.value)
        assert len(message) < 400 and "\n" not in message and message.endswith("; pick another --data_dir")
    files.check_path(str(tmp_path / "not" / "there" / "yet"), "--out_dir", directory=True)  # made when it is used


@pytest.mark.parametrize("preset", [LONG + ".toml", "loop"], ids=["long", "loop"])
def test_a_preset_no_file_can_be_at_is_one_error_line(tmp_path, capsys, preset):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert train.main([str(tmp_path / preset)]) == 2
    err = capsys.readouterr().err
    one_error_line_in(err, "error: config file", "cannot be read")
    assert len(err) < 500


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_checkpoint_whose_weights_are_not_finite_is_one_error_line_in_sample_and_score(finished_run, data_dir,
                                                                                          tmp_path, capsys, value):
    ckpt = torch.load(finished_run / "ckpt.pt", weights_only=True)
    ckpt["model"]["ln_f.weight"][0] = value  # one weight is enough
    (tmp_path / "run").mkdir()
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    for temperature in ("0.8", "0"):  # sampled, or the likeliest taken
        capsys.readouterr()
        assert sample.main([f"--out_dir={tmp_path / 'run'}", f"--temperature={temperature}"]) == 2
        one_error_line(capsys, "the model's scores for the next token are NaN or infinite", "another checkpoint")
    text = text_of(data_dir)
    assert score.main([f"--out_dir={tmp_path / 'run'}", f"--input={text}"]) == 2
    one_error_line(capsys, f"{tmp_path / 'run' / 'ckpt.pt'} gives a loss of nan on --input {text}", "retrain")


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
        return 0.01, 0.003

    cfg = train.TrainConfig(n_layer=1, n_embd=100, max_time="5m")
    chosen, said, _ = budget.size_run(cfg, (100_000, 10_000, 65), measure, 300)
    assert probed and all((c.n_layer, c.n_embd, c.n_embd % c.n_head) == (1, 100, 0) for c in probed)
    assert "n_layer" not in chosen and "n_embd" not in chosen and 100 % chosen["n_head"] == 0
    assert (chosen["optimizer"], chosen["pos"]) == ("muon", "rope") and "sized for 5m" in said


def test_a_budget_that_the_sizing_outlasts_is_refused_before_anything_is_written(data_dir, finished_run, capsys,
                                                                                 monkeypatch):
    from tinygpt import system

    clock = [0.0]

    def slow(cfg, data, procs):  # timing steps as slow as a busy machine or a 100k-token vocabulary makes them
        clock[0] += 20.0
        return 0.5, 0.15

    monkeypatch.setattr(train, "measure", slow)
    monkeypatch.setattr(system, "process_age", lambda: clock[0])
    before = contents(finished_run)
    capsys.readouterr()
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={finished_run}", "--overwrite=true",
                       "--max_time=15s"]) == 2
    one_error_line(capsys, "max_time 15s is spent before the run starts")
    assert contents(finished_run) == before


def test_a_timing_far_off_the_rate_the_model_was_chosen_for_is_taken_again_before_the_choice_moves():
    """One slow timing (a busy second) moves nothing; two far off choose again, at the faster of them."""
    from tinygpt import budget

    probed, slow_once = [], iter([0.6])

    def once_slow(cfg):  # 30 ms a step, about the first guess's rate for the model it chose, but once 20x slower
        probed.append(cfg)
        return next(slow_once, 0.03), 0.01

    sized, _, _ = budget.size_run(train.TrainConfig(max_time="1m"), (1_000_000, 100_000, 65), once_slow, 60)
    assert len(probed) == 2 and probed[0] == probed[1]  # timed again: it stands
    assert (sized["n_layer"], sized["n_embd"]) == (probed[0].n_layer, probed[0].n_embd)
    faster, probed = lambda cfg: probed.append(cfg) or (1e-5, 3e-6), []  # far faster each time: a GPU
    sized, _, _ = budget.size_run(train.TrainConfig(max_time="1m"), (1_000_000, 100_000, 65), faster, 60)
    assert probed[0] == probed[1] != probed[-1] and sized["n_embd"] > probed[0].n_embd  # chosen again, larger


def test_a_block_longer_than_the_text_is_refused_before_any_timing(data_dir, tmp_path, capsys, monkeypatch):
    from tinygpt import budget

    monkeypatch.setattr(budget, "time_per_call", lambda *a, **k: pytest.fail("timed a block the text cannot fill"))
    assert train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--block_size=100000"]) == 2
    one_error_line(capsys, "block_size")


def test_prepare_score_and_sample_read_crlf_cr_and_a_bom_as_the_same_text(finished_run, tmp_path, capsys,
                                                                          monkeypatch):
    text = "the cat sat on the mat.\na dog ran in the fog!\nto be or not to be?\n" * 40
    variants = {"lf": text.encode(), "crlf": b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode(),
                "cr": text.replace("\n", "\r").encode()}
    monkeypatch.setattr(textfiles, "CHUNK_BYTES", 7)  # a \r at the end of one read, its \n at the start of the next
    prepared, scored, sampled = {}, {}, {}
    for name, data in variants.items():
        (tmp_path / f"{name}.txt").write_bytes(data)
        capsys.readouterr()
        assert prepare.main(["--input", str(tmp_path / f"{name}.txt"), "--out_dir", str(tmp_path / name)]) == 0
        said = capsys.readouterr().out
        assert said.count("line endings \\r\\n and \\r read as \\n") == (name != "lf"), said  # said once
        prepared[name] = [(tmp_path / name / f).read_bytes() for f in ("train.bin", "val.bin")]
        prepared[name].append(json.loads((tmp_path / name / "meta.json").read_text(encoding="utf-8"))["vocab"])
        assert score.main([f"--out_dir={finished_run}", f"--input={tmp_path / f'{name}.txt'}"]) == 0
        scored[name] = capsys.readouterr().out.split(": ", 1)[1]  # past the file's name
        assert sample.main([f"--out_dir={finished_run}", f"--start=FILE:{tmp_path / f'{name}.txt'}",
                            "--max_new_tokens=5", "--temperature=0"]) == 0
        sampled[name] = capsys.readouterr().out
    assert "\r" not in prepared["crlf"][2] and "\ufeff" not in prepared["crlf"][2]
    assert prepared["crlf"] == prepared["cr"] == prepared["lf"]
    assert scored["crlf"] == scored["cr"] == scored["lf"] and scored["lf"].startswith(f"{len(text):,} characters")
    assert sampled["crlf"] == sampled["cr"] == sampled["lf"] and sampled["lf"].startswith(text)


def test_a_prompts_file_is_split_at_its_newlines_only(finished_run, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("the cat\x0csat\nthe dog\u2028ran\n", encoding="utf-8")  # a form feed, U+2028
    assert sample.main([f"--out_dir={finished_run}", f"--prompts={tmp_path / 'p.txt'}", "--max_new_tokens=2",
                        "--unknown=skip"]) == 0
    out = capsys.readouterr().out
    assert out.count(sample.SEPARATOR) == 2 and "the catsat" in out and "the dogran" in out  # two prompts, not four


def test_prepare_refuses_to_swap_the_directory_it_runs_in(tmp_path, capsys, monkeypatch):
    (tmp_path / "notes.txt").write_text("the cat sat on the mat.\n" * 50, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    for out_dir in (".", str(tmp_path.parent)):
        assert prepare.main(["--input", "notes.txt", "--out_dir", out_dir]) == 2
        one_error_line(capsys, f"{tmp_path if out_dir == '.' else tmp_path.parent} holds the directory this runs in")
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"] and Path.cwd() == tmp_path  # nothing swapped, nothing added


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


ENCODINGS = [("utf-16", "UTF-16"), ("utf-32", "UTF-32"), ("utf-16-le", "UTF-16LE"), ("utf-16-be", "UTF-16BE")]


@pytest.mark.parametrize("codec, name", ENCODINGS, ids=[codec for codec, _ in ENCODINGS])
def test_a_utf16_or_utf32_text_is_named_with_the_iconv_that_converts_it(finished_run, tmp_path, capsys, codec, name):
    path = tmp_path / "notes.txt"
    path.write_bytes("the cat sat on the mat.\n".encode(codec) * 50)  # with a byte order mark, or (LE, BE) without
    convert = f"convert it: iconv -f {name} -t UTF-8 {path} > {tmp_path / 'notes-utf8.txt'}"
    for main, args, what in [(prepare.main, ["--input", str(path), "--out_dir", str(tmp_path / "d")], "input file"),
                             (score.main, [f"--out_dir={finished_run}", f"--input={path}"], "--input file"),
                             (sample.main, [f"--out_dir={finished_run}", f"--prompts={path}"], "--prompts file")]:
        capsys.readouterr()
        assert main(args) == 2
        one_error_line(capsys, f"{what} {path} is {name} text, not UTF-8; {convert}")
    assert not (tmp_path / "d").exists()
