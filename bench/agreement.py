"""What the processes' agreement after each training step costs: two gloo processes on this machine,
each timing its training step (DDP) and the agreement (Processes.most, one all-reduce of two numbers)
in turn, as train.py runs them one after the other.

    python bench/agreement.py                                   # nanoGPT's CPU model (the classic preset)
    python bench/agreement.py --preset=config/shakespeare_char_cpu_fast.toml --rounds=300

Prints each process's step without the agreement, with it after every step, and with it every 10 steps as
train.py does (medians of blocks of ten steps, the three taking turns), and one agreement alone.
"""

import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's modules

from config import load_config, option  # noqa: E402
from tinygpt import system  # noqa: E402


@dataclass
class BenchConfig:
    preset: str = option(str(ROOT / "config" / "shakespeare_char_cpu.toml"), "the run whose step is timed")
    rounds: int = option(200, "steps (and agreements) timed in each process, after 20 to warm up", low=1)


def worker(preset, rounds):
    """One of the two processes: train.py's own step under DDP, and the agreement, taking turns."""
    import functools

    import numpy as np
    import torch

    import train
    from tinygpt.system import autocast, pick_dtype, start_processes

    cfg = load_config(train.TrainConfig, [preset, "--device=cpu"])
    procs = start_processes("cpu")
    torch.manual_seed(0)
    model = train.GPT(train.model_config(cfg, 65))
    optimizer = train.make_optimizer(model, cfg, "cpu")
    ddp = procs.wrap(model)
    data = np.random.default_rng(procs.rank).integers(0, 65, 200_000).astype(np.uint16)
    rng = np.random.default_rng(1)
    batch = functools.partial(train.get_batch, data, cfg.batch_size, cfg.block_size, rng, "cpu")
    mixed = autocast("cpu", pick_dtype(cfg.dtype, "cpu", training=True))
    step = functools.partial(train.train_step, ddp, optimizer, torch.amp.GradScaler("cpu", enabled=False), mixed, cfg,
                             *batch(), iter(batch, None))
    every = {1: [], 10: [], 0: []}  # per-step time of blocks of 10 steps: agreeing after each, after the 10th, never
    for b in range(3 * (rounds // 10) + 6):
        cadence = (1, 10, 0)[b % 3]
        t0 = time.perf_counter()
        for i in range(1, 11):
            step()
            if cadence and i % cadence == 0:
                procs.most((0, 0))
        if b >= 6:  # the first blocks warm up
            every[cadence].append((time.perf_counter() - t0) / 10)
    t1 = time.perf_counter()
    for _ in range(rounds):
        procs.most((0, 0))
    alone_us = (time.perf_counter() - t1) / rounds * 1e6
    ms = {k: statistics.median(v) * 1e3 for k, v in every.items()}
    print(f"rank {procs.rank}: a step {ms[0]:.2f} ms; agreeing after each step {ms[1]:.2f} ms "
          f"({ms[1] / ms[0] - 1:+.2%}), every 10 steps {ms[10]:.2f} ms ({ms[10] / ms[0] - 1:+.2%}); "
          f"one agreement alone {alone_us:.0f} us", flush=True)
    torch.distributed.destroy_process_group()


@system.cli
def main(argv):
    cfg = load_config(BenchConfig, argv, "bench/agreement.py", __doc__)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'bench')!r}); " \
           f"import agreement; agreement.worker({cfg.preset!r}, {cfg.rounds})"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                              env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for rank in range(2)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
