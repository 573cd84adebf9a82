"""A run's out_dir: one run at a time, and a log that is never half a line.

    lock        held by the run writing here, and holding its pid; a second
                run into the same out_dir stops with an error naming that pid
    log.jsonl   one JSON record a line, each appended whole; cut back to the
                checkpoint's iteration when a run resumes
"""

import json
from pathlib import Path

from config import UserError
from tinygpt.files import append_line, write_atomic, write_error
from tinygpt.system import FileLock

LEFT_BY_A_KILL = ("ckpt.pt.tmp", "best.pt.tmp", "log.jsonl.tmp", "wall_time.json.tmp")





class RunLock:
    """out_dir/lock, held from acquire() to release() (tinygpt.system.FileLock: the platform's own file
    lock, let go by the system when its process dies however it dies, so a killed run's lock is simply
    taken over). The file itself stays: deleting a locked file would let a third run lock a new one."""

    def __init__(self, out_dir, kind=None):
        self.out_dir, self.lock = Path(out_dir), FileLock(Path(out_dir) / "lock", kind)

    def check_free(self):
        """A UserError if another run holds the lock now; reads, and writes nothing."""
        if self.lock.held_elsewhere():
            raise self.in_use()

    def in_use(self):
        return UserError(f"{self.out_dir} is in use by another run (pid {self.lock.holder() or 'unknown'}); wait "
                         "for it to end, or pick another --out_dir")

    def acquire(self):
        """Takes the lock, or raises a UserError naming the run that holds it."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            taken = self.lock.acquire()
        except OSError as e:
            raise UserError(f"cannot write to out_dir {self.out_dir} ({e.strerror}); pick another --out_dir") from None
        if not taken:
            raise self.in_use()
        for name in LEFT_BY_A_KILL:  # half-written by a run killed while saving; ours to remove now
            (self.out_dir / name).unlink(missing_ok=True)

    def release(self):
        self.lock.release()


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
