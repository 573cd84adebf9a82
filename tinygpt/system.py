"""What differs between Linux, macOS and Windows, in one place, so the rest reads the same everywhere.

    FileLock           one process at a time: flock (Linux, macOS), msvcrt (Windows), or else a lock
                       file holding its owner's pid, taken over once that process is gone
    process_alive      whether a pid runs, asked without a signal (on Windows os.kill(pid, 0) ends it)
    stop_signals       the signals that ask a run to stop: SIGINT, SIGTERM, and SIGHUP where there is one
    memory_bytes       the machine's physical memory
    sync_directory     a rename made durable (fsync of its directory; Windows has none to make)
    exchange           two directories swapped in one step (Linux's renameat2), else False
    keep_freed_memory  glibc's malloc asked to keep freed memory for the next step (Linux)
    process_age        seconds since this process started (Linux reads /proc; elsewhere since import)
    peak_rss           the most memory this process has held
"""

import contextlib
import ctypes
import errno
import os
import platform
import signal
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:  # everywhere but Windows
    msvcrt = None

WINDOWS = sys.platform == "win32"
LINUX = sys.platform.startswith("linux")
LOCKS = ("flock", "msvcrt", "pidfile")
_IMPORTED = time.time()


# --- Locks and processes -------------------------------------------------------------------------


class FileLock:
    """An exclusive lock on the file at path, held from acquire() to release(), whose file holds its
    owner's pid (holder()). flock and msvcrt locks are let go by the system when their process dies,
    however it dies. A pidfile lock is the file itself, created only if absent; one whose pid no longer
    runs is removed and taken (two runs doing so at the same moment could both win: it is the last resort)."""

    MSVCRT_BYTE = 1 << 30  # msvcrt locks bytes against reading too: this one, past the pid, is the lock

    def __init__(self, path, kind=None):
        self.path, self.fd = Path(path), None
        self.kind = kind or ("flock" if fcntl else "msvcrt" if msvcrt else "pidfile")

    def acquire(self):
        """True once held; False if another process holds it. An OSError if the file cannot be made."""
        if self.kind == "pidfile":
            return self._create()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not self._lock(fd):
            os.close(fd)
            return False
        self.fd = fd
        with contextlib.suppress(OSError):  # the pid is for messages: a full disk must not stop the run
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, f"{os.getpid()}\n".encode())
        return True

    def held_elsewhere(self):
        """Whether another process holds the lock now; reads, and writes nothing."""
        if self.kind == "pidfile":
            pid = self.holder()
            return pid.isdigit() and int(pid) != os.getpid() and process_alive(int(pid))
        try:
            fd = os.open(self.path, os.O_RDWR if self.kind == "msvcrt" else os.O_RDONLY)
        except OSError:  # no lock file, no run
            return False
        try:
            held = not self._lock(fd, shared=True)
            if not held and self.kind == "msvcrt":
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
            return held
        finally:
            os.close(fd)

    def holder(self):
        """The pid written in the lock file, as text; "" if there is none to read."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return ""
        try:
            return os.read(fd, 32).decode("ascii", "replace").strip()
        except OSError:
            return ""
        finally:
            os.close(fd)

    def release(self):
        if self.fd is None:
            return
        if self.kind == "pidfile":
            with contextlib.suppress(OSError):
                self.path.unlink()
        elif self.kind == "msvcrt":
            with contextlib.suppress(OSError):
                os.lseek(self.fd, self.MSVCRT_BYTE, os.SEEK_SET)
                msvcrt.locking(self.fd, msvcrt.LK_UNLCK, 1)
        os.close(self.fd)  # closing also lets go of an flock
        self.fd = None

    def _lock(self, fd, shared=False):
        """Locks the open file fd without waiting; False if another process holds it."""
        if self.kind == "flock":
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True
        os.lseek(fd, self.MSVCRT_BYTE, os.SEEK_SET)  # msvcrt locks at the file's position
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

    def _create(self):
        for _ in range(2):  # once, and once more after taking a dead owner's file away
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if self.held_elsewhere():
                    return False
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()  # its owner is gone
                continue
            self.fd = fd
            os.write(fd, f"{os.getpid()}\n".encode())
            return True
        return False


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


def stop_signals():
    """SIGINT (Ctrl-C), SIGTERM, and SIGHUP (a closed terminal) where the system has it (not Windows)."""
    return tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


# --- Memory -------------------------------------------------------------------------------------


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
        _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong)] + [
            (name, ctypes.c_ulonglong) for name in ("total", "avail", "page", "avail_page", "virt", "avail_virt",
                                                     "avail_ext")]
    status = MemoryStatus(length=ctypes.sizeof(MemoryStatus))
    return status.total if ctypes.WinDLL("kernel32").GlobalMemoryStatusEx(ctypes.byref(status)) else None


def keep_freed_memory(mmap_threshold=32 << 20, trim_threshold=1 << 30):
    """Tells glibc's malloc to keep freed memory for the next allocation instead of handing it
    back to the system. Returns whether it could (False off glibc: nothing to do).

    A CPU training step frees and reallocates the same activations every step. By default glibc
    gives large freed blocks back (munmap, or trimming the heap), and the next step faults each
    page in again, zeroed by the kernel: a mul after a 1536 x 512 matmul took 400 us where 90 were
    the arithmetic, and the classic preset's step 10% longer. Allocations up to mmap_threshold
    now come from the heap, which is trimmed only past trim_threshold of free memory at its top:
    the process keeps its peak, as it would hold it during the steps anyway.
    """
    if not LINUX or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>; either one also stops glibc's own adjusting
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))


def peak_rss():
    """The most memory this process has held in RAM, in bytes; None where the system does not say."""
    try:
        import resource
    except ImportError:  # Windows has no getrusage
        return None
    kilobytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes, not kilobytes, on macOS
    return kilobytes * (1 if sys.platform == "darwin" else 1024)


def process_age():
    """Seconds since this process started: a time budget counts Python's start-up too. Linux says
    when the process started (/proc); elsewhere the clock starts when this module is imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time since boot
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time() - _IMPORTED


# --- Directories ------------------------------------------------------------------------------------

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def sync_directory(path):
    """Makes a rename or a new name in directory path durable (a power cut keeps it). Windows opens
    no directory as a file; its file system journals the rename itself."""
    if WINDOWS:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange(a, b):
    """Swaps directories a and b in one step (Linux renameat2 RENAME_EXCHANGE): at every
    moment each name holds one whole directory. False where the system cannot do it."""
    if not LINUX:
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):  # a C library older than glibc 2.28, or none to ask
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # the kernel or the file system lacks it
        return False
    raise OSError(err, os.strerror(err), str(b))
