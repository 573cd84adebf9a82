"""Printing that cannot stop the work: a closed or full stdout or stderr ends the
printing, not the run.

`train.py ... | head -1` closes the pipe after one line; a hangup closes the terminal;
stdout may be a file on a full disk. Each would raise on the next print and kill a run
that has nothing wrong with it. While `quiet_on_failure()` is active, the first failed
write or flush points that stream's file descriptor at /dev/null, and later output is
dropped, silently, so Python's own flush at exit finds nothing to complain about.
"""

import contextlib
import io
import os
import sys


class Guarded:
    """A text stream that swallows its own write errors; `lost` says whether one happened."""

    def __init__(self, stream):
        self.stream = stream
        self.lost = False

    def write(self, text):
        if not self.lost:
            try:
                self.stream.write(text)
            except UnicodeEncodeError:  # a file name that is not valid UTF-8, say: escaped, not fatal
                encoding = getattr(self.stream, "encoding", None) or "utf-8"
                self.write(text.encode(encoding, "backslashreplace").decode(encoding, "replace"))
            except (OSError, ValueError):  # ValueError: the stream was closed under us
                self.lose()
        return len(text)

    def flush(self):
        if not self.lost:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.lose()

    def lose(self):
        self.lost = True
        with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
            fd = self.stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)  # what is still buffered now goes nowhere, without an error
            os.close(devnull)

    def __getattr__(self, name):  # isatty, fileno, encoding, ... as the stream has them
        return getattr(self.stream, name)


@contextlib.contextmanager
def quiet_on_failure():
    """sys.stdout and sys.stderr guarded while active (once: nested uses share them)."""
    if isinstance(sys.stdout, Guarded):
        yield
        return
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Guarded(sys.stdout), Guarded(sys.stderr)
    try:
        yield
    finally:
        sys.stdout.flush()  # while still guarded: the pipe may have gone with output in the buffer
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved


def stdout_lost():
    """Whether stdout has failed: for a script whose output is the point (sample.py) to stop."""
    return getattr(sys.stdout, "lost", False)
