"""msvcrt's locking as Windows documents it, on Linux's record locks, for tests/test_platforms.py: a byte
range locked by one process, released when that process closes the file or dies; LK_NBLCK fails at once
with an OSError while another process holds the range."""

import fcntl
import os

LK_UNLCK, LK_NBLCK = 0, 2


def locking(fd, mode, nbytes):
    op = fcntl.LOCK_UN if mode == LK_UNLCK else fcntl.LOCK_EX | fcntl.LOCK_NB
    try:
        fcntl.lockf(fd, op, nbytes, os.lseek(fd, 0, os.SEEK_CUR), os.SEEK_SET)
    except BlockingIOError:
        raise PermissionError(13, "Permission denied") from None
