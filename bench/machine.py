"""What a measurement ran on, in words, for the benchmarks' tables. Run alone, it prints that line:

    python bench/machine.py
"""

import contextlib
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's modules

from tinygpt.system import cpu_count  # noqa: E402


def machine():
    """The processor, cores, accelerator and torch."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu} ({cpu_count()} cores, {torch.get_num_threads()} torch threads){gpu}, torch {torch.__version__}"


if __name__ == "__main__":
    print(machine())
