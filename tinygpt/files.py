"""The paths a user gives, each checked once before it is used (check_path); and writing files so that a failure, or a
kill at any moment, loses nothing: a file replaced whole, a line appended whole, a directory swapped in whole. A
run's out_dir, one run at a time; its log, and the log's copies in TensorBoard and W&B (--log_to); its checkpoints,
loaded with weights_only=True: tensors and plain data, never code. Each function raises the OSError that stopped it,
after undoing its own partial work, so the caller can say what failed (a full disk, no permission) and what was kept.
"""

import contextlib
import dataclasses
import errno
import glob
import importlib
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import filelock
import numpy as np
import torch
from tqdm import tqdm

from config import UserError
from tinygpt.system import exchange, process_alive, sync_directory


def check_path(path, option, directory=False):
    """A UserError, naming option (--out_dir), for a path no file can be at: a name too long, a loop of symbolic
    links, a file above it (or at it, where directory). Missing is fine. Called once, before the path is used: what
    fails later (no permission, a full disk) is said where it fails."""
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode) and directory:  # stat first: it raises for what no file can be
            raise UserError(f"{option}={path} is a file, not a directory; pick another {option}")
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:  # ValueError: a NUL character, which a TOML preset can hold
        shown = path if path.isprintable() else repr(path)[1:-1]  # a newline or a NUL in it, shown as \n, \x00
        shown = shown if len(shown) <= 200 else f"{shown[:100]}... ({len(path):,} characters)"
        code = getattr(e, "errno", None)
        above = next((p for p in Path(path).parents if p.is_file()), None) if code == errno.ENOTDIR else None
        why = {errno.ENAMETOOLONG: "is too long a name", errno.ELOOP: "is a loop of symbolic links",
               errno.ENOTDIR: f"is inside {above}, which is a file" if above else "is a file, not a directory",
               }.get(code, f"cannot be used ({getattr(e, 'strerror', None) or e})")
        raise UserError(f"{option}={shown} {why}; pick another {option}") from None


def write_atomic(path, content):
    """Writes path whole or not at all: content (bytes, or a function that writes to an open binary file: torch.save,
    savefig) goes to path.tmp, fsynced, renamed over path; on any failure (a full disk, Ctrl-C) path.tmp goes."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            content(f) if callable(content) else f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, RuntimeError) and isinstance(e.__context__, OSError):  # torch.save wraps ENOSPC, EIO, ...
            raise e.__context__ from None
        raise


def load_tensors(path, what, damaged, unsafe, device="cpu"):
    """torch.load(path, weights_only=True): tensors and plain data, never code. A UserError for a file that
    holds other objects (which unpickling would run: the fix `unsafe` says), or that is no whole torch.save
    zip archive (`what` it should be, and the fix `damaged` says)."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
        if zipped and type(e).__name__ == "UnpicklingError":  # weights_only met something other than plain data
            raise UserError(f"{path} holds objects other than tensors and plain data, which could run code when "
                            f"loaded; refused. {unsafe}") from None
        problem = "is truncated or damaged" if zipped else f"is not {what} (torch.save writes a zip archive)"
        raise UserError(f"{path} {problem}; {damaged}") from None


def write_error(path, e):
    """The first half of a message about OSError e while writing path."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on device writing {path}"
    return f"cannot write {path} ({e.strerror or e})"


# --- Whole directories ------------------------------------------------------------------


def _aside(target):
    """Where swap_in keeps the old directory when it has to swap in two steps."""
    return target.with_name(f".{target.name}.old")


def remove_tree(path):
    """Removes the directory tree at path, if there is one, read-only directories in it included (an old export
    of mode 555, swapped out by swap_in), as far as this user may."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)  # its entries can go only from a directory this user may write
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)


