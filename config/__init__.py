"""The one configuration loader every script uses.

    python train.py [PRESET.toml ...] [--key=value ...]

A script's settings are a dataclass whose fields carry their help text. TOML
presets are laid over the defaults in order, then command-line overrides. TOML
is parsed (tomllib), never executed, and every key and type is checked.
"""

import dataclasses
import difflib
import functools
import sys
import tomllib
import types
import typing


class UserError(Exception):
    """A mistake the user can fix; scripts print it as one `error:` line, exit 2."""


def option(default, help):
    """A dataclass field with its one-line help."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def cli(main):
    """Wraps main(argv) -> exit code so a UserError becomes one line and exit 2."""

    @functools.wraps(main)
    def wrapper(argv=None):
        try:
            return main(sys.argv[1:] if argv is None else list(argv)) or 0
        except SystemExit as e:  # --help: printed, and done
            return e.code or 0
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

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
        if from_text and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
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
                return float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if base is str and isinstance(value, str):
        return value
    raise bad


def _unknown(name, known, source):
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else "; see --help for the known keys"
    return UserError(f"{source}: unknown key {name!r}{hint}")


def read_toml(path):
    """The table in a TOML file, or a UserError naming the file and line."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
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
        lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)


def load_config(cls, argv, prog="", description="", sources=None):
    """Builds a `cls` from presets and overrides in argv; --help prints and exits.
    A dict passed as sources is filled with where each key that was set came from:
    the preset's path, or "command line"; keys left at their defaults are absent."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values, lists_from_cli, origin = {}, set(), {}
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
                value = "true"  # a bare --flag switches it on
            elif args:
                value = args.pop(0)
            else:
                raise UserError(f"command line: --{name} needs a value, e.g. --{name}=VALUE")
        value = _convert(name, hints[name], value, "command line", from_text=True)
        if typing.get_origin(base) is list:
            # Repeating a list option appends; the first one replaces any preset's list.
            values[name] = (values[name] if name in lists_from_cli else []) + value
            lists_from_cli.add(name)
        else:
            values[name] = value
        origin[name] = "command line"
    if sources is not None:
        sources.update(origin)
    return cls(**values)
