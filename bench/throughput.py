"""Training throughput of a preset: ms/iter, tokens/s and MFU.

    python bench/throughput.py config/shakespeare_char_cpu.toml [--iters=100] [--key=value ...]

Runs train.py's own loop for a few iterations (into a temporary out_dir) and
reads its log, so the number is the loop users run, not a copy of it. On CPU the
MFU is against an fp32 matmul peak measured in the same run.
"""

import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's modules

import train
from config import UserError
from model import GPT
from tinygpt import system  # noqa: E402
from tinygpt.files import load_data


def matmul_peak_flops(n=1024, repeats=20):
    """Best fp32 matmul rate this process reaches, FLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def synthetic_data(directory, vocab_size=65, n_tokens=200_000):
    """A data dir of random tokens, for benchmarking without prepared data."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_tokens), ("val", n_tokens // 10)):
        rng.integers(0, vocab_size, n, dtype=np.uint16).tofile(Path(directory) / f"{split}.bin")
    meta = {"format": 1, "tokenizer": "char", "vocab": [chr(32 + i) for i in range(vocab_size)],
            "vocab_size": vocab_size, "dtype": "uint16", "train_tokens": n_tokens, "val_tokens": n_tokens // 10}
    (Path(directory) / "meta.json").write_text(json.dumps(meta), encoding="utf-8")


@system.cli
def main(argv):
    iters = 100
    rest = []
    for arg in argv:
        if arg.startswith("--iters="):
            iters = int(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    cfg = train.load_config(train.TrainConfig, rest, "bench/throughput.py", __doc__.strip().splitlines()[0])
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = cfg.data_dir
        try:
            vocab_size = load_data(data_dir)[0]["vocab_size"]
        except UserError:
            data_dir, vocab_size = tmp, 65
            synthetic_data(tmp, vocab_size)
            print(f"{cfg.data_dir} not prepared: using random tokens")
        args = rest + [f"--data_dir={data_dir}", f"--out_dir={tmp}/out", f"--max_iters={iters}",
                       f"--eval_interval={iters}", "--eval_iters=1", "--log_interval=1", "--init_from=scratch"]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = train.main(args)
        if code != 0:
            raise UserError(f"the training run failed (exit {code}); run train.py with the same arguments to see why")
        records = [json.loads(line) for line in open(f"{tmp}/out/log.jsonl", encoding="utf-8")]
    steps = [r for r in records if "ms_per_iter" in r][iters // 10 :]  # the first steps warm up caches
    ms = sorted(r["ms_per_iter"] for r in steps)[len(steps) // 2]
    tokens_per_iter = cfg.batch_size * cfg.block_size * cfg.grad_accum
    tok_s = tokens_per_iter / (ms / 1000)
    device_name = system.choose_device(cfg.device)
    print(f"preset: {' '.join(rest) or '(defaults)'}")
    print(f"device: {device_name}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"median {ms:.1f} ms/iter over {len(steps)} iterations, {tok_s:,.0f} tokens/s")
    if "mfu" in steps[-1]:
        print(f"MFU {np.median([r['mfu'] for r in steps]):.1%} of the device's bf16 peak")
    elif device_name == "cpu":
        params = GPT(train.model_config(cfg, vocab_size)).num_params()
        flops = system.train_flops_per_token(params, cfg.n_layer, cfg.n_embd, cfg.block_size) * tok_s
        peak = matmul_peak_flops()
        print(f"model FLOP/s {flops / 1e9:.1f} G, fp32 matmul peak here {peak / 1e9:.1f} G: MFU {flops / peak:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
