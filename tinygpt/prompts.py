"""Prompts as sample.py and tinygpt.score read them: from the command line or a file, checked
character by character against the model's tokenizer, and encoded.

A character the tokenizer has no token for is an error naming each one and where it is
(file, line, column), or with --unknown=skip dropped with a warning. A prompt typed in the
other Unicode form (an accent as a separate mark, as macOS may write it) is read in the
form the model knows.
"""

import sys
import unicodedata
from pathlib import Path

from config import UserError


def read_text(path, option_name):
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{option_name}: file {path} not found") from None
    except IsADirectoryError:
        raise UserError(f"{option_name}: {path} is a directory; pass a text file") from None
    except UnicodeDecodeError:
        raise UserError(f"{option_name}: file {path} is not UTF-8 text") from None


def read_prompts(start, prompts_file=""):
    """[(text, source, first_line)]: each prompt and where it came from, for messages. start: the
    prompt, or FILE:path; prompts_file: a file of prompts, one a line (blank lines skipped)."""
    if prompts_file:
        lines = read_text(prompts_file, "--prompts").splitlines()
        prompts = [(line, prompts_file, n) for n, line in enumerate(lines, 1) if line.strip()]
        if not prompts:
            raise UserError(f"--prompts: file {prompts_file} has no prompts; write one a line")
        return prompts
    if start.startswith("FILE:"):
        path = start.removeprefix("FILE:")
        if not path:
            raise UserError("--start=FILE: names no file; give its path, e.g. --start=FILE:prompt.txt")
        return [(read_text(path, "--start"), path, 1)]
    return [(start, "--start", 1)]


def where(text, i, source, first_line):
    """Where character i of a prompt is, counted from 1 as editors count."""
    column = i - text.rfind("\n", 0, i)
    if source == "--start" and "\n" not in text:
        return f"--start column {column}"
    return f"{source} line {first_line + text.count(chr(10), 0, i)} column {column}"


def normalized(text, tokenizer):
    """text, or its composed (NFC) or decomposed (NFD) Unicode form if the tokenizer knows
    more of that one's characters: an accent typed as a separate mark (as macOS may
    write it) or not is the same letter to the reader, but not to a char tokenizer."""
    forms = {form: unicodedata.normalize(form, text) for form in ("NFC", "NFD")}
    form = min(forms, key=lambda f: len(tokenizer.unknown(forms[f])))
    if len(tokenizer.unknown(forms[form])) >= len(tokenizer.unknown(text)):
        return text
    print(f"note: the prompt is read in Unicode form {form}, whose characters the model knows", file=sys.stderr)
    return forms[form]


def drop_unknown(prompts, tokenizer, on_unknown, what="the prompt"):
    """The text of each prompt. Characters the tokenizer lacks are an error, all of
    them named in one message, or with on_unknown="skip" dropped with a warning."""
    prompts = [(normalized(text, tokenizer), source, first_line) for text, source, first_line in prompts]
    found = {}  # character -> where it first appears
    for text, source, first_line in prompts:
        for ch in tokenizer.unknown(text):
            found.setdefault(ch, where(text, text.index(ch), source, first_line))
    if found:
        listed = ", ".join(f"{ch!r} ({place})" for ch, place in list(found.items())[:10])
        more = f" and {len(found) - 10} more" if len(found) > 10 else ""
        message = f"{len(found)} character(s) the model never saw: {listed}{more}"
        if any(unicodedata.combining(ch) for ch in found):
            message += " (accents typed as separate marks; the model knows no other Unicode form of them either)"
        if on_unknown == "error":
            raise UserError(f"{what} has {message}; remove them, or pass --unknown=skip to drop them")
        print(f"warning: dropped {message}", file=sys.stderr)
    return ["".join(ch for ch in text if ch not in found) for text, _, _ in prompts]


def encode_prompts(prompts, tokenizer, on_unknown):
    """Token ids of each prompt (see drop_unknown); an empty one starts from a newline."""
    start = tokenizer.encode("\n") if not tokenizer.unknown("\n") else [0]  # where nanoGPT starts
    return [tokenizer.encode(text) if text else start for text in drop_unknown(prompts, tokenizer, on_unknown)]
