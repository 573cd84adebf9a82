"""Where a script meets its operating system, and all that differs between Linux, macOS and Windows. In order:
what a script's main() meets (signals, output streams that close, the exit code), processes and memory,
directories. Every script imports it first."""

import contextlib
import ctypes
import errno
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


def interrupted(signum, frame):
    try:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every process gets it: one line
            os.write(2, b"interrupted\n" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}\n".encode())
    finally:
        os._exit(128 + signum)  # nothing has been written yet: there is nothing to clean up


def signal_name(signum):
    return signal.Signals(signum).name  # SIGTERM


def stop_signals():
    """SIGINT (Ctrl-C), SIGTERM, and SIGHUP (a closed terminal) where the system has it (not Windows)."""
    return tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


# While torch loads (seconds), Ctrl-C ends a script of ours with one line, not a traceback through the imports,
# until its main() starts (cli takes over). A test or program that imports a script keeps its own Ctrl-C.
_script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
_package = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(os.path.abspath(_script)) in (_package, os.path.dirname(_package)):  # ours, or python -m tinygpt.X
    for _signum in stop_signals():
        if signal.getsignal(_signum) in (signal.default_int_handler, signal.SIG_DFL):  # not one started ignored
            signal.signal(_signum, interrupted)


class Interrupted(KeyboardInterrupt):
    """A stop signal while main() runs (args: its number): ends main() as Ctrl-C does, its blocks cleaning up."""


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


def cli(main):
    """Wraps main(argv) -> exit code: a UserError is one line and exit 2, a stop signal one line and 128 + it, and
    a closed stdout or stderr stops the printing, not the work (Guarded). A script ignores a signal after main()."""

    def wrapper(argv=None):
        ours = [s for s in stop_signals() if signal.getsignal(s) is interrupted]  # a script's: set at its import
        for s in ours:
            signal.signal(s, raise_interrupted)
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
            for s in ours:
                signal.signal(s, signal.SIG_IGN)
            sys.stdout.flush()  # while still guarded: the pipe may be gone
            sys.stderr.flush()
            sys.stdout, sys.stderr = saved

    return wrapper


def exit(code):
    """Ends the script with `code` once its output is out, skipping Python's clean-up (0.5-0.9 s freeing torch, an
    abort under torchrun: docs/results.md), unless a tracer or profiler that reports at the exit runs (coverage)."""
    if "RANK" not in os.environ and (sys.gettrace() or sys.getprofile()):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed stdout: nothing more to say
            stream.flush()
    os._exit(code)


class Stopped(BaseException):
    """A stop signal in an evaluation, which only reads: it ends there (a BaseException, as KeyboardInterrupt)."""


class Stop:
    """While active, a stop signal asks the run to stop and a second ends it. Before the loop (no `model`) one ends
    it as Ctrl-C does. In the loop it sets `signum`: the step ends, saves, exits so; an evaluation gets Stopped."""

    def __enter__(self):
        self.signum, self.model = None, None
        self.previous = {s: signal.signal(s, self.handle) for s in stop_signals()}
        return self

    def handle(self, signum, frame):
        if self.model is not None and self.signum is None:
            self.signum = signum
            if not self.model.training:
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


def cache_dir():
    """This user's cache directory for the project: what a run remembers of this machine between runs."""
    home = os.path.expanduser("~")
    if WINDOWS:
        base = os.environ.get("LOCALAPPDATA") or os.path.join(home, "AppData", "Local")
    elif sys.platform == "darwin":
        base = os.path.join(home, "Library", "Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return os.path.join(base, "tinygpt")


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
