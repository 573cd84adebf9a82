"""config: presets over defaults, then the command line; every mistake named."""

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

import train
from config import AUTO, UserError, load_config, option
from tinygpt.system import cli


@dataclass
class Settings:
    layers: int = option(1, "how many")
    rate: float = option(2.0, "how fast")
    name: str = option("x", "what to call it")
    flag: bool = option(False, "whether to")
    limit: int | None = option(None, "at most this many, or none")
    inputs: list[str] = option(["default.txt"], "files")


def toml(path, text):
    Path(path).write_text(text, encoding="utf-8")
    return str(path)


def test_defaults_when_nothing_is_given():
    assert load_config(Settings, []) == Settings()


def test_presets_overlay_the_defaults_in_order_then_the_command_line(tmp_path):
    first = toml(tmp_path / "first.toml", 'layers = 10\nrate = 3.5\ninputs = ["a.txt"]\n')
    second = toml(tmp_path / "second.toml", 'layers = 20\nname = "y"\n')
    cfg = load_config(Settings, [first, second, "--layers=30"])
    assert (cfg.layers, cfg.rate, cfg.name, cfg.flag, cfg.inputs) == (30, 3.5, "y", False, ["a.txt"])
    assert load_config(Settings, [second, first]).layers == 10  # the later preset wins
    assert load_config(Settings, [first, "--rate=1e-3"]).rate == pytest.approx(1e-3)


def test_the_command_line_overrides_a_preset_named_after_it(tmp_path):
    first = toml(tmp_path / "first.toml", 'layers = 10\nrate = 3.5\ninputs = ["a.txt"]\n')
    cfg = load_config(Settings, ["--layers=30", "--inputs=b.txt", first, "--inputs", "c.txt"])
    assert (cfg.layers, cfg.rate, cfg.inputs) == (30, 3.5, ["b.txt", "c.txt"])


@dataclass
class Chosen:
    width: int = option(AUTO, "chosen by the script unless given", low=1)
    kind: str = option(AUTO, "likewise, one of a few", choices=("a", "b"))
    depth: int = option(2, "a plain number")


def test_auto_is_a_value_of_a_setting_whose_default_it_is_and_of_no_other(tmp_path):
    assert load_config(Chosen, []) == Chosen(AUTO, AUTO, 2)
    assert load_config(Chosen, ["--width=auto", "--kind=b"]) == Chosen(AUTO, "b", 2)
    assert load_config(Chosen, [toml(tmp_path / "p.toml", 'width = 8\nkind = "auto"\n')]) == Chosen(8, AUTO, 2)
    with pytest.raises(UserError, match="depth must be int"):
        load_config(Chosen, ["--depth=auto"])
    with pytest.raises(UserError, match="width must be at least 1"):
        load_config(Chosen, ["--width=0"])


def test_key_space_value_works_like_key_equals_value():
    cfg = load_config(Settings, ["--layers", "5", "--name", "hello world", "--rate", "-1.5"])
    assert (cfg.layers, cfg.name, cfg.rate) == (5, "hello world", -1.5)
    assert load_config(Settings, ["--limit", "none"]).limit is None
    assert load_config(Settings, ["--limit=1_000"]).limit == 1000


def test_bare_flag_switches_a_bool_on():
    assert load_config(Settings, ["--flag"]).flag is True
    assert load_config(Settings, ["--flag", "--layers=2"]).flag is True
    assert load_config(Settings, ["--flag=false"]).flag is False
    assert load_config(Settings, ["--flag=no"]).flag is False


def test_dashes_in_a_key_read_as_underscores():
    assert load_config(train.TrainConfig, ["--learning-rate=0.5"]).learning_rate == 0.5


def test_repeated_list_option_appends_and_replaces_the_presets_list(tmp_path):
    preset = toml(tmp_path / "p.toml", 'inputs = ["from_preset.txt"]\n')
    assert load_config(Settings, [preset, "--inputs=a.txt", "--inputs", "b.txt"]).inputs == ["a.txt", "b.txt"]
    assert load_config(Settings, [preset]).inputs == ["from_preset.txt"]


@pytest.mark.parametrize("where", ["command line", "preset"])
def test_unknown_key_suggests_the_closest(tmp_path, where):
    args = ["--lerning_rate=0.1"] if where == "command line" else [toml(tmp_path / "typo.toml", "lerning_rate = 0.1\n")]
    with pytest.raises(UserError, match="did you mean learning_rate") as e:
        load_config(train.TrainConfig, args)
    assert "lerning_rate" in str(e.value)
    if where == "preset":
        assert "typo.toml" in str(e.value)


def test_unknown_key_with_nothing_close_points_to_help():
    with pytest.raises(UserError, match="--help"):
        load_config(Settings, ["--zzzzzz=1"])


@pytest.mark.parametrize("args, key, type_name", [
    (["--layers=abc"], "layers", "int"),
    (["--layers=2.5"], "layers", "int"),
    (["--rate=fast"], "rate", "float"),
    (["--flag=maybe"], "flag", "bool"),
    (["--limit=lots"], "limit", "int or none"),
])
def test_wrong_type_on_the_command_line_names_the_key_and_type(args, key, type_name):
    with pytest.raises(UserError, match=f"{key} must be {type_name}"):
        load_config(Settings, args)


@pytest.mark.parametrize("line, key, type_name", [
    ('layers = "four"', "layers", "int"),
    ("layers = 4.0", "layers", "int"),
    ("layers = true", "layers", "int"),
    ('flag = "maybe"', "flag", "bool"),
    ("name = 3", "name", "str"),
    ("inputs = [1, 2]", "inputs", "list of str"),
])
def test_wrong_type_in_a_preset_names_the_file_key_and_type(tmp_path, line, key, type_name):
    preset = toml(tmp_path / "wrong.toml", line + "\n")
    with pytest.raises(UserError, match=f"{key} must be {type_name}") as e:
        load_config(Settings, [preset])
    assert "wrong.toml" in str(e.value)


