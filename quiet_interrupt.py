"""Imported first by every script, so that Ctrl-C while torch loads (it takes seconds)
ends the script with one line, not a traceback through the import machinery.

Only a script run from this directory is affected, and only until its main() starts:
there config.cli puts Python's own handler back and turns KeyboardInterrupt into the
same line. A test or program that imports a script keeps its own Ctrl-C.
"""

import os
import signal
import sys


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
if os.path.dirname(os.path.abspath(_script)) == os.path.dirname(os.path.abspath(__file__)):
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when started with Ctrl-C ignored
        signal.signal(signal.SIGINT, interrupted)
