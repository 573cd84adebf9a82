"""A run's out_dir: one run at a time, and a log that is never half a line.

    lock        held (flock) by the run writing here, and holding its pid; a second
                run into the same out_dir stops with an error naming that pid
    log.jsonl   one JSON record a line, each appended whole; cut back to the
                checkpoint's iteration when a run resumes
"""

import contextlib
import fcntl
import json
import os
from pathlib import Path

from config import UserError
from tinygpt.files import append_line, write_atomic, write_error

LEFT_BY_A_KILL = ("ckpt.pt.tmp", "best.pt.tmp", "log.jsonl.tmp", "wall_time.json.tmp")





class RunLock:
    """out_dir/lock, held from acquire() to release(). The kernel lets go of an flock when
    its process dies, however it dies, so the lock of a killed run is simply taken over.
    The file itself stays: deleting a locked file would let a third run lock a new one."""

    def __init__(self, out_dir):
        self.out_dir, self.fd = Path(out_dir), None

    def check_free(self):
        """A UserError if another run holds the lock now; reads, and writes nothing."""
        try:
            fd = os.open(self.out_dir / "lock", os.O_RDONLY)
        except OSError:  # no lock file, no run
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self.in_use(fd) from None
        finally:
            os.close(fd)

    def in_use(self, fd):
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        return UserError(f"{self.out_dir} is in use by another run (pid {holder}); wait for it to end, "
                         "or pick another --out_dir")

    def acquire(self):
        """Takes the lock, or raises a UserError naming the run that holds it."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.out_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"cannot write to out_dir {self.out_dir} ({e.strerror}); pick another --out_dir") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            error = self.in_use(self.fd)
            self.release()
            raise error from None
        with contextlib.suppress(OSError):  # the pid is for the message above; a full disk must not stop us
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        for name in LEFT_BY_A_KILL:  # half-written by a run killed while saving; ours to remove now
            (self.out_dir / name).unlink(missing_ok=True)

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # closing lets go of the lock
            self.fd = None


def append_record(out_dir, record):
    """Adds one record to out_dir/log.jsonl, whole; a failed write (a full disk) is a UserError."""
    path = Path(out_dir) / "log.jsonl"
    try:
        append_line(path, json.dumps(record))
    except OSError as e:
        kept = "the last checkpoint is kept" if (Path(out_dir) / "ckpt.pt").exists() else "nothing was saved"
        raise UserError(f"{write_error(path, e)}; {kept} and the log is whole: free some space and continue "
                        "with --init_from=resume") from None


def start_log(out_dir, start_iter):
    """Cuts log.jsonl back to start_iter's records (to nothing for a new run), so a resumed
    run's log reads like an uninterrupted one. A last line that a kill cut short is dropped."""
    path = Path(out_dir) / "log.jsonl"
    kept = []
    if start_iter > 0 and path.exists():
        lines = path.read_bytes().decode("utf-8", "replace").removesuffix("\n").split("\n")
        for n, line in enumerate(lines, 1):
            try:
                it = json.loads(line)["iter"]
            except (ValueError, TypeError, KeyError):
                if n == len(lines):  # the last line: written part way when the run stopped
                    break
                raise UserError(f"{path} line {n} is not a log record; delete that line and resume again") from None
            if it <= start_iter:
                kept.append(line)
    try:
        write_atomic(path, "".join(line + "\n" for line in kept).encode("utf-8"))
    except OSError as e:
        raise UserError(f"{write_error(path, e)}; nothing was changed: free some space, or pick another --out_dir") \
            from None
