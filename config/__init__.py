"""The one configuration loader every script uses.

    python train.py [PRESET.toml ...] [--key=value ...]

A script's settings are a dataclass whose fields carry their help text. TOML presets are laid
over the defaults in order, then the command line's --key=value. TOML is parsed (tomllib), never
executed, and every key, type and range is checked. A setting whose default is "auto" takes that
word too: the script chooses its value (train.py: tinygpt/budget.py). This module imports nothing
of the project: the scripts and the package import it.
"""

import dataclasses
import difflib
import math
import operator
import pathlib
import tomllib
import types
import typing

BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
AUTO = "auto"  # the value of a setting the script chooses itself
BOUNDS = {"low": (operator.ge, "at least"), "above": (operator.gt, "more than"), "high": (operator.le, "at most"),
          "below": (operator.lt, "less than")}


class UserError(Exception):
    """A mistake the user can fix; scripts print it as one `error:` line, exit 2. Under torchrun every
    process meets the same mistakes, and rank 0 alone prints them, unless `alone` (the one process that
    met it); one without a message has been printed by another process."""

    def __init__(self, message="", alone=False):
        super().__init__(message)
        self.alone = alone


def option(default, help, **allowed):
    """A dataclass field with its one-line help and the values it allows: at least low, at most high,
    more than above, less than below, or one of choices. load_config checks them (None always passes)."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help, "allowed": allowed})
    return dataclasses.field(default=default, metadata={"help": help, "allowed": allowed})


def load_config(cls, argv, prog="", description="", rest=None, base=None):
    """A `cls` from the presets and --key=value overrides in argv; --help prints and exits. A list given
    as rest takes the --key options cls does not know, as written, instead of refusing them. A dict given as
    base holds settings laid over the presets, under the command line (a resumed run's own: train.py).
    description: the first line of --help's text (a docstring may be given whole)."""
    fields, hints = {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls)
    values, given, args = {}, {}, list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(help_text(cls, prog, description))
            raise SystemExit(0)
        if not arg.startswith("--"):
            for name, value in read_toml(arg).items():
                values[name] = convert(fields, hints, name, value, arg)
            continue
        name, has_value, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if rest is not None and name not in hints:
            rest += [arg] + ([args.pop(0)] if not has_value and args and not args[0].startswith("--") else [])
            continue
        if not has_value:
            if unwrap(hints.get(name))[0] is bool:
                value = args.pop(0) if args and args[0].lower() in BOOL_WORDS else "true"
            elif args:
                value = args.pop(0)
            elif name in hints:
                raise UserError(f"command line: --{name} needs a value, e.g. --{name}=VALUE")
        value = convert(fields, hints, name, value, "command line", from_text=True)
        given[name] = given.get(name, []) + value if isinstance(value, list) else value
    return cls(**(values | {k: v for k, v in (base or {}).items() if k in fields} | given))


def unwrap(tp):
    """(type, optional) for a field annotation such as int, float | None, list[str]."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None)), True
    return tp, False


def type_name(tp):
    base, optional = unwrap(tp)
    return ("list of str" if typing.get_origin(base) is list else base.__name__) + (" or none" if optional else "")


def convert(fields, hints, name, value, source, from_text=False):
    """value for field `name`, checked: a TOML value as it is typed, or (from_text) a command-line string
    read as the field's type; then its range or choices. A UserError names the key, what it must be, and
    where the value came from."""
    if name not in hints:
        close = difflib.get_close_matches(name, list(hints), n=1)
        hint = f"; did you mean {close[0]}?" if close else "; see --help for the known keys"
        raise UserError(f"{source}: unknown key {name!r}{hint}")
    if value == AUTO and fields[name].default == AUTO:
        return AUTO
    base, optional = unwrap(hints[name])
    if optional and isinstance(value, str) and value.lower() in ("none", "null", ""):  # TOML has no null
        return None
    if typing.get_origin(base) is list:
        value, base = value if isinstance(value, list) else [value], list
        if not all(isinstance(v, str) for v in value):
            raise wrong_type(source, name, hints[name], value)
    elif from_text and base is not str:
        try:
            value = BOOL_WORDS[value.lower()] if base is bool else base(value)
        except (KeyError, ValueError):
            raise wrong_type(source, name, hints[name], value) from None
    # A bool only where one is wanted (True is an int too); an int is a fine float: rate = 3 in TOML.
    if isinstance(value, bool) != (base is bool) or not isinstance(value, (int, float) if base is float else base):
        raise wrong_type(source, name, hints[name], value)
    if base is float and not math.isfinite(value):
        raise UserError(f"{source}: {name} must be a finite number, got {value}")
    allowed = fields[name].metadata.get("allowed", {})
    for item in value if base is list else [value]:
        if not all(test(item, allowed[k]) for k, (test, _) in BOUNDS.items() if k in allowed) \
                or item not in allowed.get("choices", [item]):
            raise UserError(f"{source}: {name} must be {rule(allowed)}, got {item!r}")
    return float(value) if base is float else value


def wrong_type(source, name, hint, value):
    """The UserError for a value of the wrong type; a number where text is wanted is told to take quotes."""
    if unwrap(hint)[0] is str and isinstance(value, (int, float)) and not isinstance(value, bool):  # max_time = 90
        return UserError(f'{source}: {name} must be str, got {value!r}: put it in quotes, {name} = "{value}"')
    return UserError(f"{source}: {name} must be {type_name(hint)}, got {value!r}")


def rule(allowed):
    """The allowed values in words: 'at least 1', 'more than 0 and less than 1', 'one of a, b, c'."""
    if "choices" in allowed:
        choices = [str(c) for c in allowed["choices"]]
        return "one of " + ", ".join(choices) if len(choices) > 2 else " or ".join(choices)
    return " and ".join(f"{words} {allowed[k]}" for k, (_, words) in BOUNDS.items() if k in allowed)


def read_toml(path):
    """The table in a TOML file, or a UserError naming the file and line."""
    try:
        return tomllib.loads(pathlib.Path(path).read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise UserError(f"config file {path} not found; presets live in config/, e.g. config/tiny.toml") from None
    except IsADirectoryError:
        raise UserError(f"config file {path} is a directory; pass a .toml file") from None
    except OSError as e:  # a name too long, a loop of links: shown cut short, as the name may be 100,000 characters
        raise UserError(f"config file {str(path):.200} cannot be read ({e.strerror}); pass a .toml file") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None


def help_text(cls, prog, description):
    lines = [f"usage: python {prog} [PRESET.toml ...] [--key=value ...]", "", description.strip().split("\n")[0], "",
             "options:"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        allowed = f.metadata.get("allowed")
        lines += [f"  --{f.name}={default!r}  ({type_name(hints[f.name])}{' or auto' * (default == AUTO)})",
                  f"      {f.metadata.get('help', '')}" + (f" ({rule(allowed)})" if allowed else "")]
    return "\n".join(lines)
