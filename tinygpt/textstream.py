"""Generated tokens back to text as they arrive, ending at a stop sequence.

sample.py prints a sample while it is generated. Two things make it hold text
back for a while: a byte-level BPE token can end inside a multi-byte character,
and generated text that could be the start of a stop sequence (--stop) may turn
out to be one, which is not printed.
"""

import re


def unescape(text):
    r"""\n, \t and \\ in a command-line stop sequence: a newline, a tab, a backslash."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m[1]], text)


class TextStream:
    """Turns one row's generated tokens into text. Tokens wait, and are decoded together,
    while their text ends in an incomplete character. Text waits while its end could
    begin a stop sequence; once one appears, the text before it is the last, and
    `stopped` is set. A stop sequence may span tokens, and may end inside one."""

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
        """The rest of the text, at the end of a sample that met no stop sequence."""
        if self.stopped:
            return ""
        text, self.pending = self.release(self.tokenizer.decode(self.pending)), []
        text, self.held = text + self.held, ""
        return text
