"""Weights that exist, a checkpoint or GPT-2 (or an export of one): loaded to sample from and score (load_model),
to resume a run (restore), or to fine-tune: then the weights fix the model's shape, and the new run brings its data,
block_size, dropout, optimizer and schedule, from iteration 0. BPE data must use the weights' encoding; with
characters, each one the weights know keeps its rows, moved to its id in the new vocabulary.
"""

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from config import AUTO, UserError
from model import GPT, GPTConfig
from tinygpt import export, gpt2
from tinygpt.files import check_path, checkpoint_path, load_checkpoint
from tinygpt.tokenizer import tokenizer_from_meta


def load_model(init_from, out_dir, checkpoint, device):
    """(model in eval mode on device, tokenizer): GPT-2 if init_from names it, else (resume) the
    checkpoint named in out_dir, best.pt when there is one (checkpoint_path)."""
    for option, path in (("--out_dir", out_dir), ("--checkpoint", checkpoint), ("--init_from", init_from)):
        check_path(path, option, directory=option == "--out_dir")
    if init_from != "resume" and checkpoint_path(init_from).is_file():  # a directory train.py wrote to
        init_from, out_dir = "resume", init_from
    if init_from == "resume":
        return model_from_checkpoint(checkpoint_path(out_dir, checkpoint), device)
    if not gpt2.is_gpt2(init_from):
        raise UserError(f"init_from must be resume (a checkpoint in --out_dir), {', '.join(gpt2.SIZES)} or a "
                        f"directory in the Hugging Face layout; got {init_from!r}")
    config, state, meta = export.load(init_from)
    return gpt2.build(config, state).to(device), tokenizer_from_meta(meta)


def model_from_checkpoint(path, device):
    """(model in eval mode on device, tokenizer), both from one checkpoint file."""
    ckpt = load_checkpoint(path, "cpu")  # to the CPU first: only the weights need to go to the device
    config, state, tokenizer = ckpt["model_config"], ckpt["model"], tokenizer_from_meta(ckpt["meta"])
    # The sizes model_config says, and those of the weights and the tokenizer, before a model that big is built.
    said = (*(config.get(k) for k in ("vocab_size", "n_embd", "n_layer", "block_size")),
            config.get("real_vocab_size") or config.get("vocab_size"))
    wte = state.get("wte.weight", torch.empty(0, 0))  # a file without it is refused below, as any other misfit
    positions = state["wpe.weight"].shape[:1] if "wpe.weight" in state else said[3:4]  # learned: block_size rows
    found = (*wte.shape, len({k.split(".")[1] for k in state if k.startswith("blocks.")}) or said[2], *positions,
             tokenizer.vocab_size)
    if wte.numel() and found != said:
        raise UserError(f"{path}: its model_config (vocab_size, n_embd, n_layer, block_size, tokens {said}) does not "
                        f"match its weights and tokenizer {found}: it was changed after train.py wrote it; retrain")
    try:
        model = GPT(GPTConfig(**{**config, "dropout": 0.0}))
        model.load_state_dict(state)
    except (TypeError, ValueError, RuntimeError) as e:
        lines = str(e).strip().splitlines()  # load_state_dict's first line is a heading: its second says what
        what = lines[min(1, len(lines) - 1)].strip()[:200]
        raise UserError(f"{path} does not fit this version of model.py ({what}); sample with the code that trained "
                        "it, or retrain") from None
    return model.to(device).eval(), tokenizer


# --- Resuming -------------------------------------------------------------------------------------------


