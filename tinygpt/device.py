"""Where the code runs: the device, whether a model fits in its memory, the dtype,
torch.compile, and the peak for MFU."""

import contextlib
import dataclasses
import functools
import platform
import re
import shutil
import time
from pathlib import Path

import torch

from config import UserError
from model import GPT
from tinygpt.system import memory_bytes
from tinygpt.tokenizer import cpu_count

# Dense bf16 tensor-core peaks, for MFU, by a pattern of torch.cuda.get_device_name(), the most specific first
# ("NVIDIA H100 PCIe" is no SXM H100). A GPU not listed (an A10G, whose peak NVIDIA does not publish) gets no MFU.
PEAK_FLOPS = [(r"H100.*PCIe", 756e12), (r"H100.*NVL", 835e12), (r"H100", 989e12), (r"H200.*NVL", 835e12),
              (r"H200", 989e12), (r"A100", 312e12), (r"\bA10\b", 125e12), (r"\bL40S\b", 362e12),
              (r"\bL4\b", 121e12), (r"RTX 4090", 165e12)]


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
    """(bytes, what) of the memory a model on device lives in: the GPU's free memory; on Apple Silicon (mps) the
    share of the memory it shares with the CPU that Metal lets the GPU use; else the machine's RAM,
    within a container's limit if it sets one. (None, what) where the system does not say."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0], f"{device}'s free memory"
    if device.startswith("mps"):
        return torch.mps.recommended_max_memory(), "the memory Metal lets mps use (shared with the CPU)"
    size = memory_bytes()
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):  # "max" (no limit) is a ValueError
            limit = int(Path(limit_file).read_text(encoding="ascii"))
            size = limit if size is None else min(size, limit)
    return size, "this machine's memory"


def training_memory(mconf, batch_size, block_size, shrink=1):
    """(parameters, bytes) of training mconf on batches of (batch_size, block_size): at
    least each parameter's fp32 weight, gradient and two AdamW moments (16 bytes), the
    buffers, what the forward pass keeps for the backward one, and the logits' gradient (those two
    divided by shrink: 2 in 16 bits). Measured on the meta device, which has shapes but no data: no
    memory and no time, however large the model. The blocks are alike: models of 0 and 1 block tell all."""
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
    return n_params, 16 * n_params + 4 * n_buffers + (kept + 4 * batch_size * block_size * mconf.vocab_size) // shrink


def memory_bound(mconf, batch_size, block_size, shrink=1):
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
    # Each query's H x T attention weights; additive scores' (B, H, T, T, hs) tanh, where H * hs = C.
    weights = 4 * H * T + 4 * T * C * (mconf.score == "additive")
    per_layer = (tokens * (norms + 4 * C * rows + attention * weights)
                 + 4 * T * T * (mixer != "none") + 8 * T * C * (mconf.pos == "rope"))  # a (T, T) mask; rope's cos, sin
    # Once: the ids (int64) and positions; x, its dropout mask, ln_f's input, mean and rstd, lm_head's input;
    # the log-softmax, and the logits' gradient that training_memory adds.
    once = tokens * (8 + 4 * C * (2 + drop + ln) + 8 * ln + 8 * V) + 8 * T + 4
    kept = 4 * params + once + mconf.n_layer * per_layer  # the weights too: the backward pass reads them
    # 16 bytes a parameter (weight, gradient, AdamW's two moments); what torch 2.13 keeps and a quarter more.
    return 16 * params + 4 * buffers + kept * 5 // 4 // shrink


def check_model_fits(mconf, batch_size, block_size, device, dtype):
    """Refuses, before it is built, a model whose training cannot fit in the device's memory."""
    # Activations in 16 bits take half the room, at least; weights, gradients and AdamW's moments stay fp32.
    shrink = 2 if dtype.itemsize < 4 else 1
    size, where = memory_size(device)
    if size is None or memory_bound(mconf, batch_size, block_size, shrink) <= size:
        return  # fits for sure (no second spent measuring), or no size to hold it against
    try:
        n_params, needed = training_memory(mconf, batch_size, block_size, shrink)
    except (RuntimeError, OverflowError) as e:  # sizes past what a tensor can have
        raise UserError(f"the model is too large to build ({str(e).splitlines()[0][:120]}); "
                        "make it smaller (--n_layer, --n_embd, --block_size, --batch_size)") from None
    if needed > size:
        raise UserError(f"training a model of {n_params:,} parameters on batches of {batch_size} x {block_size} "
                        f"tokens needs at least {gigabytes(needed)}, and {where} is {gigabytes(size)}; make it "
                        "smaller (--n_layer, --n_embd, --block_size, --batch_size)")


def gigabytes(n):
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def pick_dtype(name, device_type, training=False):
    """The dtype of the matmuls. auto: bf16 on a CUDA GPU that has it (else fp16); on a CPU or Apple
    Silicon (mps), fp32, except for training where bf16 matmuls are timed faster there (bf16_is_faster).
    Sampling stays fp32 off CUDA: one token at a time is too little work for bf16 to pay."""
    if name == "auto":
        if device_type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        faster = training and device_type in ("cpu", "mps") and bf16_is_faster(device_type)
        return torch.bfloat16 if faster else torch.float32
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
def bf16_is_faster(device_type="cpu", repeats=10):
    """Whether this device multiplies bf16 matrices at least 1.25x as fast as fp32 ones, timed.

    CPUs with native bf16 instructions (avx512_bf16, AMX) do it 2 to 3x as fast, which nearly
    halves a training step of the CPU presets; most others emulate bf16 at half fp32's speed.
    A measurement (a few ms) tells them apart where feature flags vary by vendor and version.
    Apple Silicon's GPU (mps) is timed the same way, on larger matrices (its launches cost more);
    where it has no bf16 (before macOS 14) the answer is no. Not yet run on a Mac here.
    """
    n, sync = (1024, torch.mps.synchronize) if device_type == "mps" else (256, lambda: None)

    def best(dtype):
        a, b = (torch.randn(n, n, dtype=dtype, device=device_type) for _ in range(2))
        a @ b
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    try:
        return best(torch.float32) >= 1.25 * best(torch.bfloat16)
    except (RuntimeError, TypeError):  # no bf16 matmul on this device
        return False


def peak_flops(device_type):
    """The device's dense bf16 FLOP/s if it is a GPU we know, else None."""
    if device_type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((flops for pattern, flops in PEAK_FLOPS if re.search(pattern, name)), None)


def mfu(flops_per_token, tokens_per_s, device_type, world=1):
    """Model FLOPs utilization: the FLOP/s of training tokens_per_s (over every process) against the
    peak of world GPUs; None off a GPU we know."""
    peak = peak_flops(device_type)
    return flops_per_token * tokens_per_s / (world * peak) if peak else None


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
        print("warning: --compile is not tried on mps here: training runs uncompiled (eager) on mps")
        return model
    return torch.compile(model)


def machine():
    """What a measurement ran on, in words: the processor, cores, accelerator and torch."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu} ({cpu_count()} cores, {torch.get_num_threads()} torch threads){gpu}, torch {torch.__version__}"
