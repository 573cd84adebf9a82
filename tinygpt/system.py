"""Where a script meets its machine, and all that differs between Linux, macOS and Windows. In order: what a
script's main() meets (signals, output streams that close, the exit code), processes and memory, directories; then
where the work runs: the device, whether a model fits in its memory, the dtype, torch.compile, the peak for MFU; and
the processes under torchrun, each on its own device: DDP averages the gradients, and whatever else must agree on
every process (a plan, a decision to stop) is rank 0's, broadcast. Importing it changes nothing: a script's main()
installs what it needs (cli, Stop) and puts it back."""

import contextlib
import ctypes
import dataclasses
import errno
import gc
import importlib.util
import io
import os
import platform
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.nn.parallel import DistributedDataParallel as DDP

from config import UserError
from model import GPT

WINDOWS = sys.platform == "win32"
LINUX = sys.platform.startswith("linux")
_IMPORTED = time.time()

# Dense bf16 tensor-core peaks, for MFU, by a pattern of torch.cuda.get_device_name(), the most specific first
# ("NVIDIA H100 PCIe" is no SXM H100). A GPU not listed (an A10G, whose peak NVIDIA does not publish) gets no MFU.
PEAK_FLOPS = [(r"H100.*PCIe", 756e12), (r"H100.*NVL", 835e12), (r"H100", 989e12), (r"H200.*NVL", 835e12),
              (r"H200", 989e12), (r"A100", 312e12), (r"\bA10\b", 125e12), (r"\bL40S\b", 362e12),
              (r"\bL4\b", 121e12), (r"RTX 4090", 165e12)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = dict(zip(DTYPES.values(), DTYPES))  # dtype -> its name
SMALLER = "make it smaller (--n_layer, --n_embd, --block_size, --batch_size)"  # a model that does not fit
# Ctrl-C, SIGTERM, and SIGHUP (a closed terminal) where the system has it (not Windows)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())

def signal_name(signum):
    return signal.Signals(signum).name  # SIGTERM


class Interrupted(KeyboardInterrupt):
    """A stop signal while main() runs (args: its number): ends main() as Ctrl-C does, its blocks cleaning up."""


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


def cli(main):
    """Wraps main(argv) -> exit code. While it runs, a UserError is one line and exit 2, a stop signal one line and
    128 + its number, and a closed stdout or stderr stops the printing, not the work (Guarded)."""

    def wrapper(argv=None):
        previous = {s: signal.signal(s, raise_interrupted) for s in STOP_SIGNALS}
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = map(Guarded, saved)
        try:
            return main(sys.argv[1:] if argv is None else list(argv)) or 0
        except SystemExit as e:  # --help: printed, and done
            return e.code or 0
        except UserError as e:
            if str(e) and (e.alone or os.environ.get("RANK", "0") == "0"):
                print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as e:
            signum = e.args[0] if isinstance(e, Interrupted) else signal.SIGINT
            print("interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}", file=sys.stderr)
            return 128 + signum
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            sys.stdout.flush()  # while still guarded: the pipe may be gone
            sys.stderr.flush()
            sys.stdout, sys.stderr = saved
            if argv is None:  # a script, whose process ends next: its exit then skips torch's objects: 0.5-0.8 s
                gc.freeze()

    return wrapper


class Stopped(BaseException):
    """A stop signal in an evaluation, which only reads: it ends there (a BaseException, as KeyboardInterrupt)."""


class Stop:
    """While active, a stop signal asks the run to stop and a second ends it. Before the loop (no `model`) one ends
    it as Ctrl-C does. In the loop it sets `signum`: the step ends, saves, exits so; an evaluation gets Stopped (under
    torchrun it ends first, as on every process: they decide together after it)."""

    def __enter__(self):
        self.signum, self.model = None, None
        self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        return self

    def handle(self, signum, frame):
        if self.model is not None and self.signum is None:
            self.signum = signum
            if not self.model.training and "WORLD_SIZE" not in os.environ:
                raise Stopped
            return
        if os.environ.get("RANK", "0") == "0":  # under torchrun every process gets it: one line
            when = "again" if self.model is not None else "while starting, before its first step"
            print(f"stopped by {signal_name(signum)} {when}", file=sys.stderr)
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Guarded:
    """A text stream that swallows its write errors (`| head -1`, a hangup, a full disk) rather than end a sound run;
    the first points its file descriptor at /dev/null (`lost`), so Python's flush at exit finds nothing to say."""

    def __init__(self, stream):
        self.stream, self.lost = stream, False

    def write(self, text):
        try:
            return len(text) if self.lost else self.stream.write(text)
        except UnicodeEncodeError:  # a file name that is not valid UTF-8, say: escaped, not fatal
            encoding = getattr(self.stream, "encoding", None) or "utf-8"
            return self.write(text.encode(encoding, "backslashreplace").decode(encoding, "replace"))
        except (OSError, ValueError):  # ValueError: the stream was closed under us
            self.lose()
            return len(text)

    def flush(self):
        try:
            return None if self.lost else self.stream.flush()
        except (OSError, ValueError):
            self.lose()

    def lose(self):
        self.lost = True
        with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())  # what is still buffered now goes nowhere, without an error
            os.close(devnull)

    def __getattr__(self, name):  # isatty, fileno, encoding, ... as the stream has them
        return getattr(self.stream, name)


