"""Where the code runs: the device, whether a model fits in its memory, the dtype,
torch.compile, and the peak for MFU."""

import contextlib
import ctypes
import dataclasses
import functools
import os
import platform
import shutil
import time
from pathlib import Path

import torch

from config import UserError
from model import GPT
from tinygpt.tokenizer import cpu_count

# Dense bf16 tensor-core peaks, for MFU. A device not listed gets no MFU figure.
PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "L4": 121e12, "A10": 125e12, "4090": 165e12}


def pick_device(name):
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def check_device(name):
    """name, if this machine has that device; else a UserError saying what to use."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and torch.cuda.is_available() and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"device {name} does not exist: this machine has {torch.cuda.device_count()} GPU(s), "
                        f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    available = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available}
    if not available.get(device.type, lambda: True)():
        raise UserError(f"device {name} is not available on this machine; use --device=cpu")
    return name


def memory_size(device):
    """(bytes, what) of the memory a model on device lives in: the GPU's, or the machine's
    RAM (for mps too, which shares it), within a container's limit if it sets one."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory, f"{device}'s memory"
    size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            size = min(size, int(Path(limit_file).read_text()))  # "max" (no limit) is a ValueError
    return size, "this machine's memory"


def training_memory(mconf, batch_size, block_size):
    """(parameters, bytes) of training mconf on batches of (batch_size, block_size): at
    least each parameter's fp32 weight, gradient and two AdamW moments (16 bytes), the
    buffers, what the forward pass keeps for the backward one, and the logits' gradient.
    Measured on the meta device, which has shapes but no data: no memory and no time,
    however large the model. The blocks are alike, so models of 0 and 1 block tell all."""
    def measure(n_layer):
        with torch.device("meta"):
            model = GPT(dataclasses.replace(mconf, n_layer=n_layer))
            idx = torch.zeros(batch_size, block_size, dtype=torch.long)
        kept = {}  # storage -> bytes: views of one tensor count once

        def keep(t):
            kept[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            model(idx, idx)
        return model.num_params(), sum(b.numel() for b in model.buffers()), sum(kept.values())

    (params0, buffers0, kept0), (params1, buffers1, kept1) = measure(0), measure(1)
    n_params = params0 + mconf.n_layer * (params1 - params0)
    n_buffers = buffers0 + mconf.n_layer * (buffers1 - buffers0)
    kept = kept0 + mconf.n_layer * (kept1 - kept0)
    return n_params, 16 * n_params + 4 * n_buffers + kept + 4 * batch_size * block_size * mconf.vocab_size


def memory_bound(mconf, batch_size, block_size):
    """At least what training_memory(mconf, batch_size, block_size) measures, from the config's numbers alone:
    microseconds, where the measurement's first meta op imports torch's meta kernels and sympy (over a second)."""
    C, V, T, tokens = mconf.n_embd, mconf.vocab_size, block_size, batch_size * block_size  # T queries, T keys
    mixer, ln, ff, drop = mconf.mixer, mconf.layernorm, mconf.feedforward, mconf.dropout > 0
    H = mconf.n_head if mixer == "multihead" else 1
    attention = mixer in ("head", "multihead")
    mixer_params = {"none": 0, "average": 0, "head": 3 * C * C + C, "multihead": 4 * C * C + 5 * C}[mixer]
    layer_params = 4 * C * ln + mixer_params + (8 * C * C + 5 * C) * ff  # every bias and score vector counted
    params = mconf.n_layer * layer_params + C * (V * (2 - mconf.tie_weights) + 2 * ln
                                                 + mconf.block_size * (mconf.pos == "learned"))
    buffers = mconf.block_size * C + C  # the sinusoidal table or rope's frequencies
    # Kept for the backward pass, per token and layer, in fp32 rows of C: each LayerNorm's input (its mean
    # and rstd: 8 bytes); c_attn's input, q, k, v (a view of v keeps all 3 rows of qkv) and c_proj's input,
    # or a Head's x, q, k, v; the feed-forward's input and two 4C-wide ones (GELU's and c_proj's); dropout masks.
    norms = (4 * C + 8) * ln * ((mixer != "none") + ff)
    rows = {"none": 0, "average": 0, "head": 4, "multihead": 7 + drop}[mixer] + (9 + drop) * ff
    # Each query's H x T attention weights, with dropout also their mask and the dropped copy; additive
    # scores' (B, H, T, T, hs) tanh, where H * hs = C.
    weights = 4 * H * T * (1 + 2 * drop) + 4 * T * C * (mconf.score == "additive")
    per_layer = (tokens * (norms + 4 * C * rows + attention * weights)
                 + 4 * T * T * (mixer != "none") + 8 * T * C * (mconf.pos == "rope"))  # a (T, T) mask; rope's cos, sin
    # Once: the ids (int64) and positions; x, its dropout mask, ln_f's input, mean and rstd, lm_head's input;
    # the log-softmax, and the logits' gradient that training_memory adds.
    once = tokens * (8 + 4 * C * (2 + drop + ln) + 8 * ln + 8 * V) + 8 * T + 4
    kept = 4 * params + once + mconf.n_layer * per_layer  # the weights too: the backward pass reads them
    # 16 bytes a parameter (weight, gradient, AdamW's two moments); what torch 2.13 keeps and a quarter more.
    return 16 * params + 4 * buffers + kept * 5 // 4


def check_model_fits(mconf, batch_size, block_size, device, dtype):
    """Refuses, before it is built, a model whose training cannot fit in the device's memory."""
    shrink = 2 if dtype.itemsize < 4 else 1  # activations in 16 bits: at least half of it still
    size, where = memory_size(device)
    if memory_bound(mconf, batch_size, block_size) // shrink <= size:
        return  # fits for sure: no second spent measuring
    try:
        n_params, needed = training_memory(mconf, batch_size, block_size)
    except (RuntimeError, OverflowError) as e:  # sizes past what a tensor can have
        raise UserError(f"the model is too large to build ({str(e).splitlines()[0][:120]}); "
                        "make it smaller (--n_layer, --n_embd, --block_size, --batch_size)") from None
    needed //= shrink
    if needed > size:
        raise UserError(f"training a model of {n_params:,} parameters on batches of {batch_size} x {block_size} "
                        f"tokens needs at least {gigabytes(needed)}, and {where} is {gigabytes(size)}; make it "
                        "smaller (--n_layer, --n_embd, --block_size, --batch_size)")


def gigabytes(n):
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def pick_dtype(name, device_type, training=False):
    """The dtype of the matmuls. auto: bf16 on a GPU that has it (else fp16); on a CPU, fp32,
    except for training on a CPU whose bf16 matmuls are measured faster (cpu_bf16_is_faster)."""
    if name == "auto":
        if device_type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if training and device_type == "cpu" and cpu_bf16_is_faster() else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise UserError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return dtypes[name]


def autocast(device_type, dtype):
    """Mixed precision in dtype on device_type; for float32, nothing."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)


def training_autocasts(device_type, dtype):
    """(the training steps' autocast, the evaluations'). On a CPU the evaluations run in fp32: exact,
    and the figure python -m tinygpt.score gives for the same text."""
    return autocast(device_type, dtype), autocast(device_type, torch.float32 if device_type == "cpu" else dtype)


@functools.cache
def cpu_bf16_is_faster(n=256, repeats=10):
    """Whether this CPU multiplies bf16 matrices at least 1.25x as fast as fp32 ones, timed.

    CPUs with native bf16 instructions (avx512_bf16, AMX) do it 2 to 3x as fast, which nearly
    halves a training step of the CPU presets; most others emulate bf16 at half fp32's speed.
    A measurement (a few ms) tells them apart where feature flags vary by vendor and version.
    """
    def best(dtype):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(torch.float32) >= 1.25 * best(torch.bfloat16)


def keep_freed_memory(mmap_threshold=32 << 20, trim_threshold=1 << 30):
    """Tells glibc's malloc to keep freed memory for the next allocation instead of handing it
    back to the system. Returns whether it could (False off glibc: nothing to do).

    A CPU training step frees and reallocates the same activations every step. By default glibc
    gives large freed blocks back (munmap, or trimming the heap), and the next step faults each
    page in again, zeroed by the kernel: a mul after a 1536 x 512 matmul took 400 us where 90 were
    the arithmetic, and the classic preset's step 10% longer. Allocations up to mmap_threshold
    now come from the heap, which is trimmed only past trim_threshold of free memory at its top:
    the process keeps its peak, as it would hold it during the steps anyway.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>; either one also stops glibc's own adjusting
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))


def peak_flops(device_type):
    """The device's dense bf16 FLOP/s if it is a GPU we know, else None."""
    if device_type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((flops for gpu, flops in PEAK_FLOPS.items() if gpu in name), None)


def maybe_compile(model, device_type):
    """torch.compile where a compiler toolchain exists for the device, else eager."""
    if device_type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        print("warning: --compile needs a C++ compiler on CPU and none was found; running uncompiled")
        return model
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            print("warning: --compile needs triton on CUDA and it is not installed; running uncompiled")
            return model
    if device_type == "mps":
        print("warning: --compile is not supported on mps here; running uncompiled")
        return model
    return torch.compile(model)


def machine():
    """What a measurement ran on, in words: the processor, cores, accelerator and torch."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu} ({cpu_count()} cores, {torch.get_num_threads()} torch threads){gpu}, torch {torch.__version__}"
