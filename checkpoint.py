"""Checkpoints: written so a crash never loses one, read so a file never runs code.

A checkpoint is a dict of tensors and plain data (numbers, strings, lists, dicts),
saved with torch.save and loaded with weights_only=True, which refuses anything
else: a file that would run code when unpickled is rejected, not executed.
"""

from pathlib import Path

import torch

from config import UserError
from files import write_atomic, write_error

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