def cpu_count():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def process_alive(pid):
    """Whether process pid is running (someone else's included), asked without signalling it."""
    if WINDOWS:
        return _windows_process_alive(pid)
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: only the check
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, alive
        return True
    return True


def _windows_process_alive(pid):
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:
        return ctypes.get_last_error() == 5  # ERROR_ACCESS_DENIED: there, and someone else's
    try:
        code = ctypes.c_ulong()
        return bool(kernel32.GetExitCodeProcess(handle, ctypes.byref(code))) and code.value == 259  # STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


def _windows_memory_bytes():
    class MemoryStatus(ctypes.Structure):  # MEMORYSTATUSEX
        _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong), ("total", ctypes.c_ulonglong),
                    ("rest", ctypes.c_ulonglong * 6)]  # avail, page, avail_page, virt, avail_virt, avail_ext
    status = MemoryStatus(length=ctypes.sizeof(MemoryStatus))
    return status.total if ctypes.WinDLL("kernel32").GlobalMemoryStatusEx(ctypes.byref(status)) else None


def keep_freed_memory():
    """Tells glibc's malloc to keep freed memory for the next allocation; False off glibc. By default it gives
    large blocks back, and each CPU step faults them in again, zeroed: 10% of the classic step (docs/results.md)."""
    if not LINUX or platform.libc_ver()[0] != "glibc":
        return False
    # M_MMAP_THRESHOLD (-3) to 32 MiB, M_TRIM_THRESHOLD (-1) to 1 GiB (<malloc.h>); either stops glibc's adjusting.
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(-3, 32 << 20) and mallopt(-1, 1 << 30))


def process_age():
    """Seconds since this process started (a budget counts Python's start-up): from /proc, else since this import."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat, open("/proc/uptime", encoding="ascii") as uptime:
            started = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: in ticks since boot
            return max(0.0, float(uptime.read().split()[0]) - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time() - _IMPORTED


def sync_directory(path):
    """Makes a rename or a new name in directory path durable; on Windows its file system journals it itself."""
    if WINDOWS:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange(a, b):
    """Swaps directories a and b atomically (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    if not LINUX:
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):  # a C library older than glibc 2.28, or none to ask
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # the kernel or the file system lacks it
        return False
    raise OSError(err, os.strerror(err), str(b))


# --- Where the work runs ---------------------------------------------------------------------------


def choose_device(name):
    """The device name asks for if this machine has it (auto: cuda, then mps, then cpu), else a UserError."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    have = {"cuda": torch.cuda.device_count(), "mps": int(torch.backends.mps.is_available())}.get(device.type, 1)
    if (device.index or 0) >= have:
        gpus = f": this machine has {have} GPU(s), cuda:0 to cuda:{have - 1}" if device.type == "cuda" and have else ""
        raise UserError(f"device {name} does not exist{gpus}; use --device=auto")
    return name


def padded_vocab_size(n, multiple=64):
    """n rounded up to a multiple: GPU matmuls run faster on round sizes (50257 -> 50304)."""
    return -(-n // multiple) * multiple


def memory_size(device):
    """(bytes, what) of the memory a model on device lives in: the GPU's free memory, the share of shared memory
    Metal lets mps use, else the machine's RAM within a container's limit; (None, what) where none is said."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0], f"{device}'s free memory"
    if device.startswith("mps"):
        return torch.mps.recommended_max_memory(), "the memory Metal lets mps use (shared with the CPU)"
    try:
        size = _windows_memory_bytes() if WINDOWS else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no os.sysconf, or no answer
        size = None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError, TypeError):  # "max"
            size = min(size, int(Path(limit_file).read_text(encoding="ascii")))
    return size, "this machine's memory"


def training_memory(mconf, batch_size, block_size, shrink=1):
    """(parameters, bytes) of training mconf on (batch_size, block_size) batches: 16 bytes a parameter (fp32
    weight, gradient, AdamW's two moments), the buffers, and what the backward keeps plus the logits' gradient,
    both divided by shrink (2 in 16 bits). Measured on the meta device, which has shapes but no data: no memory,
    no time. The blocks are alike: models of 0 and 1 block tell all."""
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

    n_params, n_buffers, kept = (zero + mconf.n_layer * (one - zero) for zero, one in zip(measure(0), measure(1)))
    return n_params, 16 * n_params + 4 * n_buffers + (kept + 4 * batch_size * block_size * mconf.vocab_size) // shrink


