"""A training run's settings (train.TrainConfig) and what they make: the model's config, the checks
made before anything is built or written, what a resumed run keeps, and where the run's files go.

`sources` maps each setting that was set to where: a preset's path, or "command line".
"""

import dataclasses
from pathlib import Path

import torch

from config import UserError
from model import GPTConfig
from tinygpt.dataset import check_block_size, load_data
from tinygpt.device import check_model_fits, pick_dtype


def model_config(cfg, vocab_size):
    """The model for cfg; its embedding is padded past the tokenizer's vocab_size for speed."""
    names = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "real_vocab_size"}
    try:
        return GPTConfig(vocab_size=padded_vocab_size(vocab_size), real_vocab_size=vocab_size,
                         **{n: getattr(cfg, n) for n in names})
    except ValueError as e:
        raise UserError(f"model config: {e}") from None


def padded_vocab_size(n, multiple=64):
    """n rounded up to a multiple: GPU matmuls run faster on round sizes (50257 -> 50304)."""
    return -(-n // multiple) * multiple


def check_settings(cfg, device, data=None):
    """Every check that needs nothing from out_dir, before anything is built or written: the dtype,
    the data (meta.json and the bins, read here unless given), the model's config and its size."""
    dtype = pick_dtype(cfg.dtype, torch.device(device).type, training=True)
    meta, splits = data or load_data(cfg.data_dir)
    check_block_size(splits, cfg.block_size, cfg.data_dir)
    mconf = model_config(cfg, meta["vocab_size"])
    check_model_fits(mconf, cfg.batch_size, cfg.block_size, device, dtype)
    return mconf


def has_preset(sources):
    """Whether a preset (a TOML file) set anything, where sources maps a setting to where it came from."""
    return any(where != "command line" for where in sources.values())


def run_out_dir(cfg, sources):
    """out_dir as set on the command line, or by the preset that also names the data; otherwise
    it follows the data, out/NAME for data/NAME, so runs on different texts never meet."""
    where = sources.get("out_dir")
    if cfg.out_dir and (where == "command line" or (where is not None and where == sources.get("data_dir"))):
        return cfg.out_dir
    return str(Path("out") / Path(cfg.data_dir).name)


def resumed_config(ckpt, cfg, sources, device_type):
    """The settings the run started with, from its checkpoint, with what a preset or the command
    line (not a preset) sets now laid over them: a resumed run keeps the choices made at its start (the model
    sized for the data, the steps its time budget bought) and does not choose again; except its
    dtype on another kind of device (a run begun on a CPU, resumed on a GPU), picked again there."""
    if sources.get("max_time") == "command line":
        raise UserError(f"--max_time={cfg.max_time} on a resumed run: it goes on with the steps its start planned; "
                        "drop --max_time, or give --max_iters")
    known = {f.name for f in dataclasses.fields(cfg)}
    start = type(cfg)(**{k: v for k, v in ckpt["train_config"].items() if k in known})
    given = [k for k, where in sources.items() if where == "command line"]  # a preset's steps are not the plan's
    now = {k: getattr(cfg, k) for k in given} | {"out_dir": cfg.out_dir, "init_from": "resume"}
    if ckpt.get("device_type", device_type) != device_type and "dtype" not in sources:
        now["dtype"] = "auto"
    return dataclasses.replace(start, **now)


def check_resumable(ckpt, mconf, meta, cfg):
    """A UserError unless this run's model and tokenizer are the checkpoint's."""
    path = Path(cfg.out_dir) / "ckpt.pt"
    if any(ckpt["meta"].get(k) != meta.get(k) for k in ("tokenizer", "vocab", "encoding")):  # first: it sizes the model
        raise UserError(f"cannot resume {path}: the data set changed, {cfg.data_dir}'s tokenizer is not the one it "
                        "trained on; prepare the text it trained on again, or start a new run (--overwrite=true)")
    then = {f.name: f.default for f in dataclasses.fields(mconf)} | ckpt["model_config"]  # older: the defaults
    diff = {k: (v, then.get(k)) for k, v in dataclasses.asdict(mconf).items() if then.get(k) != v}
    if diff:
        raise UserError(f"cannot resume {path}: the model config differs (now, checkpoint): {diff}")
