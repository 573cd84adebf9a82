"""Where a training step's time goes: torch.profiler over train.py's own step.

    python bench/profile_step.py config/shakespeare_char_cpu.toml
    python bench/profile_step.py config/shakespeare_char_cpu_fast.toml --steps=30 --rows=30

Builds the preset's model and optimizer as train.py does, with its dtype (bf16 autocast
where --dtype=auto picks it) and its allocator setting, runs a few warm-up steps,
then profiles --steps more and prints the operators that took the most time (self
CPU time: the operator's own work, not the operators it calls), and the step's
time split into forward, backward and optimizer.
"""

import contextlib
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's modules

import train  # noqa: E402
from model import GPT  # noqa: E402
from tinygpt import system  # noqa: E402
from tinygpt.system import (
    keep_freed_memory,  # noqa: E402
    pick_dtype,  # noqa: E402
)


@system.cli
def main(argv):
    steps, rows, rest = 20, 25, []
    for arg in argv:
        if arg.startswith("--steps="):
            steps = int(arg.split("=", 1)[1])
        elif arg.startswith("--rows="):
            rows = int(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    cfg = train.load_config(train.TrainConfig, rest, "bench/profile_step.py", __doc__.strip().splitlines()[0])
    vocab_size = 65
    keep_freed_memory()
    dtype = pick_dtype(cfg.dtype, "cpu", training=True)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    torch.manual_seed(cfg.seed)
    model = GPT(train.model_config(cfg, vocab_size))
    optimizer = train.make_optimizer(model, cfg, "cpu")
    data = np.random.default_rng(0).integers(0, vocab_size, 200_000).astype(np.uint16)
    rng = np.random.default_rng(0)

    def step():
        x, y = train.get_batch(data, cfg.batch_size, cfg.block_size, rng, "cpu")
        with record_function("forward"), autocast:
            _, loss = model(x, y)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(5):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    plain_ms = (time.perf_counter() - t0) / steps * 1000
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    print(f"{' '.join(rest)}: {plain_ms:.1f} ms a step unprofiled, {str(dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads")
    events = {e.key: e for e in prof.key_averages()}
    for phase in ("forward", "backward", "optimizer"):
        if phase in events:
            print(f"  {phase}: {events[phase].cpu_time_total / steps / 1000:.1f} ms a step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