def test_int_in_a_preset_is_a_fine_float(tmp_path):
    assert load_config(Settings, [toml(tmp_path / "p.toml", "rate = 3\n")]).rate == 3.0


def test_toml_syntax_error_names_the_file_and_line(tmp_path):
    preset = toml(tmp_path / "broken.toml", "layers = 2\nrate = = 4\n")
    with pytest.raises(UserError, match="line 2") as e:
        load_config(Settings, [preset])
    assert "broken.toml" in str(e.value)


def test_missing_preset_and_missing_value_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(Settings, [str(tmp_path / "nope.toml")])
    with pytest.raises(UserError, match="needs a value"):
        load_config(Settings, ["--layers"])


def test_a_user_error_in_main_is_one_line_and_exit_2(capsys):
    @cli
    def main(argv):
        load_config(Settings, argv)
        return 0

    assert main(["--layers=2"]) == 0
    assert main(["--layres=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "did you mean layers" in err


def test_help_lists_every_training_key_with_its_type_and_default(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    hints = typing.get_type_hints(train.TrainConfig)
    names = {int: "int", float: "float", str: "str", bool: "bool"}
    for f in dataclasses.fields(train.TrainConfig):
        assert f"--{f.name}={f.default!r}  ({names[hints[f.name]]}{' or auto' * (f.default == AUTO)})" in out
        assert f.metadata["help"] in out
    assert len(dataclasses.fields(train.TrainConfig)) > 30  # the whole dataclass, not a few keys
    chosen = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "max_iters", "dropout", "optimizer", "pos")
    assert all(f"--{name}='auto'  (" in out for name in chosen)  # every setting the sizing chooses


def test_a_string_in_toml_is_not_taken_for_a_number(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('n_layer = "4"\n')
    with pytest.raises(UserError, match="n_layer must be int"):
        load_config(train.TrainConfig, [str(preset)])


@dataclass
class Ranged:
    count: int = option(1, "at least one", low=1)
    fraction: float = option(0.5, "strictly between 0 and 1", above=0, below=1)
    share: float = option(1.0, "more than 0, at most 1", above=0, high=1)
    mode: str = option("fast", "one of three", choices=("fast", "slow", "off"))
    limit: int | None = option(None, "at least 0, or none", low=0)


@pytest.mark.parametrize("args, says", [
    (["--count=0"], "count must be at least 1, got 0"),
    (["--fraction=0"], "fraction must be more than 0 and less than 1, got 0.0"),
    (["--fraction=1"], "fraction must be more than 0 and less than 1, got 1.0"),
    (["--share=1.5"], "share must be more than 0 and at most 1, got 1.5"),
    (["--mode=medium"], "mode must be one of fast, slow, off, got 'medium'"),
    (["--limit=-1"], "limit must be at least 0, got -1"),
])
def test_a_value_out_of_range_names_the_key_the_value_and_the_range(args, says):
    with pytest.raises(UserError, match="command line: " + says):
        load_config(Ranged, args)


def test_values_in_range_and_none_for_an_optional_pass():
    cfg = load_config(Ranged, ["--count=1", "--fraction=0.999", "--share=1", "--mode=off", "--limit=none"])
    assert (cfg.count, cfg.fraction, cfg.share, cfg.mode, cfg.limit) == (1, 0.999, 1.0, "off", None)


def test_a_value_out_of_range_in_a_preset_names_the_file(tmp_path):
    with pytest.raises(UserError, match=r"bad\.toml: count must be at least 1, got -3"):
        load_config(Ranged, [toml(tmp_path / "bad.toml", "count = -3\n")])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_float_must_be_finite(value):
    with pytest.raises(UserError, match="rate must be a finite number"):
        load_config(Settings, [f"--rate={value}"])


def test_every_training_option_with_a_lower_bound_rejects_a_value_below_it():
    bounded = [f for f in dataclasses.fields(train.TrainConfig) if {"low", "above"} & set(f.metadata["allowed"])]
    for f in bounded:
        bound = f.metadata["allowed"].get("low", f.metadata["allowed"].get("above"))
        with pytest.raises(UserError, match=f"{f.name} must be"):
            load_config(train.TrainConfig, [f"--{f.name}={bound - 1}"])
    assert {"n_head", "batch_size", "eval_interval", "log_interval", "grad_accum", "learning_rate",
            "n_layer", "max_iters", "dropout"} <= {f.name for f in bounded}


def test_bool_option_followed_by_a_bool_word_takes_it_as_its_value(tmp_path):
    assert load_config(Settings, ["--flag", "false"]).flag is False
    assert load_config(Settings, ["--flag", "off", "--layers=3"]).flag is False
    assert load_config(Settings, ["--flag", "true"]).flag is True
    preset = toml(tmp_path / "p.toml", "layers = 7\n")
    assert load_config(Settings, ["--flag", preset]) == Settings(flag=True, layers=7)  # a file is no bool word


def test_a_toml_file_with_a_byte_order_mark_parses(tmp_path):
    preset = tmp_path / "bom.toml"
    preset.write_bytes(b"\xef\xbb\xbflayers = 4\n")
    assert load_config(Settings, [str(preset)]).layers == 4


def test_help_says_what_each_ranged_option_allows(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "attention heads (at least 1)" in out
    assert "dropout probability (at least 0 and less than 1)" in out


def test_ctrl_c_in_main_is_one_line_and_exit_130(capsys):
    @cli
    def main(argv):
        raise KeyboardInterrupt

    assert main([]) == 130
    assert capsys.readouterr().err == "interrupted\n"
