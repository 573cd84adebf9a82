"""The CUDA and multi-process decisions that can be checked without a GPU: the peak each GPU's MFU is
measured against, MFU over many processes, TF32 and the GPU a lone process trains on, a resumed run's
dtype and compiling, fp16's scaler on a resume, and sizing for several processes. What only a GPU can show is listed in
docs/results.md."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import train
from tinygpt import budget, files, system

TINY = "config/tiny.toml"


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A10", 125e12), ("NVIDIA A10G", None), ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA GeForce RTX 4090", 165e12), ("NVIDIA GeForce RTX 3060", None)])
def test_each_gpu_is_measured_against_its_own_peak(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: name)
    assert system.peak_flops("cuda") == peak


def test_the_log_gives_mfu_against_the_peak_of_a_gpu_it_knows(monkeypatch, data_dir, tmp_path):
    monkeypatch.setattr(system, "peak_flops", lambda device_type: 1e9)  # as if this CPU were a GPU of 1 GFLOP/s
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=5", "--log_interval=5"]
    assert train.main(args) == 0
    record = next(json.loads(line) for line in Path(tmp_path / "log.jsonl").read_text().splitlines() if "mfu" in line)
    config = files.load_checkpoint(tmp_path / "ckpt.pt")["model_config"]
    params = train.GPT(train.GPTConfig(**config)).num_params()
    flops = system.train_flops_per_token(params, config["n_layer"], config["n_embd"], config["block_size"])
    assert record["mfu"] == pytest.approx(flops * record["tokens_per_s"] / 1e9)


@pytest.mark.parametrize("name, expected", [("cuda:1", "cuda:1"), ("cuda", "cuda:0")])
def test_a_lone_process_trains_on_the_gpu_it_names_with_tf32(monkeypatch, name, expected):
    chosen = []

    def set_device(device):  # as torch's: a GPU without its number is refused (seen on an H200)
        if torch.device(device).index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        chosen.append(device)

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(system, "choose_device", lambda name: name)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        procs = system.start_processes(name)
        assert (procs.device, chosen, torch.backends.cuda.matmul.fp32_precision) == (expected, [expected], "tf32")
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def test_a_resumed_run_keeps_the_dtype_and_compiling_it_trained_with_unless_the_command_line_says():
    own = {"dtype": "bfloat16", "compile": True}  # a run begun on a GPU
    assert (train.load_config(train.TrainConfig, [], base=own).dtype, train.load_config(
        train.TrainConfig, [], base=own).compile) == ("bfloat16", True)
    moved = train.load_config(train.TrainConfig, ["--dtype=float32", "--compile=false"], base=own)
    assert (moved.dtype, moved.compile) == ("float32", False)  # resumed on a CPU, as asked


def test_a_run_resumed_in_float16_starts_its_loss_scaling_afresh(data_dir, tmp_path):
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}"]
    assert train.main([*args, "--max_iters=2", "--dtype=bfloat16"]) == 0
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["scaler"] == {}  # bf16 scales nothing
    assert train.main([*args, "--init_from=resume", "--max_iters=4", "--dtype=float16"]) == 0
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["scaler"]["scale"] > 0


def test_sizing_for_two_processes_counts_both():
    cfg = train.TrainConfig(max_time="1m")

    def sized(world):
        chosen, _, _ = budget.size_run(cfg, (100_000, 10_000, 65), lambda c: (0.05, 0.02), 60.0, world)
        chosen = dataclasses.replace(cfg, **chosen)
        return chosen, budget.most_steps(100_000, world * chosen.batch_size * chosen.block_size)

    (one, one_steps), (two, two_steps) = sized(1), sized(2)
    assert budget.block_params(two.n_layer, two.n_embd) >= budget.block_params(one.n_layer, one.n_embd)
    tokens = [c.batch_size * c.block_size * w * steps for c, w, steps in ((one, 1, one_steps), (two, 2, two_steps))]
    assert tokens[1] == pytest.approx(tokens[0], rel=0.05)  # the passes cap counts every process's batches
