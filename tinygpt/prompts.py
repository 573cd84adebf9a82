"""Text in and out of a model: prompts read from the command line or a file (sample.py, tinygpt.score),
checked against the tokenizer and encoded; generated tokens back to text as they come (sample.py)."""

import re
import sys
import unicodedata

from config import UserError
from tinygpt.textfiles import read_text


def read_prompts(start, prompts_file=""):
    """[(text, source, first_line)]: each prompt and where it came from, for messages. start: the
    prompt, or FILE:path; prompts_file: a file of prompts, one a line (blank lines skipped)."""
    if prompts_file:
        lines = read_text(prompts_file, "--prompts").split("\n")  # not splitlines(): a form feed is no new line
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


def normalized(text, tokenizer, what="the prompt"):
    """text, or its composed (NFC) or decomposed (NFD) Unicode form if the tokenizer knows
    more of that one's characters: an accent typed as a separate mark (as macOS may
    write it) or not is the same letter to the reader, but not to a char tokenizer."""
    forms = {None: text} | {form: unicodedata.normalize(form, text) for form in ("NFC", "NFD")}  # a tie: the first
    form = min(forms, key=lambda f: len(tokenizer.unknown(forms[f])))
    if form:
        print(f"note: {what} is read in Unicode form {form}, whose characters the model knows", file=sys.stderr)
    return forms[form]


def drop_unknown(prompts, tokenizer, on_unknown, what="the prompt"):
    """The text of each prompt. Characters the tokenizer lacks are an error, all of
    them named in one message, or with on_unknown="skip" dropped with a warning."""
    prompts = [(normalized(text, tokenizer, what), source, first_line) for text, source, first_line in prompts]
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


# --- Generated tokens back to text ---------------------------------------------------------------


def unescape(text):
    r"""\n, \t and \\ in a command-line stop sequence: a newline, a tab, a backslash."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m[1]], text)


class TextStream:
    """Turns one row's generated tokens into text. Tokens wait, and are decoded together, while their text
    ends in an incomplete character. Text waits while its end could begin a stop sequence; once one appears,
    the text before it is the last, and `stopped` is set. A stop sequence may span tokens, and end inside one."""

    def __init__(self, tokenizer, stops=()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.pending = []  # tokens whose text ends in an incomplete character
        self.held = ""  # text that may be the start of a stop sequence
        self.stopped = False

    def push(self, ids):
        """The new text that ids complete and no stop sequence can claim, maybe empty."""
        if self.stopped:
            return ""
        self.pending += ids
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd") and len(self.pending) < 4:  # a character's 4 bytes span 4 tokens at most
            return ""
        self.pending = []
        return self.release(text)

    def release(self, text):
        text = self.held + text
        found = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.stopped, self.held = True, ""
            return text[: min(found)]
        # Hold back the longest end of the text that is the start of a stop sequence.
        keep = max((k for stop in self.stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self):
        """The rest of the text, at the end of a sample: nothing once stopped, as nothing is pending or held."""
        text, self.pending = self.release(self.tokenizer.decode(self.pending)), []
        text, self.held = text + self.held, ""
        return text
