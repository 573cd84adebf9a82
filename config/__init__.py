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
# The plain kinds: the types a TOML value of each may have (True is no int; an int is a fine float),
# and how a command-line word is read as one.
TYPES = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}
READ = {int: int, float: float, str: str, bool: lambda word: BOOL_WORDS[word.lower()]}
# option()'s bounds, each a test of (bound, value), and their words in --help and errors
TESTS = {"low": operator.le, "above": operator.lt, "high": operator.ge, "below": operator.gt,
         "choices": operator.contains}
WORDS = {"low": "at least", "above": "more than", "high": "at most", "below": "less than"}


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
        if not arg.startswith("--") and arg != "-h":  # a preset
            values |= {k: convert(fields, hints, k, v, arg) for k, v in read_toml(arg).items()}
        else:
            name, has_value, value = arg[2:].partition("=")
            # the other forms: -h, --help, --key value, a bare --flag, --dashed-key, a key cls lacks
            if not has_value or name not in hints:
                if arg in ("-h", "--help"):
                    print(help_text(cls, prog, description))
                    raise SystemExit(0)
                name = name.replace("-", "_")
                if rest is not None and name not in hints:  # the caller's, with its value
                    taken = not has_value and args and not args[0].startswith("--")
                    rest += [arg, args.pop(0)] if taken else [arg]
                    continue
                if not has_value and unwrap(hints.get(name))[0] is bool:  # --flag, or --flag off
                    value = args.pop(0) if args and args[0].lower() in BOOL_WORDS else "true"
                elif not has_value and args:
                    value = args.pop(0)
                elif not has_value and name in hints:
                    raise UserError(f"command line: --{name} needs a value, e.g. --{name}=VALUE")
            given[name] = convert(fields, hints, name, value, "command line", given)
    return cls(**(values | {k: v for k, v in (base or {}).items() if k in fields} | given))


def unwrap(tp):
    """(type, optional) for a field annotation such as int, float | None, list[str]."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None)), True
    return tp, False


def type_name(tp):
    base, optional = unwrap(tp)
    return ("list of str" if typing.get_origin(base) is list else base.__name__) + (" or none" if optional else "")


def convert(fields, hints, name, value, source, given=None):
    """value for field `name`, checked: a TOML value as it is typed, or a command-line word read as
    the field's type (given: the command line's values so far, which a list's words add to); then
    its range or choices. A UserError names the key, what it must be, and where the value came from."""
    # the rarer kinds: an unknown key, a list, or a value that may be none (its type then read below)
    if (kind := hints.get(name)) not in TYPES:
        if kind is None:
            close = difflib.get_close_matches(name, list(hints), n=1)
            hint = f"; did you mean {close[0]}?" if close else "; see --help for the known keys"
            raise UserError(f"{source}: unknown key {name!r}{hint}")
        kind, optional = unwrap(kind)
        if optional and isinstance(value, str) and value.lower() in ("none", "null", ""):  # TOML has no null
            return None
        if typing.get_origin(kind) is list:  # TOML's list, or one word; each item checked as a str
            value = value if isinstance(value, list) else [value]
            if not all(isinstance(item, str) for item in value):
                raise wrong_type(source, name, hints[name], value)
            items = [convert(fields, hints | {name: str}, name, item, source) for item in value]
            return items if given is None else given.get(name, []) + items
    if value == AUTO == fields[name].default:  # a setting the script chooses
        return AUTO
    try:
        value = value if given is None else READ[kind](value)
    except (KeyError, ValueError):
        pass  # the word as it is, which the check below refuses
    if type(value) not in TYPES[kind] or kind is float and not math.isfinite(value) \
            or not all(TESTS[k](bound, value) for k, bound in fields[name].metadata["allowed"].items()):
        raise refusal(fields[name], hints[name], value, source)
    # as its kind: TOML's rate = 3 is 3.0
    return kind(value)


def refusal(field, hint, value, source):
    """The UserError saying what the field must be: of its type, finite, within its bounds."""
    kind = unwrap(hint)[0]
    if type(value) not in TYPES[kind]:
        return wrong_type(source, field.name, hint, value)
    if kind is float and not math.isfinite(value):
        return UserError(f"{source}: {field.name} must be a finite number, got {value}")
    return UserError(f"{source}: {field.name} must be {rule(field.metadata['allowed'])}, got {value!r}")


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
    return " and ".join(f"{words} {allowed[k]}" for k, words in WORDS.items() if k in allowed)


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