def remove_stale(target):
    """Cleans up after processes killed inside staging_dir or swap_in: their staging
    directories go; an old directory left aside by a two-step swap goes back, or goes."""
    aside = _aside(target)
    if aside.is_dir() and not os.path.lexists(target):
        os.rename(aside, target)  # killed between swap_in's two renames: the old one, whole, returns
    remove_tree(aside)
    for stale in target.parent.glob(glob.escape(f".{target.name}.staging-") + "*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not process_alive(int(pid))):
            remove_tree(stale)


@contextlib.contextmanager
def staging_dir(target):
    """A new, empty directory beside target (on its file system, so swap_in can put it in target's place), removed
    when the block ends, however it ends. What killed processes left behind is removed first."""
    target = Path(os.path.realpath(target))  # beside the real directory, if target is a link to it
    if Path.cwd().is_relative_to(target):  # ".", "/": the shell in it would be left in the old one, deleted
        raise UserError(f"{target} holds the directory this runs in, which swapping in a new one would delete under "
                        "you; pick another directory, or run from elsewhere")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target)
    stage = target.with_name(f".{target.name}.staging-{os.getpid()}")
    stage.mkdir()
    try:
        yield stage
    finally:
        remove_tree(stage)


def swap_in(stage, target, replaced, replace=True):
    """Puts the finished directory stage (from staging_dir) in target's place, with what else target held: its owner,
    mode, and the entries not named in `replaced` (linked into stage). At every moment target holds the old version or
    the new, whole (Linux: RENAME_EXCHANGE; elsewhere two renames, a kill between them undone by remove_stale); the old
    one ends up at stage. replace=False: FileExistsError if target exists by then, and nothing moves."""
    target = Path(os.path.realpath(target))
    if replace and target.is_dir():
        link_tree(target, stage, skip=set(replaced))
        with contextlib.suppress(OSError, AttributeError):  # its owner, where allowed (root; Windows has no chown)
            os.chown(stage, (old := target.stat()).st_uid, old.st_gid)
        shutil.copymode(target, stage)  # and its mode (chmod 750), which a new directory would lack
    sync_directory(stage)
    if not replace or not os.path.lexists(target):
        try:
            os.rename(stage, target)  # fails where target is there and not empty (Windows: there at all)
        except OSError as e:
            if not replace and (e.errno in (errno.EEXIST, errno.ENOTEMPTY) or os.path.lexists(target)):
                raise FileExistsError(errno.EEXIST, "made by another process meanwhile", str(target)) from None
            raise
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


# --- Data sets -------------------------------------------------------------------------------------
# A prepared data set as prepare.py writes it and train.py reads it (load_data: a damaged or hand-edited one is
# one error line at the start of a run, not a crash at its end):
#
#   meta.json   {"format": 1, "tokenizer": "char", "vocab": [...], "vocab_size": 65,
#                "dtype": "uint16", "train_tokens": N, "val_tokens": M, ...}
#                ("tiktoken" data sets name an "encoding" instead of listing a vocab)
#   train.bin   train_tokens ids, each below vocab_size, in dtype
#   val.bin     val_tokens ids, likewise

META_FORMAT = 1
DATASET_FILES = ("train.bin", "val.bin", "meta.json")  # what prepare.py writes; a new data set replaces these alone
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}  # the ids' types, by name


def tokenizer_problem(meta):
    """What is wrong with the tokenizer that meta describes, or None: a meta.json's object, or a checkpoint's copy of
    one (which may lack the counts)."""
    if meta.get("tokenizer") == "char":
        vocab = meta.get("vocab")
        if type(vocab) is not list or not all(type(ch) is str and len(ch) == 1 for ch in vocab) \
                or not len(set(vocab)) == len(vocab) == meta.get("vocab_size", len(vocab)):
            return f"vocab must be a list of vocab_size ({meta.get('vocab_size')}) different single characters"
    elif meta.get("tokenizer") == "tiktoken":
        if not isinstance(meta.get("encoding"), str) or not meta["encoding"]:
            return f"encoding must name a tiktoken encoding, got {meta.get('encoding')!r}"
    else:
        return f"tokenizer must be char or tiktoken, got {meta.get('tokenizer')!r}"
    return None


def prepare_again(data_dir):
    """The command that makes data_dir; Tiny Shakespeare's needs no file (prepare.py downloads it)."""
    path, tokenizer = Path(data_dir), Path(data_dir).name.removeprefix("shakespeare_")
    if path.parent == Path("data") and path.name != tokenizer:
        return "python prepare.py" + ("" if tokenizer == "char" else f" --tokenizer {tokenizer}")
    return f"python prepare.py --input FILE --out_dir {data_dir}"


