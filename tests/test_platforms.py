"""Windows, macOS and Apple Silicon, tried on Linux: each test makes this machine look like another in
one way (a module, a signal or a call it lacks, a call that does something else there, another default
encoding, an MPS device that says yes) and runs the real scripts, or the decision, under it.

What cannot be run here: Windows' own calls (kernel32's process probe, its memory size; msvcrt's locks,
which the out_dir's lock takes from filelock) and a real MPS device. Their stand-ins below behave as
those calls are documented to."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from config import UserError
from model import GPT, GPTConfig
from tinygpt import files, system

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")
TEXT = "To be, or not to be: that is the question. Зачем? 你好 — ½ café\n" * 60  # outside cp1252 and ASCII too

# Run in a fresh process: the masks named in argv[1], then the scripts' own main() end to end, printing
# each exit code. A mask is what another system does differently, applied to this one before anything runs.
RUNNER = textwrap.dedent("""
    import os, signal, subprocess, sys
    masks, work = sys.argv[1].split(","), sys.argv[2]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sys.path.insert(0, os.getcwd())
    if "no_fcntl" in masks:  # Windows has no fcntl module (filelock then locks with a file of its own)
        sys.modules["fcntl"] = None
    if "no_sighup" in masks:  # nor SIGHUP
        del signal.SIGHUP
    if "no_sysconf" in masks:  # nor os.sysconf
        del os.sysconf
    if "windows_kill" in masks or "windows_dirs" in masks:
        from tinygpt import system
        system.WINDOWS, system.LINUX = True, False
        # kernel32's answers, from Linux: a pid /proc knows runs (asked without a signal); the RAM's size
        system._windows_process_alive = lambda pid: os.path.exists(f"/proc/{pid}")
        system._windows_memory_bytes = lambda: ram
    if "windows_kill" in masks:  # os.kill(pid, 0) on Windows ends the process: here it fails loudly
        def kill(pid, sig, real=os.kill):
            if sig == 0:
                raise RuntimeError(f"os.kill({pid}, 0) would end process {pid} on Windows")
            return real(pid, sig)
        os.kill = kill
    if "windows_dirs" in masks:  # a directory cannot be opened as a file on Windows
        import shutil
        shutil._use_fd_functions = False  # nor does shutil.rmtree there open directories
        def open_(path, flags, *args, real=os.open):
            if os.path.isdir(path):
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, flags, *args)
        os.open = open_
    if "macos" in masks:  # no renameat2 (the data set is swapped in two renames), no glibc to tune, no /proc
        import builtins
        from tinygpt import system
        system.LINUX = False
        def open_(file, *args, real=builtins.open, **kwargs):
            if str(file).startswith("/proc/"):
                raise FileNotFoundError(2, "No such file or directory", str(file))
            return real(file, *args, **kwargs)
        builtins.open = open_
    import prepare, sample, train
    data, out = f"{work}/data", f"{work}/out"
    stale = subprocess.Popen([sys.executable, "-c", "pass"]); stale.wait()  # a pid that no longer runs
    for pid in (stale.pid, os.getppid()):  # left by a killed prepare.py, and by one that still runs
        os.makedirs(f"{work}/.data.staging-{pid}", exist_ok=True)
    steps = [
        (prepare, ["--input", f"{work}/input.txt", "--out_dir", data]),
        (prepare, ["--input", f"{work}/input.txt", "--out_dir", data]),  # swapped in over the first
        (train, [sys.argv[3], f"--data_dir={data}", f"--out_dir={out}", "--max_iters=4", "--eval_interval=2"]),
        (train, [f"--data_dir={data}", f"--out_dir={out}", "--init_from=resume", "--max_iters=6"]),
        (sample, [f"--out_dir={out}", f"--start=FILE:{work}/prompt.txt", "--max_new_tokens=20", "--unknown=skip"]),
    ]
    for script, args in steps:
        print(f"{script.__name__}: exit {script.main(args)}", flush=True)
    print("stale staging left:", sorted(p for p in os.listdir(work) if p.startswith(".data.staging")))
