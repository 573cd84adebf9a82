"""What a measurement ran on, in words, for the benchmarks' tables."""

import contextlib
import platform

import torch

from tinygpt.system import cpu_count


def machine():
    """The processor, cores, accelerator and torch."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu} ({cpu_count()} cores, {torch.get_num_threads()} torch threads){gpu}, torch {torch.__version__}"