def restore(ckpt, run):
    """run (a train.Run, not yet compiled or wrapped) as ckpt saved it: the model, optimizer and scaler, and where
    its loop was; once it is checked that the run has ckpt's tokenizer, model and clock, and steps and time left."""
    path, cfg = checkpoint_path(run.cfg.out_dir, "ckpt.pt"), run.cfg
    if ckpt.get("format", 0) < 2:
        raise UserError(f"{path} was written by an older train.py and cannot be resumed; fine-tune from it "
                        f"(--init_from={path} and another --out_dir), or start a new run (--overwrite=true)")
    if any(ckpt["meta"].get(k) != run.meta.get(k) for k in ("tokenizer", "vocab", "encoding")):  # first: it sizes
        raise UserError(f"cannot resume {path}: the data set changed, {cfg.data_dir}'s tokenizer is not the one it "
                        "trained on; prepare the text it trained on again, or start a new run (--overwrite=true)")
    then = {f.name: f.default for f in dataclasses.fields(run.raw_model.config)} | ckpt["model_config"]
    now = dataclasses.asdict(run.raw_model.config) | {"optimizer": cfg.optimizer}
    then["optimizer"] = ckpt["train_config"]["optimizer"]
    diff = [f"--{k}={v} (it has {then.get(k)})" for k, v in now.items() if then.get(k) != v]
    if diff:
        raise UserError(f"cannot resume {path} as {', '.join(diff)}: a resumed run keeps its model and optimizer; "
                        "drop those options, or start a new run (--overwrite=true, or another --out_dir)")
    if cfg.max_time != ckpt["train_config"]["max_time"]:
        raise UserError(f"--max_time={cfg.max_time} on a resumed run: it goes on with the clock it started with "
                        f"({ckpt['train_config']['max_time']}); drop --max_time")
    if ckpt["iter"] >= cfg.max_iters:
        raise UserError(f"{path} is at iteration {ckpt['iter']} and --max_iters is {cfg.max_iters}: nothing is left "
                        f"to train; to go on, give more, e.g. --max_iters={max(2 * ckpt['iter'], 100)}")
    if ckpt["spent"] >= ckpt["seconds"]:
        raise UserError(f"{path} has spent its --max_time={cfg.max_time}: nothing is left to train; to go on, "
                        f"fine-tune from it: --init_from={path} and another --out_dir")
    run.raw_model.load_state_dict(ckpt["model"])
    settings = [{k: v for k, v in group.items() if k != "params"} for group in run.optimizer.param_groups]
    run.optimizer.load_state_dict(ckpt["optimizer"])
    for group, own in zip(run.optimizer.param_groups, settings):  # the moments saved, the settings this run's
        group.update(own)
    if ckpt["scaler"]:  # empty where the run trained without fp16's scaling; a resume in fp16 starts it afresh
        run.scaler.load_state_dict(ckpt["scaler"])
    run.it, run.best_val, run.bad_evals, run.next_eval, run.spent, run.seconds, run.wandb_id = (
        ckpt[k] for k in ("iter", "best_val_loss", "bad_evals", "next_eval", "spent", "seconds", "wandb_run_id"))


# --- Fine-tuning --------------------------------------------------------------------------------------

RUN_KEYS = {"vocab_size", "real_vocab_size", "block_size", "dropout", "fused_attention"}  # the run's, not the weights'


@dataclass
class Weights:
    """Weights to start from, with what is needed to use them."""

    name: str  # for messages: a checkpoint's path, or gpt2-medium
    model_config: dict  # GPTConfig's fields, as a checkpoint stores them
    state: dict  # model.GPT's state dict
    meta: dict  # the tokenizer they were trained with, as in meta.json

    def longest(self):
        """The longest context the weights can read: as many positions as they learned (rotary: no limit)."""
        learned = self.model_config.get("pos", GPTConfig.pos) == "learned"
        return self.model_config.get("block_size") if learned else math.inf


def load_weights(init_from, out_dir):
    """What --init_from names: GPT-2 (a name or a directory), a checkpoint, or a run's out_dir (best.pt, or ckpt.pt)."""
    check_path(init_from, "--init_from")
    init_from = str(checkpoint_path(init_from)) if checkpoint_path(init_from).is_file() else init_from
    if gpt2.is_gpt2(init_from):
        config, state, meta = export.load(init_from)
        return Weights(init_from, dataclasses.asdict(config), state, meta)
    path = Path(init_from)
    if not path.is_file():
        raise UserError(f"init_from {init_from!r} not found: use scratch, resume, {', '.join(gpt2.SIZES)}, "
                        "a checkpoint file (ckpt.pt or best.pt) or a directory in the Hugging Face layout")
    if path.resolve().parent == Path(out_dir).resolve():
        raise UserError(f"--out_dir={out_dir} holds {path}, which fine-tuning would overwrite; pick another --out_dir")
    ckpt = load_checkpoint(path, choosing=False)
    return Weights(str(path), ckpt["model_config"], ckpt["model"], ckpt["meta"])


