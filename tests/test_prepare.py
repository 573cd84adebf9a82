"""prepare.py: text in, token bins and meta.json out; every bad input is one
`error:` line, exit 2, and leaves what was on disk as it was."""

import errno
import functools
import hashlib
import http.server
import json
import os
import socket
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

import prepare
from config import UserError
from tinygpt import textfiles
from tinygpt.tokenizer import tokenizer_from_meta

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
needs_shakespeare = pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} not present")


def sample_text():
    """Tiny Shakespeare when present, else a generated text with some non-ASCII in it."""
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_text(encoding="utf-8")
    lines = ["First Citizen:", "Before we proceed any further, hear me speak.", "Ça va? Ωμέγα — naïve café 🙂"]
    return "".join(f"{lines[i % 3]} {i}\n" for i in range(20000))


def snapshot(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(directory).iterdir())}


def load_split(out_dir, split, meta):
    data = np.memmap(Path(out_dir) / f"{split}.bin", dtype=np.dtype(meta["dtype"]), mode="r")
    assert len(data) == meta[f"{split}_tokens"]
    return data


def assert_one_error_line(capsys, *fragments):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err
    return err


# --- Good input ---------------------------------------------------------------------


def test_bins_decode_back_to_the_whole_text(tmp_path):
    text = sample_text()
    (tmp_path / "input.txt").write_text(text, encoding="utf-8")
    assert prepare.main(["--input", str(tmp_path / "input.txt"), "--out_dir", str(tmp_path / "out")]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text(encoding="utf-8"))
    tokenizer = tokenizer_from_meta(meta)
    train, val = load_split(tmp_path / "out", "train", meta), load_split(tmp_path / "out", "val", meta)
    assert len(train) + len(val) == len(text)  # one token per character
    assert len(val) == len(text) - int(len(text) * 0.9)
    assert tokenizer.decode(train.tolist()) + tokenizer.decode(val.tolist()) == text
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert meta["vocab"] == sorted(set(text)) and meta["vocab_size"] == len(set(text))
    assert meta["sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "train.bin", "val.bin"]


@needs_shakespeare
def test_tiny_shakespeare_gives_the_known_figures(tmp_path, capsys):
    assert prepare.main(["--input", str(SHAKESPEARE), "--out_dir", str(tmp_path)]) == 0
    meta = json.loads((tmp_path / "meta.json").read_text(encoding="utf-8"))
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (65, 1_003_854, 111_540)
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "char"
    assert meta["sha256"] == textfiles.SHAKESPEARE_SHA256
    assert (tmp_path / "train.bin").stat().st_size == 2 * 1_003_854
    assert (tmp_path / "val.bin").stat().st_size == 2 * 111_540
    assert "vocabulary of 65" in capsys.readouterr().out


def test_preparing_again_replaces_the_data_set(tmp_path):
    (tmp_path / "a.txt").write_text("abc" * 100)
    (tmp_path / "b.txt").write_text("xyz" * 50)
    out = str(tmp_path / "out")
    assert prepare.main(["--input", str(tmp_path / "a.txt"), "--out_dir", out]) == 0
    assert prepare.main(["--input", str(tmp_path / "b.txt"), "--out_dir", out]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["vocab"] == ["x", "y", "z"] and meta["train_tokens"] + meta["val_tokens"] == 150


# --- Bad input ------------------------------------------------------------------------


def write(path, content):
    Path(path).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(path)


# (case, args given tmp_path, fragments the message contains)
BAD_INPUTS = [
    ("missing file", lambda d: ["--input", str(d / "nope.txt")], ["nope.txt", "not found"]),
    ("empty file", lambda d: ["--input", write(d / "empty.txt", "")], ["empty"]),
    ("not UTF-8", lambda d: ["--input", write(d / "latin1.txt", "abc\xe9def".encode("latin-1"))],
     ["UTF-8", "offset 3"]),
    ("too short for a val split", lambda d: ["--input", write(d / "short.txt", "ab")], ["too few"]),
    ("val_fraction 0", lambda d: ["--input", write(d / "ok.txt", "hello " * 100), "--val_fraction=0"],
     ["val_fraction"]),
    ("val_fraction 1", lambda d: ["--input", write(d / "ok.txt", "hello " * 100), "--val_fraction=1"],
     ["val_fraction"]),
    ("val_fraction negative", lambda d: ["--input", write(d / "ok.txt", "hello " * 100), "--val_fraction=-0.1"],
     ["val_fraction"]),
    ("val_fraction above 1", lambda d: ["--input", write(d / "ok.txt", "hello " * 100), "--val_fraction=1.5"],
     ["val_fraction"]),
    ("binary file", lambda d: ["--input", write(d / "blob.bin", bytes(range(256)) * 8)], ["binary", "offset 0"]),
    ("directory without text", lambda d: ["--input", str((d / "folder").resolve())], ["folder"]),
]


@pytest.fixture
def prepared(tmp_path):
    """An out_dir holding a good data set, which a failed run must leave alone."""
    out = tmp_path / "out"
    write(tmp_path / "good.txt", "a good text, long enough to split.\n" * 20)
    assert prepare.main(["--input", str(tmp_path / "good.txt"), "--out_dir", str(out)]) == 0
    (tmp_path / "folder").mkdir()
    return out


@pytest.mark.parametrize("case, args, fragments", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_error_line_and_leaves_out_dir_alone(prepared, tmp_path, capsys, case, args, fragments):
    before = snapshot(prepared)
    capsys.readouterr()
    assert prepare.main([*args(tmp_path), "--out_dir", str(prepared)]) == 2
    assert_one_error_line(capsys, *fragments)
    assert snapshot(prepared) == before


# (errno, what the message says to do): the cause, not a full disk, unless it is one
WRITE_FAILURES = [
    (errno.EROFS, "{out} or the directory it is in is not writable; get write permission, or pick another --out_dir"),
    (errno.EACCES, "{out} or the directory it is in is not writable; get write permission, or pick another --out_dir"),
    (errno.EPERM, "{out} or the directory it is in is not writable; get write permission, or pick another --out_dir"),
    (errno.EXDEV, "{out} is a mount point, which cannot be swapped for the new data set; pick another --out_dir, e.g. "
                  "a directory inside it"),
    (errno.EBUSY, "{out} is a mount point, which cannot be swapped for the new data set; pick another --out_dir, e.g. "
                  "a directory inside it"),
    (errno.ENOSPC, "free some space, or pick another --out_dir"),
    (errno.EDQUOT, "free some space, or pick another --out_dir"),
    (errno.ENOENT, "pick another --out_dir"),
    (errno.EIO, "pick another --out_dir"),
]


@pytest.mark.parametrize("code, fix", WRITE_FAILURES, ids=[errno.errorcode[c] for c, _ in WRITE_FAILURES])
def test_a_failed_swap_names_its_cause_and_leaves_out_dir_alone(prepared, tmp_path, monkeypatch, capsys, code, fix):
    def refuse(stage, target, replaced):
        raise OSError(code, os.strerror(code), str(target))

    monkeypatch.setattr(prepare, "swap_in", refuse)
    before = snapshot(prepared)
    capsys.readouterr()
    assert prepare.main(["--input", write(tmp_path / "new.txt", "another text " * 50), "--out_dir", str(prepared)]) == 2
    full = code in (errno.ENOSPC, errno.EDQUOT)
    cause = "no space left on device writing" if full else "cannot write"
    what = f"{prepared}" if full else f"{prepared} ({os.strerror(code)})"
    assert capsys.readouterr().err == (f"error: {cause} {what}; the data set there is as it was: "
                                       f"{fix.format(out=prepared)}\n")
    assert snapshot(prepared) == before


@needs_shakespeare
def test_a_download_into_a_read_only_out_dir_names_the_cause(serve, tmp_path, monkeypatch, capsys):
    def read_only(path, content):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(textfiles, "write_atomic", read_only)
    out = tmp_path / "out"
    assert prepare.main(["--url", serve("input.txt", SHAKESPEARE.read_bytes()), "--out_dir", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: cannot write {out} (Read-only file system); the data set there is as "
                                       f"it was: {out} or the directory it is in is not writable; get write "
                                       "permission, or pick another --out_dir\n")


def test_preparing_again_keeps_the_data_directorys_mode_and_owner(tmp_path):
    out = tmp_path / "out"
    args = ["--input", write(tmp_path / "a.txt", "abc" * 100), "--out_dir", str(out)]
    assert prepare.main(args) == 0
    out.chmod(0o750)
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    if root:  # only root may give a directory away
        os.chown(out, 1234, 5678)
    assert prepare.main(args) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert not root or (out.stat().st_uid, out.stat().st_gid) == (1234, 5678)


def test_bad_byte_offset_counts_from_the_start_of_the_file(tmp_path, monkeypatch, capsys):
    # Read in 7-byte pieces, so the bad byte lies many reads in and characters straddle reads.
    monkeypatch.setattr(textfiles, "CHUNK_BYTES", 7)
    data = "é".encode() * 500 + b"\xff" + b"tail"
    assert prepare.main(["--input", write(tmp_path / "x.txt", data), "--out_dir", str(tmp_path / "out")]) == 2
    assert_one_error_line(capsys, "offset 1000", "0xff")


# --- Downloading Tiny Shakespeare -----------------------------------------------------


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def serve(tmp_path):
    """serve(name, data) -> the URL of data on a local HTTP server."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()

    def url_of(name, data):
        (root / name).write_bytes(data)
        return f"http://127.0.0.1:{server.server_address[1]}/{name}"

    yield url_of
    server.shutdown()
    server.server_close()


def unused_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_shakespeare
def test_download_saves_the_checked_file_and_prepares_it(serve, tmp_path, capsys):
    url = serve("input.txt", SHAKESPEARE.read_bytes())
    out = tmp_path / "out"
    assert prepare.main(["--url", url, "--out_dir", str(out)]) == 0
    assert (out / "input.txt").read_bytes() == SHAKESPEARE.read_bytes()
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (65, 1_003_854, 111_540)
    # Once there, the file is not fetched again: a second run works with no server at all.
    assert prepare.main(["--url", f"http://127.0.0.1:{unused_port()}/x", "--out_dir", str(out)]) == 0


def test_download_with_the_wrong_checksum_saves_nothing(serve, tmp_path, capsys):
    url = serve("input.txt", b"To be, or not to be: not the file you wanted.\n" * 100)
    out = tmp_path / "out"
    assert prepare.main(["--url", url, "--out_dir", str(out)]) == 2
    assert_one_error_line(capsys, "sha256", "nothing was saved")
    assert not (out / "input.txt").exists()
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(UserError, match="sha256"):
        textfiles.download_shakespeare(url, tmp_path / "direct" / "input.txt")
    assert not (tmp_path / "direct").exists()


@pytest.mark.parametrize("where", ["no server", "no such file"])
def test_download_failure_says_to_pass_input(serve, tmp_path, capsys, where):
    url = f"http://127.0.0.1:{unused_port()}/input.txt" if where == "no server" else serve("a.txt", b"x") + "nope"
    assert prepare.main(["--url", url, "--out_dir", str(tmp_path / "out")]) == 2
    assert_one_error_line(capsys, "could not download", "--input")
    assert not (tmp_path / "out" / "input.txt").exists()


def test_default_out_dir_is_named_after_the_input(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "notes.txt", "some notes of mine\n" * 10)
    assert prepare.main(["--input", "notes.txt"]) == 0
    assert (tmp_path / "data" / "notes_char" / "meta.json").is_file()


def test_tiny_shakespeare_under_any_name_goes_where_the_presets_look(tmp_path, monkeypatch):
    # Stands in for Tiny Shakespeare: the test must not need the 1 MB file.
    data = b"To be, or not to be\n" * 50
    monkeypatch.setattr(textfiles, "SHAKESPEARE_BYTES", len(data))
    monkeypatch.setattr(textfiles, "SHAKESPEARE_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "input.txt").write_bytes(data)
    (tmp_path / "other.txt").write_bytes(data[:-1] + b"?")  # same size, another text
    assert prepare.main(["--input", "input.txt"]) == 0
    assert prepare.main(["--input", "other.txt"]) == 0
    assert (tmp_path / "data" / "shakespeare_char" / "meta.json").is_file()
    assert (tmp_path / "data" / "other_char" / "meta.json").is_file()
    assert not (tmp_path / "data" / "input_char").exists()
