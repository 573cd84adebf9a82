"""Where a script meets its terminal: Ctrl-C and hangups, and output with nowhere to go.

Importing this module first (every script does) makes Ctrl-C while torch loads (it
takes seconds) end the script with one line, not a traceback through the import
machinery; only a script of this repository (or python -m tinygpt.X) is affected, and only until its
main() starts: there config.cli puts Python's own handler back (`restore`) and turns
KeyboardInterrupt into the same line. A test or program that imports a script keeps
its own Ctrl-C.

While training, `StopRequested` turns SIGINT, SIGTERM and SIGHUP (a closed terminal)
into a flag the loop checks: it finishes its step, saves and exits. Before that,
`stop_before_start` makes SIGTERM and SIGHUP one line, as Ctrl-C is.

`train.py ... | head -1` closes the pipe after one line; a hangup closes the terminal;
stdout may be a file on a full disk. Each would raise on the next print and kill a run
that has nothing wrong with it. While `quiet_on_failure()` is active, the first failed
write or flush points that stream's file descriptor at /dev/null, and later output is
dropped, silently, so Python's own flush at exit finds nothing to complain about.
"""

import contextlib
import io
import os
import signal
import sys

from tinygpt.system import stop_signals

# --- Ctrl-C and other signals -------------------------------------------------------------


def interrupted(signum, frame):
    try:
        os.write(2, b"interrupted\n")
    finally:
        os._exit(130)  # nothing has been written yet: there is nothing to clean up


def restore():
    """Python's KeyboardInterrupt again, if this module's handler is the one installed."""
    if signal.getsignal(signal.SIGINT) is interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
_package = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(os.path.abspath(_script)) in (_package, os.path.dirname(_package)):  # ours, or python -m tinygpt.X
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when started with Ctrl-C ignored
        signal.signal(signal.SIGINT, interrupted)


class StopRequested:
    """While active, SIGINT, SIGTERM and SIGHUP (a closed terminal; not on Windows) set a flag instead of
    killing the process: the loop finishes its step, saves, and exits 128 + the signal's number."""

    def __enter__(self):
        self.signum = None
        self.previous = {s: signal.signal(s, self.handle) for s in stop_signals()}
        return self

    def handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def stop_before_start():
    """While active (train.py's start-up: checks, sizing, the budget's probe), SIGTERM and SIGHUP end the
    script as Ctrl-C does: one line, cleanups run (out_dir's lock is let go), exit 128 + the signal."""

    def handle(signum, frame):
        if os.environ.get("RANK", "0") == "0":  # under torchrun every process gets it: one line
            print(f"stopped by {signal.Signals(signum).name} while starting, before its first step", file=sys.stderr)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, handle) for s in stop_signals() if s != signal.SIGINT}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# --- Output streams -----------------------------------------------------------------------------


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
