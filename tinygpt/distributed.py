"""One process, or one of many under torchrun, each with its own device and a share of the batch.

    torchrun --standalone --nproc_per_node=4 train.py config/shakespeare_char.toml

PyTorch's DistributedDataParallel averages the gradients; what else must be the same on
every process (a plan, a decision to stop) is rank 0's, broadcast to all (agree_on).
"""

import contextlib
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from config import UserError
from tinygpt.device import check_device, pick_device
from tinygpt.system import keep_freed_memory


@dataclass
class Processes:
    rank: int  # this process's number, 0 to world - 1; rank 0 evaluates, saves and prints
    world: int  # how many processes train together
    device: str  # this process's device: cpu, cuda:N or mps

    @property
    def master(self):
        return self.rank == 0

    def say(self, *args, **kwargs):
        """print, from rank 0 alone: one line for the run, not one per process."""
        if self.master:
            print(*args, **kwargs)

    @property
    def backend(self):  # how the processes talk (nccl, gloo), or None for one process without torchrun
        return dist.get_backend() if dist.is_initialized() else None

    @property
    def device_type(self):
        return self.device.split(":")[0]

    def agree_on(self, numbers):
        """Rank 0's numbers on every process, so that all make the same plan."""
        if self.world == 1:
            return tuple(numbers)
        t = torch.tensor(numbers, dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=0)
        return tuple(t.tolist())

    def agree(self, flag):
        """Rank 0's flag on every process: its evaluations decide for all."""
        return bool(self.agree_on((float(bool(flag)),))[0])

    def most(self, numbers):
        """Each number's largest value over the processes, on every process: any one's stop request
        (a signal's number), or trouble (a non-finite loss: 1), is every process's."""
        if self.world == 1:
            return tuple(numbers)
        t = torch.tensor(numbers, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(t.tolist())

    @contextlib.contextmanager
    def together(self):
        """A block that may end in a UserError on some processes and not others (rank 0 alone writes
        to out_dir; a process's own device): afterwards every process learns whether any failed, and
        then each raises a UserError, the first failing rank's message printed once, so all exit 2
        rather than some waiting forever in a collective for the others."""
        error = None
        try:
            yield
        except UserError as e:
            error = e
        if self.world > 1:
            first = self.most((-(self.rank if error is not None else self.world),))[0] * -1  # the lowest failed
            if first < self.world and error is None:
                raise UserError()  # printed by the process that met it
            if error is not None and first == self.rank:
                raise UserError(str(error), alone=True) from None
            if error is not None:
                raise UserError() from None
        elif error is not None:
            raise error

    def wrap(self, model):
        """model under DDP when started by torchrun (even as one process), else model itself."""
        if not dist.is_initialized():
            return model
        return DDP(model, device_ids=[torch.device(self.device).index] if self.device_type == "cuda" else None)


def start_processes(device_name):
    """This process: alone, or (started by torchrun, which sets RANK) one of a process group, on
    the GPU of its LOCAL_RANK, talking over NCCL (GPUs) or gloo (CPUs)."""
    device = check_device(pick_device(device_name))
    if device == "cpu":
        keep_freed_memory()  # each step reuses the last one's memory: no page faults
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # fp32 matmuls (--dtype=float32) on tensor cores
        if "RANK" in os.environ:
            device = f"cuda:{os.environ['LOCAL_RANK']}"  # torchrun's processes: one GPU each
        elif device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"  # set_device refuses a GPU without its number
        torch.cuda.set_device(device)  # what follows (bf16 support, the GPU's name, pinned memory) reads this GPU
    if "RANK" not in os.environ:
        return Processes(0, 1, device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return Processes(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device)


def end_processes(finished):
    """Leaves the process group, if there is one. finished: every process reached the end, and
    waits there for the others first (gloo can abort a process whose peer is already gone)."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code):
    """sys.exit(code), or under torchrun os._exit(code) once the output is out: Python's final clean-up
    can free a tensor that gloo's worker thread is still letting go of, and the thread, which then needs
    Python's lock, aborts the process ("terminate called without an active exception": exit -6 in 2 of
    24 two-process tests here). Every file is written and closed before this."""
    if "RANK" not in os.environ:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed stdout: nothing more to say
            stream.flush()
    os._exit(code)