def memory_bound(mconf, batch_size, block_size, shrink=1):
    """At least what training_memory measures, from the config's numbers alone: microseconds, where its first
    meta op imports torch's meta kernels and sympy (over a second). Every block counts as a full one: within 2x
    of the measurement for a GPT, higher for the ladder's first rungs (small)."""
    C, V, T, L, tokens = mconf.n_embd, mconf.vocab_size, block_size, mconf.n_layer, batch_size * block_size
    params = L * (12 * C * C + 13 * C) + C * (2 * V + 2 + mconf.block_size)  # at most
    # Kept for the backward pass, per token and layer: 26 fp32 rows of C (the LayerNorms' inputs, q, k, v, the
    # feed-forward's 4C-wide ones, dropout masks), each head's T weights, and additive scores' tanh (T x C).
    per_layer = tokens * 4 * (26 * C + 4 + mconf.n_head * T + T * C * (mconf.score == "additive")) + 12 * T * (T + C)
    once = tokens * (16 + 20 * C + 8 * V) + 8 * T + 4  # ids, x, ln_f, logits and their gradient
    # 16 bytes a parameter (weight, gradient, AdamW's two moments); what torch 2.13 keeps and a quarter more.
    return 16 * params + 4 * (mconf.block_size + 1) * C + (4 * params + once + L * per_layer) * 5 // 4 // shrink


def check_model_fits(mconf, batch_size, block_size, device, dtype):
    """Refuses, before it is built, a model whose training cannot fit in the device's memory."""
    # Activations in 16 bits take half the room, at least; weights, gradients and AdamW's moments stay fp32.
    shrink = 2 if dtype.itemsize < 4 else 1
    size, where = memory_size(device)
    if size is None or memory_bound(mconf, batch_size, block_size, shrink) <= size:
        return  # fits for sure, or no size to say
    try:
        n_params, needed = training_memory(mconf, batch_size, block_size, shrink)
    except (RuntimeError, OverflowError) as e:  # sizes past what a tensor can have
        raise UserError(f"the model is too large to build ({str(e).splitlines()[0][:120]}); {SMALLER}") from None
    if needed > size:
        raise UserError(f"training a model of {n_params:,} parameters on batches of {batch_size} x {block_size} "
                        f"tokens needs at least {gigabytes(needed)}, and {where} is {gigabytes(size)}; {SMALLER}")


def gigabytes(n):
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def pick_dtype(name, device_type, training=False):
    """The dtype of the matmuls. auto: on a CUDA GPU bf16 where it has it, else fp16; elsewhere fp32, but bf16 to
    train on a CPU that has it natively (cpu_has_bf16): sampling's one token at a time is too little work to pay."""
    if name != "auto":
        return DTYPES[name]
    if device_type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if training and device_type == "cpu" and cpu_has_bf16() else torch.float32


def cpu_has_bf16():
    """Whether this CPU multiplies bf16 matrices natively (avx512_bf16 or AMX), where the CPU presets' step takes
    half as long in bf16 (others emulate it, slower than fp32). Read, not timed: a busy machine changes nothing."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def autocast(device_type, dtype):
    """Mixed precision in dtype on device_type; for float32, nothing."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)


def compiler_missing(device_type):
    """Why torch.compile cannot run on device_type here, or None where it can."""
    if device_type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return "--compile needs a C++ compiler on CPU and none was found"
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return "--compile needs triton on CUDA and it is not installed"
    if device_type == "mps":
        return "--compile is not tried on mps here"
    return None


def maybe_compile(model, device_type):
    """torch.compile where a compiler toolchain exists for the device, else eager."""
    if missing := compiler_missing(device_type):
        print(f"warning: {missing}; running uncompiled")
        return model
    return torch.compile(model)


def machine(device, dtype):
    """What decides how fast a run goes here, the run aside: this host, the device (a GPU's name), the CPU
    kernels torch picked (AVX2 or AVX512), the threads, the dtype and torch's version."""
    what = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
    return (f"{platform.node()} {what} {torch.backends.cpu.get_cpu_capability()} {torch.get_num_threads()} "
            f"threads {NAMES[dtype]} torch {torch.__version__}")


def peak_flops(device_type):
    """The device's dense bf16 FLOP/s if it is a GPU we know, else None."""
    name = torch.cuda.get_device_name() if device_type == "cuda" else ""  # "": no pattern matches
    return next((flops for pattern, flops in PEAK_FLOPS if re.search(pattern, name)), None)


