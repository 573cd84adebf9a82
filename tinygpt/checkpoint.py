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
    if name:  # a name in out_dir, or a path to the file itself
        return Path(name) if Path(name).parent != Path(".") and Path(name).is_file() else out_dir / name
    return out_dir / "best.pt" if (out_dir / "best.pt").is_file() else out_dir / "ckpt.pt"


def load_checkpoint(path, device="cpu"):
    """A checkpoint's dict. weights_only=True: tensors and plain data, never code."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; train one first: python train.py config/NAME.toml")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
        if zipped and type(e).__name__ == "UnpicklingError":  # weights_only met something other than plain data
            raise UserError(f"{path} holds objects other than tensors and plain data, which could run code "
                            "when loaded; refused. Load only checkpoints written by train.py") from None
        problem = "is truncated or damaged" if zipped else "is not a checkpoint (torch.save writes a zip archive)"
        other = {"best.pt": "ckpt.pt", "ckpt.pt": "best.pt"}.get(path.name)
        instead = f"use {path.with_name(other)} if it is there, or retrain" if other else "retrain"
        raise UserError(f"{path} {problem}; {instead}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"{path} is not a checkpoint written by train.py")
    if ckpt.get("format", 0) > CHECKPOINT_FORMAT:
        raise UserError(f"{path} has checkpoint format {ckpt['format']}, newer than this code "
                        f"({CHECKPOINT_FORMAT}); update the code to read it")
    return ckpt


def run_state(run, val_loss):
    """What ckpt.pt holds of a training run (train.Run) after its step run.it: enough to resume it
    exactly, or to sample from it. val_loss: that step's evaluation, or None (saved on a signal)."""
    return {"format": CHECKPOINT_FORMAT, "model": run.raw_model.state_dict(),
            "model_config": dataclasses.asdict(run.raw_model.config), "train_config": dataclasses.asdict(run.cfg),
            "meta": run.meta, "iter": run.it, "best_val_loss": run.best_val, "val_loss": val_loss,
            "bad_evals": run.bad_evals, "optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict(),
            "device_type": run.procs.device_type}


def restore_run(run, ckpt):
    """run (train.Run, not yet compiled or wrapped) as run_state left it in ckpt."""
    run.raw_model.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt["scaler"]:  # empty where the run trained without fp16's scaling; a resume in fp16 starts it afresh
        run.scaler.load_state_dict(ckpt["scaler"])
    run.it, run.best_val, run.bad_evals = ckpt["iter"], ckpt["best_val_loss"], ckpt.get("bad_evals", 0)
    run.evaluated = run.it if ckpt["val_loss"] is not None else None  # None: saved on a signal, not evaluated


def read_start(cfg, device):
    """The checkpoint a run resumes from (--init_from=resume); None for a new run, which must not
    replace one already in out_dir unless told to (--overwrite)."""
    path = Path(cfg.out_dir) / "ckpt.pt"
    if cfg.init_from != "resume" and path.exists() and not cfg.overwrite:
        raise UserError(f"{path} exists; continue it with --init_from=resume, "
                        "start over with --overwrite=true, or pick another --out_dir")
    return load_checkpoint(path, device) if cfg.init_from == "resume" else None
