"""The one configuration loader every script uses.

    python train.py [PRESET.toml ...] [--key=value ...]

A script's settings are a dataclass whose fields carry their help text. TOML
presets are laid over the defaults in order, then command-line overrides. TOML
is parsed (tomllib), never executed, and every key, type and range is checked.
"""

import dataclasses
import difflib
import functools
import math
import operator
import os
import sys
import tomllib
import types
import typing

from tinygpt import terminal

BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


class UserError(Exception):
    """A mistake the user can fix; scripts print it as one `error:` line, exit 2. Under torchrun every
    process meets the same mistakes, and rank 0 alone prints them, unless `alone` (the one process that
    met it); one without a message has been printed by another process."""

    def __init__(self, message="", alone=False):
        super().__init__(message)
        self.alone = alone


def option(default, help, *, low=None, high=None, above=None, below=None, choices=None):
    """A dataclass field with its one-line help and the values it allows: at least low,
    at most high, more than above, less than below, or one of choices. load_config
    checks them (None, for an optional field, always passes)."""
    allowed = {k: v for k, v in dict(low=low, high=high, above=above, below=below, choices=choices).items()
               if v is not None}
    metadata = {"help": help, "allowed": allowed}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def cli(main):
    """Wraps main(argv) -> exit code so a UserError becomes one line and exit 2, Ctrl-C
    one line and exit 130, and a closed stdout or stderr stops the printing, not the work."""

    @functools.wraps(main)
    def wrapper(argv=None):
        terminal.restore()  # from here on Ctrl-C is a KeyboardInterrupt, so cleanups run
        with terminal.quiet_on_failure():
            try:
                return main(sys.argv[1:] if argv is None else list(argv)) or 0
            except SystemExit as e:  # --help: printed, and done
                return e.code or 0
            except UserError as e:
                if str(e) and (e.alone or os.environ.get("RANK", "0") == "0"):
                    print(f"error: {e}", file=sys.stderr)
                return 2
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr)
                return 130

    return wrapper


def _base_type(tp):
    """(type, optional) for a field annotation such as int, float | None, list[str]."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _type_name(tp):
    base, optional = _base_type(tp)
    name = "list of str" if typing.get_origin(base) is list else base.__name__
    return name + (" or none" if optional else "")


def _convert(name, tp, value, source, from_text=False):
    """Checks one value for field `name`: a typed TOML value as it is, or a
    command-line string (from_text) parsed to the field's type."""
    base, optional = _base_type(tp)
    from_text = from_text and isinstance(value, str) and base is not str
    bad = UserError(f"{source}: {name} must be {_type_name(tp)}, got {value!r}")
    if optional and isinstance(value, str) and value.lower() in ("none", "null", ""):  # TOML has no null
        return None
    if typing.get_origin(base) is list:
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in items):
            raise bad
        return items
    if base is bool:
        if isinstance(value, bool):
            return value
        if from_text and value.lower() in BOOL_WORDS:
            return BOOL_WORDS[value.lower()]
        raise bad
    if base is int:
        if from_text:
            try:
                return int(value.replace("_", ""))
            except ValueError:
                raise bad from None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if base is float:
        if from_text:
            try:
                value = float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise UserError(f"{source}: {name} must be a finite number, got {value}")
            return float(value)
        raise bad
    if base is str and isinstance(value, str):
        return value
    if base is str and isinstance(value, (int, float)) and not isinstance(value, bool):  # max_time = 90 in TOML
        raise UserError(f'{source}: {name} must be str, got {value!r}: put it in quotes, {name} = "{value}"')
    raise bad


def _rule(allowed):
    """The allowed values in words: 'at least 1', 'at least 0 and less than 1', 'cpu or gpu'."""
    if "choices" in allowed:
        choices = [str(c) for c in allowed["choices"]]
        return "one of " + ", ".join(choices) if len(choices) > 2 else " or ".join(choices)
    words = {"low": "at least", "above": "more than", "high": "at most", "below": "less than"}
    return " and ".join(f"{words[k]} {allowed[k]}" for k in words if k in allowed)


def _allows(allowed, value):
    if "choices" in allowed:
        return value in allowed["choices"]
    tests = {"low": operator.ge, "above": operator.gt, "high": operator.le, "below": operator.lt}
    return all(test(value, allowed[k]) for k, test in tests.items() if k in allowed)


def check_values(cfg, sources=None):
    """The one check of every field's range or choices; a UserError names the key, the
    value and what is allowed, and where the value came from (sources: name -> where)."""
    for f in dataclasses.fields(cfg):
        allowed, value = f.metadata.get("allowed"), getattr(cfg, f.name)
        if not allowed or value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if not _allows(allowed, item):
                where = (sources or {}).get(f.name, "default")
                raise UserError(f"{where}: {f.name} must be {_rule(allowed)}, got {item!r}")


def _unknown(name, known, source):
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else "; see --help for the known keys"
    return UserError(f"{source}: unknown key {name!r}{hint}")


def read_toml(path):
    """The table in a TOML file, or a UserError naming the file and line."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8").removeprefix("\ufeff")  # a byte-order mark, as some editors write
        return tomllib.loads(text)
    except FileNotFoundError:
        raise UserError(f"config file {path} not found; presets live in config/, e.g. config/tiny.toml") from None
    except IsADirectoryError:
        raise UserError(f"config file {path} is a directory; pass a .toml file") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None


def help_text(cls, prog, description):
    lines = [f"usage: python {prog} [PRESET.toml ...] [--key=value ...]", "", description, "", "options:"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        lines.append(f"  --{f.name}={default!r}  ({_type_name(hints[f.name])})")
        allowed = f.metadata.get("allowed")
        lines.append(f"      {f.metadata.get('help', '')}" + (f" ({_rule(allowed)})" if allowed else ""))
    return "\n".join(lines)


def load_config(cls, argv, prog="", description="", sources=None):
    """Builds a `cls` from presets and overrides in argv; --help prints and exits.
    A dict passed as sources is filled with where each key that was set came from:
    the preset's path, or "command line"; keys left at their defaults are absent."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    # The presets' values, then the command line's: `--n_layer=3 preset.toml` keeps 3, as the other order does.
    values, origin, given = {}, {}, {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(help_text(cls, prog, description))
            raise SystemExit(0)
        if not arg.startswith("--"):
            table = read_toml(arg)
            for name, value in table.items():
                if name not in hints:
                    raise _unknown(name, known, arg)
                values[name] = _convert(name, hints[name], value, arg)
                origin[name] = arg
            continue
        name, has_value, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name not in hints:
            raise _unknown(name, known, "command line")
        base, _ = _base_type(hints[name])
        if not has_value:
            if base is bool:
                # A bare --flag switches it on; --flag false (a space, then a bool) sets it.
                value = args.pop(0) if args and args[0].lower() in BOOL_WORDS else "true"
            elif args:
                value = args.pop(0)
            else:
                raise UserError(f"command line: --{name} needs a value, e.g. --{name}=VALUE")
        value = _convert(name, hints[name], value, "command line", from_text=True)
        given[name] = given.get(name, []) + value if typing.get_origin(base) is list else value  # repeated: appends
    values.update(given)
    origin.update(dict.fromkeys(given, "command line"))
    cfg = cls(**values)
    check_values(cfg, origin)
    if sources is not None:
        sources.update(origin)
    return cfg