def mfu(device_type, model, cfg, tokens_per_s):
    """Training model (cfg's shape) at tokens_per_s as a share of the GPU's bf16 peak; None without a peak."""
    if peak := peak_flops(device_type):
        flops = train_flops_per_token(model.num_params(), cfg.n_layer, cfg.n_embd, cfg.block_size)
        return flops * tokens_per_s / peak
    return None


def train_flops_per_token(params, n_layer, n_embd, block_size):
    """Forward and backward: 6 per weight a token passes through, plus attention over the context."""
    return 6 * params + 12 * n_layer * n_embd * block_size


@dataclass
class Processes:
    """This process among those that train together: one alone, or one of torchrun's."""

    rank: int  # this process's number, 0 to world - 1
    world: int  # how many processes train together
    device: str  # this process's device: cpu, cuda:N or mps

    def __post_init__(self):
        self.master, self.device_type = self.rank == 0, self.device.split(":")[0]

    def say(self, *args, **kwargs):
        """print, from rank 0 alone: one line for the run, not one per process."""
        if self.master:
            print(*args, **kwargs)

    def broadcast(self, numbers):
        """Rank 0's numbers on every process, so that all make the same plan."""
        return tuple(numbers) if self.world == 1 else self._sync(numbers, dist.broadcast, src=0)

    def all_max(self, numbers):
        """Each number's maximum over the processes: one's stop request (a signal) or trouble is every process's."""
        return tuple(numbers) if self.world == 1 else self._sync(numbers, dist.all_reduce, op=ReduceOp.MAX)

    def _sync(self, numbers, collective, **kwargs):
        t = torch.tensor(numbers, dtype=torch.float64, device=self.device)
        with peer_lost():
            collective(t, **kwargs)
        return tuple(t.tolist())

    def fail_together(self):
        """A block that may raise a UserError on some processes only (rank 0 alone writes out_dir): then all raise
        one, the first failing rank's message printed once, none left waiting in a collective. Alone, a plain block."""
        return contextlib.nullcontext() if self.world == 1 else self._fail_together()

    @contextlib.contextmanager
    def _fail_together(self):
        error = None
        try:
            yield
        except UserError as e:
            error = e
        first = -self.all_max((-(self.rank if error is not None else self.world),))[0]  # the lowest failed
        if first < self.world:
            raise UserError(str(error) if first == self.rank else "", alone=first == self.rank) from None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        """Leaves the process group, if there is one. Where every process reached the end (returned,
        or met the same UserError), it waits there for the others first: gloo can abort a process
        whose peer is already gone."""
        if dist.is_initialized():
            if exc_type is None or issubclass(exc_type, UserError):
                with contextlib.suppress(RuntimeError):  # one gone after all (peer_lost)
                    dist.barrier()
            dist.destroy_process_group()
            # gloo's threads may still be letting go of the last collective's tensors, which takes Python's
            # lock: were the interpreter ending by then, the process would abort (exit -6, "terminate called").
            time.sleep(0.2)

    def wrap(self, model):
        """model under DDP when started by torchrun (even as one process), else model itself."""
        if not dist.is_initialized():
            return model
        with peer_lost():  # DDP sends rank 0's weights to every process
            return DDP(model, device_ids=[torch.device(self.device).index] if self.device_type == "cuda" else None)


@contextlib.contextmanager
def peer_lost():
    """Under torchrun, a collective that another process left (stopped or failed): one line, not a traceback."""
    try:
        yield
    except RuntimeError as e:
        if not dist.is_initialized() or isinstance(e, torch.OutOfMemoryError):
            raise
        said = str(e).split("] ", 1)[-1].split(". ")[0]  # gloo: "[pair.cc:553] Connection closed by peer [...]. ..."
        raise UserError(f"lost another process of this run ({said}): it stopped or failed, as its output says; "
                        "this one stops too") from None


def start_processes(device_name):
    """This process: alone, or one of torchrun's (RANK set) on the GPU of its LOCAL_RANK, over NCCL or gloo.
    Used as a context (`with`), it leaves the process group at its end."""
    device = choose_device(device_name)
    if device == "cpu":
        keep_freed_memory()
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # fp32 matmuls (--dtype=float32) on tensor cores
        if "RANK" in os.environ:
            device = f"cuda:{os.environ['LOCAL_RANK']}"  # torchrun's processes: one GPU each
        elif device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"  # set_device refuses a GPU without its number
        torch.cuda.set_device(device)  # what follows (bf16 support, the GPU's name, pinned memory) reads this GPU
    if "RANK" not in os.environ:
        return Processes(0, 1, device)
    cuda = device.startswith("cuda")
    dist.init_process_group(backend="nccl" if cuda else "gloo", device_id=torch.device(device) if cuda else None)
    procs = Processes(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device)
    procs.say(f"{procs.world} process(es), DDP over {dist.get_backend()}")
    return procs
