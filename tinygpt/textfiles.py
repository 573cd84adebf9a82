"""Reading the text files a user gives prepare.py (or Tiny Shakespeare, downloaded), so that a bad one is one
clear error line."""

import codecs
import hashlib
import stat
import urllib.request
from pathlib import Path

from tqdm import tqdm

from config import UserError
from tinygpt.files import check_path, write_atomic

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_BYTES = 1_115_394
CHUNK_BYTES = 1 << 23  # read and encode 8 MiB at a time


# Byte order marks of the encodings other than UTF-8 that a text comes in; UTF-32 LE's begins as UTF-16 LE's does.
BOMS = [(codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
        (codecs.BOM_UTF16_BE, "UTF-16")]


def read_text(path, option):
    """The whole text of the file at path, given as option (--start): read as prepare.py reads its inputs."""
    check_path(path, option)
    return "".join(read_chunks(path, what=f"{option} file"))


def read_chunks(path, hasher=None, bar=None, shown=None, what="input file", notes=None):
    r"""Yields the text of a UTF-8 file piece by piece, as every script reads a text: a byte order mark at its start
    dropped, \r\n and \r read as \n as Python reads text (noted in the set notes, if given). The UserError for a NUL
    byte, another encoding or invalid UTF-8 gives its offset in the file, also when a character's bytes are split
    between two reads. shown: the file's name in messages (that of the pipe a spooled copy came from); what: what the
    file is, in messages."""
    shown = Path(shown or path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise UserError(f"{what} {shown} not found") from None
    except OSError as e:  # a directory, say, or no permission
        raise UserError(f"cannot read {what} {shown} ({e.strerror}); pass a readable text file") from None
    decoder, offset, held = codecs.getincrementaldecoder("utf-8")(), 0, ""
    with f:
        while data := f.read(CHUNK_BYTES):
            check_encoding(data, offset, shown, what)
            bom = len(codecs.BOM_UTF8) if offset == 0 and data.startswith(codecs.BOM_UTF8) else 0
            text = held + decode(decoder, data[bom:], offset + bom, shown, what)
            text, held = (text[:-1], "\r") if text.endswith("\r") else (text, "")  # its \n may be in the next read
            if notes is not None and "\r" in text:
                notes.add("line endings \\r\\n and \\r read as \\n")
            offset += len(data)
            if hasher:
                hasher.update(data)
            if bar:
                bar.update(len(data))
            if text:  # empty when the read ended inside a character's bytes
                yield text.replace("\r\n", "\n").replace("\r", "\n")
        if offset == 0:
            raise UserError(f"{what} {shown} is empty; pass a file with some text in it")
        decode(decoder, b"", offset, shown, what, final=True)  # a character cut off by the end of the file
        if held:
            yield "\n"


def check_encoding(data, offset, shown, what):
    """A UserError if data, read at offset from a file, shows it is no UTF-8 text: UTF-16 or UTF-32 (by the byte
    order mark at its start, or ASCII's every other byte 0), which to its writer is text: say how to convert it; else
    binary (a NUL byte)."""
    head = data[:1024] if offset == 0 else b""
    encoding = next((name for bom, name in BOMS if head.startswith(bom)), None)
    for name, high, low in (("UTF-16LE", head[1::2], head[::2]), ("UTF-16BE", head[::2], head[1::2])):
        if not encoding and 0 not in low and high.count(0) > len(high) / 2:  # no mark, but most high bytes 0
            encoding = name
    if encoding:
        raise UserError(f"{what} {shown} is {encoding} text, not UTF-8; convert it: iconv -f {encoding} -t UTF-8 "
                        f"{shown} > {shown.with_stem(shown.stem + '-utf8')}")
    if b"\x00" in data:
        raise UserError(f"{what} {shown} looks binary (NUL byte at offset {offset + data.index(0)}); pass a text file")


def decode(decoder, data, offset, path, what, final=False):
    try:
        return decoder.decode(data, final=final)
    except UnicodeDecodeError as e:
        # e.start counts from the bytes the decoder held back from the last read.
        at = offset - len(decoder.getstate()[0]) + e.start
        raise UserError(f"{what} {path} is not valid UTF-8 (byte {e.object[e.start]:#04x} at offset {at}); "
                        "convert it, e.g. from Windows' encoding: iconv -f cp1252 -t utf-8") from None


def regular_files(files, stage):
    """(files, shown): each pipe, FIFO or /proc file among files (which may be read only once, and a /proc
    file says its size is 0) copied to a regular file in the directory stage, to be read twice; shown maps
    each copy to the name it came from."""
    files, shown = list(files), {}
    for i, path in enumerate(files):
        if stat.S_ISREG(path.stat().st_mode):
            continue
        try:
            src = open(path, "rb")
        except OSError as e:
            raise UserError(f"cannot read input file {path} ({e.strerror}); pass a readable text file") from None
        files[i] = stage / f"input{i}.spooled"
        shown[files[i]] = path
        with src, open(files[i], "wb") as out:
            while data := src.read(CHUNK_BYTES):
                check_encoding(data, out.tell(), path, "input file")  # /dev/urandom, say, would fill the disk
                out.write(data)
    return files, shown


def input_files(inputs):
    """The files to read, in order; a directory stands for its *.txt files, sorted."""
    files = []
    for name in inputs:
        check_path(name, "--input")
        name = Path(name)
        if name.is_dir():
            found = sorted(p for p in name.glob("*.txt") if p.is_file())
            if not found:
                raise UserError(f"input directory {name} has no .txt files; pass text files or a directory of them")
            files += found
        elif not name.exists():
            raise UserError(f"input file {name} not found")
        else:
            files.append(name)
    return files


def is_shakespeare(path):
    """Whether path is Tiny Shakespeare itself (only files of its size are hashed)."""
    size_matches = path.stat().st_size == SHAKESPEARE_BYTES
    return size_matches and hashlib.sha256(path.read_bytes()).hexdigest() == SHAKESPEARE_SHA256


def download_shakespeare(url, dest):
    """Fetches Tiny Shakespeare into dest unless it is already there; checks its sha256."""
    dest = Path(dest)
    if dest.is_file():
        return dest
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as e:  # URLError is one
        raise UserError(
            f"could not download Tiny Shakespeare from {url} ({getattr(e, 'reason', e)}); "
            "if you are offline, pass a text file of your own: python prepare.py --input FILE") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise UserError(
            f"the file downloaded from {url} has sha256 {digest[:12]}..., expected {SHAKESPEARE_SHA256[:12]}...; "
            "nothing was saved. Try again later, or pass --input FILE")
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(dest, data)  # an OSError is the caller's to explain
    print(f"downloaded Tiny Shakespeare to {dest}")
    return dest


def progress(total, desc):
    # No bar for what takes under a second (delay), nor when stderr is not a terminal (disable=None).
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, delay=1, disable=None)
