"""Writing files so that a failure, or a kill at any moment, loses nothing.

    write_atomic    a file replaced whole: written beside it, fsynced, renamed over it
    append_line     a line added whole: on failure the file is cut back to where it was
    staging_dir     a new directory beside another, to build its next version in
    swap_in         that version put in the other's place whole, in one step

Each raises the OSError that stopped it, after undoing its own partial work, so the
caller can say what failed (a full disk, no permission) and what was kept.
"""

import contextlib
import errno
import glob
import os
import shutil
from pathlib import Path

from tinygpt.system import exchange, process_alive, sync_directory


class _Recording:
    """A binary file whose write errors are kept: torch.save turns them into a RuntimeError
    that no longer says why (ENOSPC, EIO, ...), so the original is raised instead."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name):
        return getattr(self.f, name)


def write_atomic(path, content):
    """Writes path whole or not at all. content is bytes, or a function that writes to an
    open binary file (torch.save, savefig). It goes to path.tmp, which is fsynced and then
    renamed over path; on any failure (a full disk, Ctrl-C) path.tmp is removed and path
    is as it was."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            out = _Recording(f)
            try:
                content(out) if callable(content) else out.write(content)
            except RuntimeError:
                if out.error is None:
                    raise
                raise out.error from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def append_line(path, line):
    """Appends line (a str without its newline) to path, whole: if the write fails part
    way, the file is cut back to its size before, so no reader ever sees half a line."""
    data = memoryview((line + "\n").encode("utf-8"))
    with open(path, "ab", buffering=0) as f:  # unbuffered: nothing is left to be written at close
        size = f.seek(0, os.SEEK_END)
        try:
            while data:
                data = data[f.write(data) :]  # a write may take only part
        except BaseException:
            f.truncate(size)  # cutting back needs no space, so it works on a full disk too
            raise


def version(path):
    """What tells one version of a file from the next (write_atomic makes a new inode), or None."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        st = os.stat(path)
        return st.st_ino, st.st_mtime_ns, st.st_size
    return None


def write_error(path, e):
    """The first half of a message about OSError e while writing path."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on device writing {path}"
    return f"cannot write {path} ({e.strerror or e})"


# --- Whole directories ------------------------------------------------------------------


def _aside(target):
    """Where swap_in keeps the old directory when it has to swap in two steps."""
    return target.with_name(f".{target.name}.old")


def remove_stale(target):
    """Cleans up after processes killed inside staging_dir or swap_in: their staging
    directories go; an old directory left aside by a two-step swap goes back, or goes."""
    aside = _aside(target)
    if aside.is_dir() and not os.path.lexists(target):
        os.rename(aside, target)  # killed between swap_in's two renames: the old one, whole, returns
    shutil.rmtree(aside, ignore_errors=True)
    for stale in target.parent.glob(glob.escape(f".{target.name}.staging-") + "*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not process_alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def staging_dir(target):
    """A new, empty directory beside target (on the same file system, so swap_in can put it
    in target's place), removed when the block ends, however it ends. What killed
    processes left behind is removed first."""
    target = Path(os.path.realpath(target))  # beside the real directory, if target is a link to it
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target)
    stage = target.with_name(f".{target.name}.staging-{os.getpid()}")
    stage.mkdir()
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def swap_in(stage, target, replaced):
    """Puts the finished directory stage (from staging_dir) in target's place, keeping what
    else target held: its entries not named in `replaced` are linked into stage first. At
    every moment target holds the old version or the new, whole (Linux: RENAME_EXCHANGE;
    elsewhere two renames, and a kill between them is undone by the next remove_stale).
    The old version ends up at stage, and goes with it."""
    target = Path(os.path.realpath(target))
    if target.is_dir():
        link_tree(target, stage, skip=set(replaced))
    sync_directory(stage)
    if not os.path.lexists(target):
        os.rename(stage, target)
        stage.mkdir()  # so that staging_dir's cleanup finds what it expects
    elif not exchange(stage, target):
        os.rename(target, _aside(target))
        os.rename(stage, target)
        os.rename(_aside(target), stage)
    sync_directory(target.parent)


def link_tree(src, dst, skip=()):
    """Gives dst every entry of directory src (but the names in skip) without copying
    data: files are hard-linked (copied where linking fails), links and folders recreated."""
    for entry in os.scandir(src):
        if entry.name in skip:
            continue
        to = os.path.join(dst, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), to)
        elif entry.is_dir():
            os.mkdir(to)
            link_tree(entry.path, to)
        elif entry.is_file():
            try:
                os.link(entry.path, to)
            except OSError:  # another file system below, no permission to link, too many links
                shutil.copy2(entry.path, to)
        else:
            raise OSError(errno.EINVAL, "not a file, folder or link; move it out first", entry.path)