def load_data(data_dir):
    """(meta.json, the train and val splits as read-only memmaps), as prepare.py wrote them. Anything else (a file
    missing, cut short or edited, from newer code, an id at or past vocab_size: one fast pass) is a UserError saying
    how to prepare them again: a mistake met here, not at the end of a run."""
    path = Path(data_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        splits = {s: np.memmap(Path(data_dir) / f"{s}.bin", DTYPES[meta["dtype"]], "r") for s in ("train", "val")}
        if meta["format"] > META_FORMAT or tokenizer_problem(meta) \
                or any(len(ids) != meta[f"{s}_tokens"] or ids.max() >= meta["vocab_size"] for s, ids in splits.items()):
            raise ValueError
    except FileNotFoundError as e:
        raise UserError(f"{e.filename} not found; run: {prepare_again(data_dir)}") from None
    except PermissionError as e:
        raise UserError(f"cannot read {e.filename} ({e.strerror}); check its permissions") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable, not JSON, a field missing
        raise UserError(f"{data_dir} holds no data set as prepare.py writes it (meta.json, train.bin and val.bin, "
                        f"unchanged); prepare it again: {prepare_again(data_dir)}") from None
    return meta, splits


def check_block_size(splits, block_size, data_dir):
    """Each split must hold more than one window of block_size tokens and its next-token target."""
    for split, data in splits.items():
        if len(data) <= block_size:
            raise UserError(f"the {split} split of {data_dir} has {len(data)} tokens, not more than "
                            f"block_size {block_size}; lower --block_size or prepare a longer text")


# --- A run's out_dir ------------------------------------------------------------------------------


class RunLock:
    """out_dir/lock, held by the run writing into out_dir from acquire() to release(): a filelock (flock; Windows:
    msvcrt), which the system lets go of when its process dies, however it dies: a killed run's lock is taken over."""

    def __init__(self, out_dir):
        self.out_dir, self.made = Path(out_dir), None
        self.lock = filelock.FileLock(self.out_dir / "lock")

    def acquire(self):
        """Takes the lock, or raises a UserError saying another run holds it; then removes what a run killed
        while saving left half-written, which is ours to remove once the lock is."""
        try:
            self.made = next((d for d in (*self.out_dir.parents[::-1], self.out_dir) if not d.exists()), None)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.lock.acquire(timeout=0)
        except filelock.Timeout:
            raise UserError(f"{self.out_dir} is in use by another run; wait for it to end, or pick another "
                            "--out_dir") from None
        except OSError as e:
            raise UserError(f"cannot write to out_dir {self.out_dir} ({e.strerror}); pick another --out_dir") from None
        for name in ("ckpt.pt.tmp", "best.pt.tmp", "log.jsonl.tmp"):  # half-written by a run killed while saving
            (self.out_dir / name).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def release(self):
        """Lets go of the lock; the directories acquire made, if the run left out_dir empty, go with it."""
        if self.lock.is_locked:
            self.lock.release()
            if self.made and os.listdir(self.out_dir) == ["lock"]:
                shutil.rmtree(self.made, ignore_errors=True)


def append_record(out_dir, record, trackers=None):
    """Adds one record to out_dir/log.jsonl as a line, whole: a write that fails part way (a full disk: a UserError)
    is cut back, so no reader ever sees half a line. Then gives it to the run's trackers (Trackers, below)."""
    path = Path(out_dir) / "log.jsonl"
    data = memoryview((json.dumps(record) + "\n").encode("utf-8"))
    try:
        with open(path, "ab", buffering=0) as f:  # unbuffered: nothing to write at close
            size = f.seek(0, os.SEEK_END)
            try:
                while data:
                    data = data[f.write(data) :]  # a write may take only part
            except BaseException:
                f.truncate(size)  # cutting back needs no space, so it works on a full disk too
                raise
    except OSError as e:
        kept = "the last checkpoint is kept" if (Path(out_dir) / "ckpt.pt").exists() else "nothing was saved"
        raise UserError(f"{write_error(path, e)}; {kept} and the log is whole: free some space and continue "
                        "with --init_from=resume") from None
    if trackers:
        trackers.log(record)


def start_log(out_dir, start_iter):
    """Cuts log.jsonl back to start_iter's records (to nothing for a new run), so a resumed run's log reads like
    an uninterrupted one; a last line that a kill cut short is dropped; an earlier run's repeat.txt goes."""
    path, kept = Path(out_dir) / "log.jsonl", []
    if start_iter and path.exists():
        lines = path.read_bytes().decode("utf-8", "replace").removesuffix("\n").split("\n")
        for n, line in enumerate(lines, 1):
            try:
                if json.loads(line)["iter"] <= start_iter:
                    kept.append(line)
            except (ValueError, TypeError, KeyError):
                if n < len(lines):  # not the last line, which a kill may have cut short
                    raise UserError(f"{path} line {n} is not a log record; delete that line and resume again") \
                        from None
    try:
        write_atomic(path, "".join(line + "\n" for line in kept).encode("utf-8"))
    except OSError as e:
        raise UserError(f"{write_error(path, e)}; nothing was changed: free some space, or pick another --out_dir") \
            from None
    (Path(out_dir) / "repeat.txt").unlink(missing_ok=True)


# --- Checkpoints ------------------------------------------------------------------------------------

CHECKPOINT_FORMAT = 2  # 2: the loop's clock and next evaluation, to resume a timed run


def checkpoint_path(out_dir, name=""):
    """out_dir/name; with no name, the run's best model: best.pt (the lowest val loss) when it
    exists, else ckpt.pt (the latest step), which a run writes before any best.pt."""
    out_dir = Path(out_dir)
    if name:  # a name in out_dir, or a path to the file itself
        return Path(name) if Path(name).parent != Path(".") and Path(name).is_file() else out_dir / name
    return out_dir / "best.pt" if (out_dir / "best.pt").is_file() else out_dir / "ckpt.pt"


def load_checkpoint(path, device="cpu", choosing=True):
    """A checkpoint's dict: tensors and plain data, never code. choosing: the script takes --checkpoint."""
    path = Path(path)
    if not path.is_file():
        there = sorted(p.name for p in path.parent.glob("*.pt")) if path.parent.is_dir() else []
        fix = f"{path.parent} holds {', '.join(there)}: name one of those" if there else "train one: python train.py"
        raise UserError(f"checkpoint {path} not found; {fix}")
    other = {"best.pt": "ckpt.pt", "ckpt.pt": "best.pt"}.get(path.name)
    instead = f"pass --checkpoint={other} if {path.with_name(other)} is there, or retrain" if other and choosing \
        else "retrain"
    ckpt = load_tensors(path, "a checkpoint", instead, "Load only checkpoints written by train.py", device)
    if not isinstance(ckpt, dict) or not all(isinstance(ckpt.get(k), dict) for k in ("model", "model_config")) \
            or not all(map(torch.is_tensor, ckpt["model"].values())) or type(ckpt.get("format", 0)) is not int:
        raise UserError(f"{path} is not a checkpoint written by train.py")
    if not isinstance(ckpt.get("meta"), dict):
        raise UserError(f"{path} holds no tokenizer (meta); it was not written by this train.py")
    if problem := tokenizer_problem(ckpt["meta"]):
        raise UserError(f"{path}: in its meta (the tokenizer), {problem}; it was changed after train.py wrote it: "
                        "retrain")
    if ckpt.get("format", 0) > CHECKPOINT_FORMAT:
        raise UserError(f"{path} has checkpoint format {ckpt['format']}, newer than this code "
                        f"({CHECKPOINT_FORMAT}); update the code to read it")
    return ckpt


# --- The log's copies in TensorBoard and Weights & Biases (--log_to) --------------------------------------------
# Each record append_record writes goes to each, as it is written; log.jsonl stays the record of truth: a tracker
# that fails (a full disk, the network gone) is dropped with one warning line, and the run goes on. Their packages
# are optional extras, imported only when asked for.

TRACKER_MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}


