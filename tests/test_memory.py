"""system.py's memory check: memory_bound, the arithmetic that spares ordinary runs the
meta-device measurement (a second of imports), is never below what training_memory measures
and, for a GPT, not far above it; and check_model_fits measures only the models that might not fit."""

import dataclasses
import itertools
import platform
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import UserError, load_config
from model import MIXERS, POSITIONS, SCORES, GPTConfig
from tinygpt import gpt2, system
from tinygpt.system import check_model_fits, memory_bound, training_memory
from train import TrainConfig, model_config

ROOT = Path(__file__).resolve().parents[1]
RUNS = sorted((ROOT / "config").glob("*.toml"))  # the presets people train: GPTs
PRESETS = RUNS + sorted((ROOT / "config" / "ladder").glob("*.toml"))  # and the ladder's rungs
GPT2_SMALL = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_layer": 12, "n_head": 12,
              "n_embd": 768}  # the keys of the 124M model's config.json that gpt2.gpt_config reads
SLACK = 2  # for a GPT the bound is 1.5x to 1.8x the measurement (the presets, and the sampled GPTs)


def preset_run(path):
    """(GPTConfig, batch_size, block_size) that train.py checks for the preset at path: its model on
    Tiny Shakespeare's 65 characters, or for a fine-tuning preset GPT-2's shape with the preset's run keys."""
    cfg = load_config(TrainConfig, [str(path)])
    if cfg.init_from == "scratch":
        return model_config(cfg, 65), cfg.batch_size, cfg.block_size
    assert cfg.init_from == "gpt2", f"{path.name}: a fine-tuning preset this test does not know the shape of"
    mconf = dataclasses.replace(gpt2.gpt_config(GPT2_SMALL, "gpt2"), block_size=cfg.block_size, dropout=cfg.dropout)
    return mconf, cfg.batch_size, cfg.block_size


def sampled_runs(seed=0, per_combination=2):
    """Each combination of the switches that shape attention that makes a model, twice, the other switches and
    the sizes drawn at random; n_layer 0 to 3, or 1000: the measurement extrapolates, so depth costs nothing."""
    rng = random.Random(seed)
    for mixer, score, fused, pos, dropout in itertools.product(MIXERS, SCORES, (True, False), POSITIONS, (0.0, 0.1)):
        try:
            GPTConfig(mixer=mixer, score=score, pos=pos, n_head=2, n_embd=8)
        except ValueError:  # additive scores and rope each need a mixer that scores, and rule out each other
            continue
        for _ in range(per_combination):
            n_head, head_size = rng.choice([1, 2, 3, 4, 6]), rng.choice([2, 4, 8, 16] if pos == "rope" else [1, 3, 8])
            block_size, vocab_size = rng.randint(1, 64), rng.randint(1, 300)
            mconf = GPTConfig(
                mixer=mixer, score=score, fused_attention=fused, pos=pos, dropout=dropout,
                feedforward=rng.random() < 0.5, residual=rng.random() < 0.5, layernorm=rng.random() < 0.5,
                tie_weights=rng.random() < 0.5, bias=rng.random() < 0.5, gelu=rng.choice(["exact", "tanh"]),
                n_layer=rng.choice([0, 1, 2, 3, 1000]), n_head=n_head, n_embd=n_head * head_size,
                block_size=block_size, window=rng.choice([0, rng.randint(1, block_size)]),
                vocab_size=vocab_size, real_vocab_size=rng.choice([None, rng.randint(1, vocab_size)]))
            yield mconf, rng.randint(1, 16), block_size


SAMPLED = list(sampled_runs())


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_bound_is_at_least_the_measurement_for_every_preset_and_at_most_twice_it_for_a_gpt(path):
    mconf, batch_size, block_size = preset_run(path)
    measured = training_memory(mconf, batch_size, block_size)[1]
    bound = memory_bound(mconf, batch_size, block_size)
    assert measured <= bound
    assert bound <= SLACK * measured or path not in RUNS  # the ladder's first rungs keep less than a block