def finetune_settings(source, cfg, meta):
    """cfg (a train.TrainConfig) with the model's shape set to the weights': the data of meta (meta.json), block_size,
    dropout and the training are cfg's. A UserError if the weights and the data cannot go together, or if cfg sets
    a switch of the shape (n_layer, n_head, n_embd, pos, mixer, window, ...) away from its default to another value
    than the weights have."""
    theirs = source.meta
    if (theirs.get("tokenizer"), theirs.get("encoding")) != (meta.get("tokenizer"), meta.get("encoding")):
        flag = "char" if theirs.get("tokenizer") == "char" else theirs.get("encoding")
        raise UserError(f"{source.name} reads {describe(theirs)} tokens, but {cfg.data_dir} holds {describe(meta)} "
                        f"tokens; prepare the text again: python prepare.py --input FILE --tokenizer={flag}")
    if theirs.get("tokenizer") != "char" and theirs.get("vocab_size") != meta.get("vocab_size"):
        raise UserError(f"{source.name} knows {theirs.get('vocab_size')} {describe(theirs)} tokens, {cfg.data_dir} "
                        f"{meta.get('vocab_size')}: another tiktoken prepared them; prepare the data again")
    shape = {f.name: source.model_config.get(f.name, f.default) for f in dataclasses.fields(GPTConfig)
             if f.name not in RUN_KEYS}
    default = type(cfg)()  # auto for n_layer, n_head, n_embd and pos
    for key in shape:  # a value away from its default, and from the weights', was asked for and cannot be had
        if getattr(cfg, key) not in (getattr(default, key), weights := shape[key]):
            raise UserError(f"--{key}={getattr(cfg, key)} contradicts {source.name}, whose {key} is {weights}: the "
                            f"weights fix the model's shape; drop it or pass --{key}={weights}")
    if cfg.block_size != AUTO and cfg.block_size > (longest := source.longest()):
        raise UserError(f"--block_size={cfg.block_size} is longer than {source.name}'s {longest}: its position "
                        f"embeddings stop there; pass --block_size={longest} or less")
    return dataclasses.replace(cfg, **shape)


def describe(meta):
    return "character" if meta.get("tokenizer") == "char" else f"{meta.get('encoding')} BPE"


def char_map(theirs, ours):
    """(our ids, their ids) of the characters both vocabularies have, and our new ones."""
    old = {ch: i for i, ch in enumerate(theirs)}
    kept = [(i, old[ch]) for i, ch in enumerate(ours) if ch in old]
    return [i for i, _ in kept], [j for _, j in kept], [ch for ch in ours if ch not in old]


@torch.no_grad()
def load_into(model, source, meta):
    """Copies source's weights into model, fresh for the data of meta: with characters, token rows by character (new
    ones keep their fresh rows); position rows up to block_size; the rest whole. Returns a line saying what it did."""
    chars = meta.get("tokenizer") == "char"
    ours, theirs, new = char_map(source.meta["vocab"], meta["vocab"]) if chars else (None, None, [])
    own = model.state_dict()  # shares storage with the parameters: writing it writes them
    for name, tensor in source.state.items():
        if name not in own:
            raise UserError(f"{source.name} does not fit this version of model.py ({name}); "
                            "fine-tune with the code that trained it")
        target = own[name]
        if name in export.VOCAB_ROWS and chars:  # one row per token
            target[ours] = tensor[theirs].to(target)
        elif name == "wpe.weight":
            target.copy_(tensor[: target.size(0)])  # positions past block_size are never used
        elif target.shape == tensor.shape:
            target.copy_(tensor)
        else:
            raise UserError(f"{source.name}: {name} is {tuple(tensor.shape)}, the model needs {tuple(target.shape)}")
    if missing := sorted(set(own) - set(source.state)):
        raise UserError(f"{source.name} has no weights for {missing[0]}; fine-tune with the code that trained it")
    if not chars:
        return f"fine-tuning {source.name} on {describe(meta)} tokens"
    shown = ", ".join(repr(ch) for ch in new[:10]) + (", ..." if len(new) > 10 else "")
    return (f"fine-tuning {source.name}: {len(new)} of the {len(ours) + len(new)} characters in the data are new to it"
            + (f" ({shown}), starting from fresh rows" if new else ""))