def check_trackers(log_to):
    """--log_to's trackers (comma-separated), once each, if their packages import; else a UserError, said
    before anything is written or trained."""
    if not log_to:
        return ""
    names = list(dict.fromkeys(name.strip() for name in log_to.split(",") if name.strip()))
    for name in names:
        if name not in TRACKER_MODULES:  # a misspelt name first: it needs no package
            raise UserError(f"--log_to must be tensorboard, wandb or tensorboard,wandb, got {name!r}")
    for name in names:
        try:
            importlib.import_module(TRACKER_MODULES[name])
        except ImportError:
            raise UserError(f"--log_to={name} needs the {name} package: pip install {name}") from None
    return ",".join(names)


def open_trackers(run):
    """The trackers of run (a train.Run) from its step run.it, rank 0's alone, to be closed however the loop
    ends (a context manager); none without --log_to."""
    return Trackers(run.cfg, run.it, run.wandb_id) if run.procs.master and run.cfg.log_to else contextlib.nullcontext()


class Trackers:
    """The trackers cfg.log_to names, opened at step start_iter with cfg's settings; wandb_id: the W&B run to go
    on in (a resumed run's), then the one it logs to."""

    def __init__(self, cfg, start_iter, wandb_id=None):
        self.open, self.wandb_id = {}, wandb_id
        for name in filter(None, check_trackers(cfg.log_to).split(",")):
            self.guard(name, self.start, name, cfg, start_iter)

    def start(self, name, cfg, start_iter):
        self.open[name] = {"tensorboard": TensorBoard, "wandb": WandB}[name](cfg, start_iter, self)

    def log(self, record):
        for name, tracker in list(self.open.items()):
            self.guard(name, tracker.log, record)

    def guard(self, name, call, *args):
        try:
            call(*args)
        except Exception as e:  # whatever a tracker raises costs the run that tracker, and nothing else
            self.open.pop(name, None)
            tqdm.write(f"warning: --log_to={name} failed ({type(e).__name__}: {e}); it gets no more records, "
                       "log.jsonl keeps them all", file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        for name, tracker in list(self.open.items()):
            self.guard(name, tracker.close, 0 if exc_type is None else 1)  # 1: W&B marks the run failed
        self.open = {}


class TensorBoard:
    """Event files in OUT_DIR/tensorboard/: a float64 scalar per key of each record, the settings in the HPARAMS tab.
    A resumed run hides the steps after its checkpoint, as start_log cuts them from log.jsonl: none shows twice."""

    def __init__(self, cfg, start_iter, trackers):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # purge_step: what was written at that step or later is hidden (for a new run, all of it)
        self.writer = SummaryWriter(Path(cfg.out_dir) / "tensorboard", purge_step=start_iter + 1 if start_iter else 0)
        for summary in hparams(dataclasses.asdict(cfg), {"val_loss": None, "val_bpc": None}):
            self.writer.file_writer.add_summary(summary)

    def log(self, record):
        for key, value in record.items():
            if key != "iter":
                self.writer.add_scalar(key, value, record["iter"], new_style=True, double_precision=True)
        self.writer.flush()  # on disk now: a run killed later has lost nothing that log.jsonl holds

    def close(self, exit_code):
        self.writer.close()


class WandB:
    """A Weights & Biases run in OUT_DIR/wandb/: the settings as its config, a row per record with iter its
    x axis. A resumed run goes on in the W&B run its checkpoint names."""

    def __init__(self, cfg, start_iter, trackers):
        import wandb

        self.run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or Path(cfg.out_dir).name,
                              id=trackers.wandb_id, resume="allow", dir=cfg.out_dir, config=dataclasses.asdict(cfg),
                              settings=wandb.Settings(console="off", quiet=True))  # the run's output stays ours
        self.run.define_metric("iter")
        self.run.define_metric("*", step_metric="iter")
        trackers.wandb_id = self.run.id

    def log(self, record):
        self.run.log(record)

    def close(self, exit_code):
        import wandb

        self.run.finish(exit_code=exit_code)
        # Its service done with the run's files: scripts end with os._exit, past wandb's own atexit, and a run
        # resumed at once in the same process (as in the tests) found the last one's file still empty.
        wandb.teardown()