def is_gpt(mconf):
    return mconf.mixer == "multihead" and mconf.feedforward and mconf.layernorm and mconf.n_layer > 0


def test_bound_is_at_least_the_measurement_for_every_switch_and_size():
    below, far_above = [], []
    for mconf, batch_size, block_size in SAMPLED:
        measured = training_memory(mconf, batch_size, block_size)[1]
        bound = memory_bound(mconf, batch_size, block_size)
        if bound < measured:
            below.append((mconf, batch_size, bound, measured))
        if is_gpt(mconf) and bound > SLACK * measured:
            far_above.append((mconf, batch_size, bound, measured))
    assert not below and not far_above, (below, far_above)
    assert sum(map(is_gpt, (mconf for mconf, _, _ in SAMPLED))) >= 10  # the GPTs among them


def small_model():
    return GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_whose_bound_fits_is_not_measured(monkeypatch, dtype):
    def unwanted(*args):
        raise AssertionError("training_memory was called")

    mconf = small_model()
    bound = memory_bound(mconf, 8, 16, shrink=4 // dtype.itemsize)  # 16-bit activations: half their room
    monkeypatch.setattr(system, "training_memory", unwanted)
    monkeypatch.setattr(system, "memory_size", lambda name: (bound, "this test's memory"))
    check_model_fits(mconf, 8, 16, "cpu", dtype)


def test_16_bit_activations_leave_the_fp32_weights_gradients_and_moments_whole(monkeypatch):
    mconf = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=128)
    n_params, measured = training_memory(mconf, 1, 4)
    assert measured - 16 * n_params < 16 * n_params  # the parameters' share is most of it
    monkeypatch.setattr(system, "memory_size", lambda name: (16 * n_params, "this test's memory"))  # room for those
    with pytest.raises(UserError, match="needs at least"):
        check_model_fits(mconf, 1, 4, "cpu", torch.bfloat16)


def test_a_model_whose_bound_does_not_fit_is_measured_and_passes_if_the_measurement_fits(monkeypatch):
    mconf = small_model()
    measured = training_memory(mconf, 8, 16)[1]
    calls = []
    monkeypatch.setattr(system, "training_memory", lambda *args: calls.append(args) or training_memory(*args))
    monkeypatch.setattr(system, "memory_size", lambda name: (measured, "this test's memory"))
    assert memory_bound(mconf, 8, 16) > measured
    check_model_fits(mconf, 8, 16, "cpu", torch.float32)
    assert calls == [(mconf, 8, 16, 1)]


def test_a_model_whose_measurement_does_not_fit_is_refused_with_what_it_needs(monkeypatch):
    mconf = small_model()
    measured = training_memory(mconf, 8, 16)[1]
    monkeypatch.setattr(system, "memory_size", lambda name: (measured - 1, "this test's memory"))
    with pytest.raises(UserError, match=r"needs at least .* and this test's memory is"):
        check_model_fits(mconf, 8, 16, "cpu", torch.float32)


FREED = """
import ctypes, sys
import torch
from tinygpt.system import keep_freed_memory
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
x = torch.ones(8 << 20, dtype=torch.uint8)  # 8 MiB, as one step's activation might be
mapped = libc.mallinfo2().hblkhd  # bytes in blocks of their own (mmap), given back to the system when freed
del x
print(kept, mapped, libc.mallinfo2().fordblks)  # fordblks: free bytes kept in the heap for reuse
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="keep_freed_memory tunes glibc's malloc")
def test_keep_freed_memory_keeps_a_freed_tensor_in_the_heap_for_the_next_step():
    def run(mode):
        out = subprocess.run([sys.executable, "-c", FREED, mode], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.split()
    kept, mapped, free = run("keep")
    assert kept == "True"
    assert int(mapped) < 8 << 20 and int(free) >= 8 << 20  # from the heap, and still there after the free
    _, mapped, free = run("default")  # glibc's default: a block of its own, unmapped when freed
    assert int(mapped) >= 8 << 20 and int(free) < 8 << 20
