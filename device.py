"""Where the code runs: the device, the dtype, torch.compile, and the peak for MFU."""

import shutil

import torch

from config import UserError

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


def pick_dtype(name, device_type):
    if name == "auto":
        if device_type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32  # bf16 and fp16 matmuls on CPUs are mostly far slower than fp32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise UserError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return dtypes[name]


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
