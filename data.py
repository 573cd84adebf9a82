"""Reading prepared data for training: random batches, whole splits in order, loss estimates."""

import numpy as np
import torch

from config import UserError
from prepare import open_split, read_meta


def get_batch(data, batch_size, block_size, rng, device):
    """batch_size random windows of data: inputs (B, T) and next-token targets (B, T)."""
    starts = rng.integers(0, len(data) - block_size, size=batch_size)
    x = np.stack([data[s : s + block_size] for s in starts]).astype(np.int64)
    y = np.stack([data[s + 1 : s + 1 + block_size] for s in starts]).astype(np.int64)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if device.startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def sequential_batches(data, block_size, batch_size, n_windows, device):
    """n_windows non-overlapping windows from the start of data, batch by batch."""
    n_windows = min(n_windows, (len(data) - 1) // block_size)
    for first in range(0, n_windows, batch_size):
        starts = range(first * block_size, min(first + batch_size, n_windows) * block_size, block_size)
        x = np.stack([data[s : s + block_size] for s in starts]).astype(np.int64)
        y = np.stack([data[s + 1 : s + 1 + block_size] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)


@torch.no_grad()
def estimate_loss(model, splits, cfg, device, autocast, seed):
    """Mean loss per split. eval_iters > 0: that many random batches (seeded, so the
    training data order is untouched). eval_iters = 0: the whole val split in
    non-overlapping windows, and as many train tokens from the train split's start."""
    model.eval()
    out = {}
    for name, data in splits.items():
        if cfg.eval_iters > 0:
            rng = np.random.default_rng(seed)
            batches = (get_batch(data, cfg.batch_size, cfg.block_size, rng, device) for _ in range(cfg.eval_iters))
        else:
            n_windows = (len(splits["val"]) - 1) // cfg.block_size
            batches = sequential_batches(data, cfg.block_size, 4 * cfg.batch_size, n_windows, device)
        total, count = 0.0, 0
        for x, y in batches:
            with autocast:
                _, loss = model(x, y)
            total += loss.item() * y.numel()
            count += y.numel()
        out[name] = total / count
    model.train()
    return out


def load_data(data_dir):
    """meta.json and the memmapped train and val splits of a prepared data set."""
    meta = read_meta(data_dir)
    return meta, {split: open_split(data_dir, split, meta) for split in ("train", "val")}


def check_block_size(splits, block_size, data_dir):
    """Each split must hold more than one window of block_size tokens and its next-token target."""
    for split, data in splits.items():
        if len(data) <= block_size:
            raise UserError(f"the {split} split of {data_dir} has {len(data)} tokens, not more than "
                            f"block_size {block_size}; lower --block_size or prepare a longer text")