""")

MASKS = {
    "no_fcntl": {},
    "no_sighup": {},
    "no_sysconf": {},
    "windows_kill": {},
    "windows_dirs": {},
    "macos": {},
    # Windows' console and files: not UTF-8 by default. The C locale without its UTF-8 coercion makes
    # Python's default file encoding ASCII; stdout writes cp1252 and fails on what it cannot encode.
    # (This one passed before tinygpt/system.py too: every text file was already opened as UTF-8, and
    # terminal.Guarded escapes what the console cannot show. The scan below keeps it so.)
    "cp1252": {"LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
               "PYTHONIOENCODING": "cp1252:strict"},
}
MASKS["windows"] = {k: v for env in MASKS.values() for k, v in env.items()}
WINDOWS_MASKS = [mask for mask in MASKS if mask not in ("macos", "windows")]


@pytest.mark.parametrize("mask", MASKS)
def test_the_scripts_run_end_to_end_on_a_system_that_differs(tmp_path, mask):
    (tmp_path / "input.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "prompt.txt").write_text("café Зачем ½", encoding="utf-8")
    masks = ",".join(WINDOWS_MASKS) if mask == "windows" else mask
    env = {**os.environ, **MASKS[mask], "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", RUNNER, masks, str(tmp_path), TINY], cwd=ROOT, env=env,
                            capture_output=True, timeout=300)
    out, err = result.stdout.decode("utf-8", "replace"), result.stderr.decode("utf-8", "replace")
    assert result.returncode == 0, err[-3000:]
    assert [line for line in out.splitlines() if ": exit " in line] == [
        "prepare: exit 0", "prepare: exit 0", "train: exit 0", "train: exit 0", "sample: exit 0"], out + err
    assert f"stale staging left: ['.data.staging-{os.getpid()}']" in out  # the dead one's went, the live one's not
    assert "resuming" in out and "done: 6 iterations" in out


# --- Processes and signals -----------------------------------------------------------------------------


def test_a_dead_process_is_found_without_signalling_anyone_on_windows(tmp_path, monkeypatch):
    def kill(pid, sig):
        raise AssertionError(f"os.kill({pid}, {sig}) ends process {pid} on Windows")

    monkeypatch.setattr(system, "WINDOWS", True)
    monkeypatch.setattr(system, "_windows_process_alive", lambda pid: pid == os.getppid())
    monkeypatch.setattr(os, "kill", kill)
    target = tmp_path / "data"
    for pid in (os.getppid(), 999_999_999):
        (tmp_path / f".data.staging-{pid}").mkdir()
    files.remove_stale(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".data.staging-{os.getppid()}"]


IMPORTS = textwrap.dedent("""
    import glob, importlib, signal, sys
    sys.path.insert(0, ".")
    signals = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s]
    before = [signal.getsignal(s) for s in signals], sys.stdout, sys.stderr
    modules = ["train", "sample", "prepare", "config"] + [f"tinygpt.{p[8:-3]}" for p in glob.glob("tinygpt/*.py")]
    for name in modules:
        importlib.import_module(name.removesuffix(".__init__"))
    after = [signal.getsignal(s) for s in signals], sys.stdout, sys.stderr
    print(len(modules), "modules;", "the same" if after == before else f"changed: {before} -> {after}")
""")


def test_importing_any_module_of_ours_leaves_the_signal_handlers_and_the_streams_as_they_were():
    result = subprocess.run([sys.executable, "-c", IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    count, said = result.stdout.split(" modules; ")
    assert int(count) > 15 and said.strip() == "the same"


ATEXIT = textwrap.dedent("""
    import atexit, gc, runpy, sys
    sys.path.insert(0, ".")
    atexit.register(lambda: print("Python's clean-up ran; objects frozen:", gc.get_freeze_count() > 0))
    sys.argv = ["prepare.py", "--help"]
    runpy.run_path("prepare.py", run_name="__main__")
""")


def test_a_script_ends_through_pythons_own_exit_so_its_clean_up_runs_its_objects_frozen():
    """Frozen: the interpreter's last collections skip the objects of torch and the run, which would
    take them most of a second (bench: sample.py's whole process)."""
    result = subprocess.run([sys.executable, "-c", ATEXIT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result
    assert result.stdout.rstrip().endswith("Python's clean-up ran; objects frozen: True"), result


def test_stop_signals_are_those_the_system_has():
    assert set(system.STOP_SIGNALS) == {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    windows = "import signal; del signal.SIGHUP; from tinygpt import system; print(system.STOP_SIGNALS)"
    result = subprocess.run([sys.executable, "-c", windows], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == str((signal.SIGINT, signal.SIGTERM)), result


def test_every_text_file_is_read_and_written_as_utf8_whatever_the_default():
    """The scan behind the cp1252 run above: no text-mode open, read_text or write_text in the project
    leaves the encoding to the platform's default (Windows': cp1252)."""
    import ast

    left = []
    for path in [*ROOT.glob("*.py"), *ROOT.glob("tinygpt/*.py"), *ROOT.glob("config/*.py"), *ROOT.glob("bench/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or "encoding" in {k.arg for k in node.keywords}:
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("read_text", "write_text") and not (
                    isinstance(func.value, ast.Name) and func.value.id in ("textfiles", "prompts")):
                left.append(f"{path.name}:{node.lineno}")
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"),
                                                                 None)
            if isinstance(func, ast.Name) and func.id == "open" and "b" not in getattr(mode, "value", "r"):
                left.append(f"{path.name}:{node.lineno}")
    assert not left


# --- Apple Silicon (mps) ------------------------------------------------------------------------------


@pytest.fixture
def mac(monkeypatch):
    """A Mac with Apple Silicon, as torch would see it: no CUDA, MPS available, 8 GB for Metal to use."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 8 * 10**9)


def test_auto_picks_mps_on_apple_silicon(mac):
    assert system.choose_device("auto") == "mps" and system.choose_device("mps") == "mps"


def test_auto_trains_in_fp32_on_mps(mac):
    """Apple Silicon's GPU: bf16 matmuls not known to be faster there, so fp32 unless asked for."""
    assert system.pick_dtype("auto", "mps", training=True) == torch.float32
    assert system.pick_dtype("auto", "mps") == torch.float32
    assert system.pick_dtype("bfloat16", "mps", training=True) == torch.bfloat16


def test_the_memory_check_counts_what_metal_lets_mps_use(mac, monkeypatch):
    assert system.memory_size("mps")[0] == 8 * 10**9
    big = GPTConfig(vocab_size=65, block_size=512, n_layer=12, n_head=12, n_embd=768)  # 16 GB to train at batch 32
    with pytest.raises(UserError, match="the memory Metal lets mps use"):
        system.check_model_fits(big, 32, 512, "mps", torch.float32)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 64 * 10**9)  # a Mac with more
    system.check_model_fits(big, 32, 512, "mps", torch.float32)


def test_compile_on_mps_says_it_runs_uncompiled(mac, capsys):
    model = GPT(GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=16))
    assert system.maybe_compile(model, "mps") is model
    assert "uncompiled" in capsys.readouterr().out
