"""Checkpoints: written so a crash never loses one, read so a file never runs code.

A checkpoint is a dict of tensors and plain data (numbers, strings, lists, dicts),
saved with torch.save and loaded with weights_only=True, which refuses anything
else: a file that would run code when unpickled is rejected, not executed.
"""

import dataclasses
from pathlib import Path

import torch

from config import UserError
from tinygpt.files import write_atomic, write_error

CHECKPOINT_FORMAT = 1


def save_checkpoint(state, path):
    """Writes to a temporary file in the same directory, fsyncs, then renames over
    path, so a crash at any moment leaves the previous checkpoint or the new one.
    A failed write (a full disk) removes the temporary file and is a UserError."""
    path = Path(path)
    then = ("the previous checkpoint is kept: free some space and continue with --init_from=resume"
            if path.exists() else "nothing was saved: free some space and run again")
    try:
        write_atomic(path, lambda f: torch.save(state, f))
    except OSError as e:
        raise UserError(f"{write_error(path, e)}; {then}") from None


def checkpoint_path(out_dir, name=""):
    """out_dir/name; with no name, the run's best model: best.pt (the lowest val loss) when it
    exists, else ckpt.pt (the latest step), which a run writes before any best.pt."""
    out_dir = Path(out_dir)
    if name:
        return out_dir / name
    return out_dir / "best.pt" if (out_dir / "best.pt").is_file() else out_dir / "ckpt.pt"


def load_checkpoint(path, device="cpu"):
    """A checkpoint's dict. weights_only=True: tensors and plain data, never code."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; train one first: python train.py config/NAME.toml")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        if type(e).__name__ == "UnpicklingError":  # weights_only met something other than plain data
            raise UserError(f"{path} holds objects other than tensors and plain data, which could run code "
                            "when loaded; refused. Load only checkpoints written by train.py") from None
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
        problem = "is truncated or damaged" if zipped else "is not a checkpoint (torch.save writes a zip archive)"
        raise UserError(f"{path} {problem}; not a readable checkpoint: retrain, or use best.pt") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"{path} is not a checkpoint written by train.py")
    if ckpt.get("format", 0) > CHECKPOINT_FORMAT:
        raise UserError(f"{path} has checkpoint format {ckpt['format']}, newer than this code "
                        f"({CHECKPOINT_FORMAT}); update the code to read it")
    return ckpt


def resumed_config(saved, cfg, sources):
    """The settings the run started with, from its checkpoint, with what a preset or the command
    line sets now laid over them: a resumed run keeps the choices made at its start (the model
    sized for the data, the steps its time budget bought) and does not choose again."""
    known = {f.name for f in dataclasses.fields(cfg)}
    start = type(cfg)(**{k: v for k, v in saved.items() if k in known})
    now = {k: getattr(cfg, k) for k in sources} | {"out_dir": cfg.out_dir, "init_from": "resume"}
    return dataclasses.replace(start, **now)


def check_resumable(ckpt, mconf, meta, cfg):
    """A UserError unless this run's model and tokenizer are the checkpoint's."""
    path = Path(cfg.out_dir) / "ckpt.pt"
    then = {f.name: f.default for f in dataclasses.fields(mconf)} | ckpt["model_config"]  # older: the defaults
    diff = {k: (v, then.get(k)) for k, v in dataclasses.asdict(mconf).items() if then.get(k) != v}
    if diff:
        raise UserError(f"cannot resume {path}: the model config differs (now, checkpoint): {diff}")
    if any(ckpt["meta"].get(k) != meta.get(k) for k in ("tokenizer", "vocab", "encoding")):
        raise UserError(f"cannot resume {path}: its tokenizer differs from the one in {cfg.data_dir}")
