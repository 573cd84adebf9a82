"""The CUDA and multi-process decisions that can be checked without a GPU: the peak each GPU's MFU is
measured against, MFU over many processes, TF32 and the GPU a lone process trains on, a dtype picked
again (and compiling off) when a run moves to another kind of device, fp16's scaler on a resume, and
sizing for several processes. What only a GPU can show is listed in docs/results.md."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import train
from tinygpt import budget, device, files, weights

TINY = "config/tiny.toml"


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A10", 125e12), ("NVIDIA A10G", None), ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA GeForce RTX 4090", 165e12), ("NVIDIA GeForce RTX 3060", None)])
def test_each_gpu_is_measured_against_its_own_peak(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: name)
    assert device.peak_flops("cuda") == peak


def test_the_log_gives_mfu_against_the_peak_of_a_gpu_it_knows(monkeypatch, data_dir, tmp_path):
    monkeypatch.setattr(device, "peak_flops", lambda device_type: 1e9)  # as if this CPU were a GPU of 1 GFLOP/s
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=5", "--log_interval=5"]
    assert train.main(args) == 0
    record = next(json.loads(line) for line in Path(tmp_path / "log.jsonl").read_text().splitlines() if "mfu" in line)
    config = files.load_checkpoint(tmp_path / "ckpt.pt")["model_config"]
    params = train.GPT(train.GPTConfig(**config)).num_params()
    flops = device.train_flops_per_token(params, config["n_layer"], config["n_embd"], config["block_size"])
    assert record["mfu"] == pytest.approx(flops * record["tokens_per_s"] / 1e9)


@pytest.mark.parametrize("name, expected", [("cuda:1", "cuda:1"), ("cuda", "cuda:0")])
def test_a_lone_process_trains_on_the_gpu_it_names_with_tf32(monkeypatch, name, expected):
    chosen = []

    def set_device(device):  # as torch's: a GPU without its number is refused (seen on an H200)
        if torch.device(device).index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        chosen.append(device)

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(device, "choose_device", lambda name: name)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        procs = device.start_processes(name)
        assert (procs.device, chosen, torch.backends.cuda.matmul.fp32_precision) == (expected, [expected], "tf32")
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


@pytest.mark.parametrize("then, now, given, expected", [
    ("cpu", "cuda", {}, "auto"),  # begun on a CPU in fp32, resumed on a GPU: picked again there
    ("cpu", "cpu", {}, "float32"),  # the same kind of device: kept
    ("cpu", "cuda", {"dtype": "command line"}, "bfloat16"),  # what the command line says, always
])
def test_a_resumed_run_picks_its_dtype_again_only_on_another_kind_of_device(then, now, given, expected):
    ckpt = {"train_config": {"dtype": "float32"}, "device_type": then}
    cfg = train.TrainConfig(dtype="bfloat16" if given else "auto")
    assert weights.resumed_config(ckpt, cfg, given, now).dtype == expected


def test_a_run_compiled_on_a_gpu_and_resumed_on_a_cpu_runs_uncompiled_there():
    ckpt = {"train_config": {"compile": True}, "device_type": "cuda"}
    assert not weights.resumed_config(ckpt, train.TrainConfig(), {}, "cpu").compile
    assert weights.resumed_config(ckpt, train.TrainConfig(), {}, "cuda").compile  # the same kind of device: kept
    given = weights.resumed_config(ckpt, train.TrainConfig(compile=True), {"compile": "command line"}, "cpu")
    assert given.compile  # what the command line says, always


def test_a_run_resumed_in_float16_starts_its_loss_scaling_afresh(data_dir, tmp_path):
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}"]
    assert train.main([*args, "--max_iters=2", "--dtype=bfloat16"]) == 0
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["scaler"] == {}  # bf16 scales nothing
    assert train.main([*args, "--init_from=resume", "--max_iters=4", "--dtype=float16"]) == 0
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["scaler"]["scale"] > 0


def test_sizing_for_two_processes_counts_both(monkeypatch):
    cfg = train.TrainConfig()

    def sized(world):
        chosen = budget.size_run(cfg, {}, (100_000, 10_000, 65), 60.0, world, lambda c: (0.05, 0.5))[0]
        return chosen, budget.most_steps(100_000, world * chosen.batch_size * chosen.block_size)

    (one, one_steps), (two, two_steps) = sized(1), sized(2)
    assert budget.block_params(two.n_layer, two.n_embd) >= budget.block_params(one.n_layer, one.n_embd)
    tokens = [c.batch_size * c.block_size * w * steps for c, w, steps in ((one, 1, one_steps), (two, 2, two_steps))]
    assert tokens[1] == pytest.approx(tokens[0], rel=0.05)  # the passes cap counts every process's batches


def sized_on(device_name, max_time="5m", **given):
    """The settings size_for_data picks for a text of 1M tokens on device_name, its steps timed at 50 ms
    (eager), at the start of the budget's clock."""
    cfg = dataclasses.replace(train.TrainConfig(max_time=max_time), **given)
    sources = {"max_time": "command line", **dict.fromkeys(given, "command line")}
    data = ({"vocab_size": 65}, {"train": range(1_000_000), "val": range(100_000)})
    procs, time_budget = device.Processes(0, 1, device_name), budget.Budget(cfg, sources)
    return budget.size_for_data(cfg, sources, data, procs, time_budget, lambda c: (0.05, 0.5))


def shape(cfg):
    return cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.batch_size


def eager_choice(seconds):
    return budget.size_run(train.TrainConfig(), {}, (1_000_000, 100_000, 65), seconds, 1, lambda c: (0.05, 0.5))[0]


def test_a_timed_run_with_no_preset_compiles_on_a_gpu_where_the_time_repays_it(monkeypatch):
    monkeypatch.setattr(budget, "process_age", lambda: 0.0)
    monkeypatch.setattr(budget, "compiler_missing", lambda device_type: None)  # as if triton were installed
    speedup, compiling = budget.COMPILING["cuda"]
    gpu = sized_on("cuda:0", "200s")
    assert gpu.compile and sized_on("cuda:0").compile
    # its sizing counts the seconds compiling takes and the faster steps they buy
    assert shape(gpu) == shape(eager_choice((200 - compiling) * speedup)) != shape(eager_choice(200))
    too_short = f"{compiling * speedup / (speedup - 1) - 1:.0f}s"  # where (left - compiling) * speedup < left
    for eager in (sized_on("cuda:0", too_short), sized_on("cuda:0", compile=False), sized_on("cuda:0", max_iters=50),
                  sized_on("cpu"), sized_on("mps")):
        assert not eager.compile
    assert shape(sized_on("cpu")) == shape(eager_choice(300))


def test_a_gpu_without_triton_is_not_chosen_to_compile(monkeypatch):
    monkeypatch.setattr(budget, "process_age", lambda: 0.0)
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: None)
    assert "triton" in device.compiler_missing("cuda")
    assert not sized_on("cuda:0").compile
