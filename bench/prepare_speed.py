"""Data preparation speed and memory: MB/s and peak RSS, char and BPE, on a large file.

    python bench/prepare_speed.py                     # 100 MB made by repeating Tiny Shakespeare
    python bench/prepare_speed.py --size_mb=1000      # the peak memory should hardly change
    python bench/prepare_speed.py --tokenizers=gpt2   # a named encoding, if its files are cached

Each run is prepare.py's own main() in a fresh child process, which reports its
peak resident memory (getrusage). The default BPE run uses an encoding built here,
the 256 bytes plus merges that spell out the input's most common words, because
tiktoken's named encodings download their files on first use; with their 50k to
200k merges those run at a somewhat different speed.
"""

import contextlib
import io
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import tiktoken.registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's modules

import prepare
from config import UserError, load_config, option
from tinygpt import system  # noqa: E402
from tinygpt.system import cpu_count

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare/input.txt"
LOCAL = "bench_local_bpe"


@dataclass
class BenchConfig:
    size_mb: int = option(100, "size of the test file, in MB (10^6 bytes)")
    source: str = option(str(SHAKESPEARE), "UTF-8 text repeated to make the test file")
    tokenizers: list[str] = option(["char", LOCAL], f"what to time: char, {LOCAL} (built here) or a tiktoken name")
    words: int = option(2000, f"how many of the source's most common words {LOCAL} has merges for")


def local_encoding(source, n_words):
    """tiktoken.Encoding arguments: bytes, then every prefix of the common words (with and
    without their leading space), shorter first, so that BPE merges its way up to the word."""
    counts = Counter(re.findall(r"\w+", Path(source).read_text(encoding="utf-8")))
    pieces = {form.encode()[:n] for word, _ in counts.most_common(n_words) for form in (word, " " + word)
              for n in range(2, len(form.encode()) + 1)}
    ranks = {bytes([i]): i for i in range(256)}
    for piece in sorted(pieces, key=lambda p: (len(p), p)):
        ranks[piece] = len(ranks)
    pattern = r""" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""  # words with their space, like GPT-2's
    eot = {"<|endoftext|>": len(ranks)}
    return {"name": LOCAL, "pat_str": pattern, "mergeable_ranks": ranks, "special_tokens": eot}


def child(tokenizer, source, n_words, input_path, out_dir):
    """Runs in a fresh process: prepares input_path and prints its time and peak memory as JSON."""
    tiktoken.list_encoding_names()  # fills tiktoken's table, so the local encoding joins it like a plugin's
    tiktoken.registry.ENCODING_CONSTRUCTORS[LOCAL] = lambda: local_encoding(source, int(n_words))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    output = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(output):
        code = prepare.main(["--input", input_path, "--tokenizer", tokenizer, "--out_dir", out_dir])
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"code": code, "seconds": seconds, "peak_kib": peak, "start_kib": before,
                      "summary": output.getvalue().strip()}))


def make_input(source, size_mb, path):
    text = Path(source).read_bytes()
    copies = -(-size_mb * 10**6 // len(text))
    with open(path, "wb") as f:
        for _ in range(copies):
            f.write(text)
    return copies * len(text)


@system.cli
def main(argv):
    if argv[:1] == ["--child"]:
        return child(*argv[1:])
    cfg = load_config(BenchConfig, argv, "bench/prepare_speed.py", __doc__)
    if not Path(cfg.source).is_file():
        raise UserError(f"source text {cfg.source} not found; pass --source=FILE")
    with tempfile.TemporaryDirectory() as tmp:
        size = make_input(cfg.source, cfg.size_mb, f"{tmp}/input.txt")
        print(f"input: {size / 1e6:.1f} MB, {Path(cfg.source).name} repeated; {cpu_count()} cores "
              f"(timings are noisy when other work shares them)")
        for name in cfg.tokenizers:
            args = [sys.executable, __file__, "--child", name, cfg.source, str(cfg.words), f"{tmp}/input.txt",
                    f"{tmp}/{name}"]
            run = subprocess.run(args, capture_output=True, text=True)
            r = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else {"code": run.returncode}
            if r["code"] != 0:
                raise UserError(f"preparing with {name} failed: {' '.join(run.stderr.strip().splitlines()[-1:])}")
            note = " (local encoding built here, not a named one)" if name == LOCAL else ""
            print(f"{name}{note}: {size / 1e6 / r['seconds']:.1f} MB/s ({r['seconds']:.1f} s), "
                  f"peak RSS {r['peak_kib'] / 1024:.0f} MiB (after imports {r['start_kib'] / 1024:.0f} MiB)")
            print(f"    {r['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
