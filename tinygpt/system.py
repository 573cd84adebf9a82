"""Where a script meets its operating system, and all that differs between Linux, macOS and Windows. In order:
what a script's main() meets (signals, output streams that close, the exit code), processes and memory,
directories. Importing it changes nothing: a script's main() installs what it needs (cli, Stop) and puts it back."""

import contextlib
import ctypes
import errno
import gc
import io
import os
import platform
import signal
import sys
import time

from config import UserError

WINDOWS = sys.platform == "win32"
LINUX = sys.platform.startswith("linux")
_IMPORTED = time.time()


def signal_name(signum):
    return signal.Signals(signum).name  # SIGTERM


def stop_signals():
    """SIGINT (Ctrl-C), SIGTERM, and SIGHUP (a closed terminal) where the system has it (not Windows)."""
    return tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A stop signal while main() runs (args: its number): ends main() as Ctrl-C does, its blocks cleaning up."""


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


def cli(main):
    """Wraps main(argv) -> exit code. While it runs, a UserError is one line and exit 2, a stop signal one line and
    128 + its number, and a closed stdout or stderr stops the printing, not the work (Guarded)."""

    def wrapper(argv=None):
        previous = {s: signal.signal(s, raise_interrupted) for s in stop_signals()}
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = map(Guarded, saved)
        try:
            return main(sys.argv[1:] if argv is None else list(argv)) or 0
        except SystemExit as e:  # --help: printed, and done
            return e.code or 0
        except UserError as e:
            if str(e) and (e.alone or os.environ.get("RANK", "0") == "0"):
                print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as e:
            signum = e.args[0] if isinstance(e, Interrupted) else signal.SIGINT
            print("interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}", file=sys.stderr)
            return 128 + signum
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            sys.stdout.flush()  # while still guarded: the pipe may be gone
            sys.stderr.flush()
            sys.stdout, sys.stderr = saved
            if argv is None:  # a script, whose process ends next: its exit then skips torch's objects: 0.5-0.8 s
                gc.freeze()

    return wrapper


class Stopped(BaseException):
    """A stop signal in an evaluation, which only reads: it ends there (a BaseException, as KeyboardInterrupt)."""


class Stop:
    """While active, a stop signal asks the run to stop and a second ends it. Before the loop (no `model`) one ends
    it as Ctrl-C does. In the loop it sets `signum`: the step ends, saves, exits so; an evaluation gets Stopped (under
    torchrun it ends first, as on every process: they decide together after it)."""

    def __enter__(self):
        self.signum, self.model = None, None
        self.previous = {s: signal.signal(s, self.handle) for s in stop_signals()}
        return self

    def handle(self, signum, frame):
        if self.model is not None and self.signum is None:
            self.signum = signum
            if not self.model.training and "WORLD_SIZE" not in os.environ:
                raise Stopped
            return
        if os.environ.get("RANK", "0") == "0":  # under torchrun every process gets it: one line
            when = "again" if self.model is not None else "while starting, before its first step"
            print(f"stopped by {signal_name(signum)} {when}", file=sys.stderr)
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Guarded:
    """A text stream that swallows its write errors (`| head -1`, a hangup, a full disk) rather than end a sound run;
    the first points its file descriptor at /dev/null (`lost`), so Python's flush at exit finds nothing to say."""

    def __init__(self, stream):
        self.stream, self.lost = stream, False

    def write(self, text):
        try:
            return len(text) if self.lost else self.stream.write(text)
        except UnicodeEncodeError:  # a file name that is not valid UTF-8, say: escaped, not fatal
            encoding = getattr(self.stream, "encoding", None) or "utf-8"
            return self.write(text.encode(encoding, "backslashreplace").decode(encoding, "replace"))
        except (OSError, ValueError):  # ValueError: the stream was closed under us
            self.lose()
            return len(text)

    def flush(self):
        try:
            return None if self.lost else self.stream.flush()
        except (OSError, ValueError):
            self.lose()

    def lose(self):
        self.lost = True
        with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())  # what is still buffered now goes nowhere, without an error
            os.close(devnull)

    def __getattr__(self, name):  # isatty, fileno, encoding, ... as the stream has them
        return getattr(self.stream, name)


def cpu_count():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def process_alive(pid):
    """Whether process pid is running (someone else's included), asked without signalling it."""
    if WINDOWS:
        return _windows_process_alive(pid)
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: only the check
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, alive
        return True
    return True


def _windows_process_alive(pid):
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:
        return ctypes.get_last_error() == 5  # ERROR_ACCESS_DENIED: there, and someone else's
    try:
        code = ctypes.c_ulong()
        return bool(kernel32.GetExitCodeProcess(handle, ctypes.byref(code))) and code.value == 259  # STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


def memory_bytes():
    """The machine's physical memory in bytes, or None where it cannot be read."""
    if WINDOWS:
        return _windows_memory_bytes()
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _windows_memory_bytes():
    class MemoryStatus(ctypes.Structure):  # MEMORYSTATUSEX
        _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong), ("total", ctypes.c_ulonglong),
                    ("rest", ctypes.c_ulonglong * 6)]  # avail, page, avail_page, virt, avail_virt, avail_ext
    status = MemoryStatus(length=ctypes.sizeof(MemoryStatus))
    return status.total if ctypes.WinDLL("kernel32").GlobalMemoryStatusEx(ctypes.byref(status)) else None


def keep_freed_memory():
    """Tells glibc's malloc to keep freed memory for the next allocation; False off glibc. By default it gives
    large blocks back, and each CPU step faults them in again, zeroed: 10% of the classic step (docs/results.md)."""
    if not LINUX or platform.libc_ver()[0] != "glibc":
        return False
    # M_MMAP_THRESHOLD (-3) to 32 MiB, M_TRIM_THRESHOLD (-1) to 1 GiB (<malloc.h>); either stops glibc's adjusting.
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(-3, 32 << 20) and mallopt(-1, 1 << 30))


def process_age():
    """Seconds since this process started (a budget counts Python's start-up): from /proc, else since this import."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat, open("/proc/uptime", encoding="ascii") as uptime:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: start time since boot
            seconds_up = float(uptime.read().split()[0])
        return max(0.0, seconds_up - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time() - _IMPORTED


def sync_directory(path):
    """Makes a rename or a new name in directory path durable; on Windows its file system journals it itself."""
    if WINDOWS:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange(a, b):
    """Swaps directories a and b atomically (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    if not LINUX:
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):  # a C library older than glibc 2.28, or none to ask
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # the kernel or the file system lacks it
        return False
    raise OSError(err, os.strerror(err), str(b))
