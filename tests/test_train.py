"""train.py: the loop, its checkpoints, resuming, and many processes."""

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from tinygpt import files, system

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")


def run_train(data_dir, out_dir, *overrides):
    return train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *overrides])


def read_log(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]


def test_tiny_run_lowers_the_loss_and_writes_checkpoints(data_dir, tmp_path):
    assert run_train(data_dir, tmp_path, "--max_iters=60", "--eval_interval=30", "--learning_rate=3e-3") == 0
    evals = [r for r in read_log(tmp_path) if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 30, 60]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0
    assert evals[-1]["val_bpc"] == pytest.approx(evals[-1]["val_loss"] / math.log(2))
    steps = [r for r in read_log(tmp_path) if "ms_per_iter" in r]
    assert steps and all(r["tokens_per_s"] > 0 for r in steps)
    ckpt = files.load_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["iter"] == 60
    assert ckpt["meta"]["tokenizer"] == "char"  # sample.py needs nothing but the checkpoint
    assert ckpt["best_val_loss"] == pytest.approx(min(r["val_loss"] for r in evals))
    best = files.load_checkpoint(tmp_path / "best.pt")
    assert best["val_loss"] == ckpt["best_val_loss"]


def test_max_iters_0_evaluates_the_model_as_it_starts_and_trains_nothing(data_dir, tmp_path):
    assert run_train(data_dir, tmp_path, "--max_iters=0", "--learning_rate=0.1") == 0
    assert [r["iter"] for r in read_log(tmp_path)] == [0]  # one evaluation, no step logged
    ckpt = files.load_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["iter"] == 0 and ckpt["optimizer"]["state"] == {}  # the optimizer never stepped
    torch.manual_seed(ckpt["train_config"]["seed"])
    fresh = train.GPT(train.GPTConfig(**ckpt["model_config"]))
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in fresh.state_dict().items())  # the weights as built


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_resume_matches_uninterrupted_run(data_dir, tmp_path, stop_at, dropout):
    common = ["--max_iters=20", "--log_interval=1", f"--dropout={dropout}"]
    assert run_train(data_dir, tmp_path / "whole", *common) == 0
    stop_at(10)
    assert run_train(data_dir, tmp_path / "split", *common) == 128 + signal.SIGTERM
    assert files.load_checkpoint(tmp_path / "split" / "ckpt.pt")["iter"] == 10
    assert run_train(data_dir, tmp_path / "split", "--init_from=resume", *common) == 0
    whole = [(r["iter"], r["loss"]) for r in read_log(tmp_path / "whole") if "loss" in r]
    split = [(r["iter"], r["loss"]) for r in read_log(tmp_path / "split") if "loss" in r]
    assert len(whole) == 20
    assert split == whole  # bit-identical: same batches, same dropout masks, same optimizer state
    a = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_full_val_evaluation_is_deterministic(data_dir, tmp_path):
    for name in ("a", "b"):
        assert run_train(data_dir, tmp_path / name, "--max_iters=5", "--eval_iters=0", "--eval_interval=5") == 0
    a, b = ([r["val_loss"] for r in read_log(tmp_path / n) if "val_loss" in r] for n in ("a", "b"))
    assert a == b


def test_learning_rate_warms_up_then_decays_to_min_lr_as_the_run_progresses():
    cfg = train.TrainConfig(learning_rate=1e-3, min_lr=1e-4, warmup=0.1, max_iters=100)
    lrs = [train.get_lr(p / 100, cfg) for p in range(101)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))  # warmup rises
    # nanoGPT's warmup, (it + 1) / (warmup_iters + 1): the first step learns too, at a step's share of the peak
    assert lrs[:10] == pytest.approx([1e-3 * (it + 1) / 11 for it in range(10)], rel=1e-12)
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a > b for a, b in zip(lrs[10:100], lrs[11:101]))  # cosine falls
    assert lrs[100] == pytest.approx(1e-4)
    assert train.get_lr(0.55, cfg) == pytest.approx(5.5e-4)  # halfway through the decay: the midpoint


def sgd_step(cfg, batches):
    """How far one train.train_step moves each weight of a small fp32 model under plain SGD at lr 1:
    the gradient it stepped on, as a flat vector (after any clipping)."""
    torch.manual_seed(0)
    model = train.GPT(train.model_config(cfg, 11))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x, y = batches[0]
    train.train_step(model, optimizer, scaler, contextlib.nullcontext(), cfg, x, y, iter(batches[1:] + [(x, y)]))
    return before - torch.cat([p.detach().flatten() for p in model.parameters()])


def micro_batches(n, batch_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (batch_size, 8), generator=g), torch.randint(0, 11, (batch_size, 8), generator=g))
            for _ in range(n)]


def test_a_step_clips_the_gradient_norm_to_grad_clip():
    cfg = train.TrainConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=4, dropout=0.0, pos="learned")
    batches = micro_batches(1, 4)
    unclipped = sgd_step(dataclasses.replace(cfg, grad_clip=0.0), batches).norm()
    assert unclipped > 0.2  # so that a clip at 0.1 has something to cut
    clipped = sgd_step(dataclasses.replace(cfg, grad_clip=0.1), batches)
    assert clipped.norm() == pytest.approx(0.1, rel=1e-4)


def test_accumulated_micro_batches_step_on_the_mean_gradient_of_the_whole_batch():
    cfg = train.TrainConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, dropout=0.0, grad_clip=0.0, pos="learned")
    halves = micro_batches(2, 3)
    whole = [(torch.cat([halves[0][0], halves[1][0]]), torch.cat([halves[0][1], halves[1][1]]))]
    accumulated = sgd_step(dataclasses.replace(cfg, batch_size=3, grad_accum=2), halves)
    at_once = sgd_step(dataclasses.replace(cfg, batch_size=6, grad_accum=1), whole)
    torch.testing.assert_close(accumulated, at_once, rtol=1e-4, atol=1e-6)


def test_weight_decay_applies_to_matrices_only():
    cfg = train.TrainConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, bias=True, dropout=0.0, pos="learned",
                            optimizer="adamw")
    model = train.GPT(train.model_config(cfg, 11))
    decayed, plain = train.make_optimizer(model, cfg, "cpu").param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_compile_without_a_compiler_warns_and_runs_uncompiled(monkeypatch, capsys):
    monkeypatch.setattr(system.shutil, "which", lambda name: None)
    model = torch.nn.Linear(2, 2)
    assert system.maybe_compile(model, "cpu") is model
    assert "running uncompiled" in capsys.readouterr().out


@pytest.mark.parametrize("processes", [1, 2])
def test_torchrun_trains_with_ddp_on_cpu(data_dir, tmp_path, processes):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tracked = importlib.util.find_spec("tensorboard") is not None  # requirements-dev.txt's: --log_to, on rank 0 alone
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
           str(ROOT / "train.py"), TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=6",
           "--eval_interval=3", "--log_interval=1", *(["--log_to=tensorboard"] if tracked else [])]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    # batch_size and grad_accum are per process: the preset's batch of 8 runs in each process;
    # under torchrun the process group is made even for one process (NCCL's path on a GPU)
    sequences = f"{128 * processes} tokens/step (8 x 16 a micro-batch); cpu"
    assert sequences in result.stdout
    assert "DDP over gloo" in result.stdout
    log = read_log(tmp_path)
    assert [r["iter"] for r in log if "val_loss" in r] == [0, 3, 6]  # only rank 0 writes
    assert len([r for r in log if "loss" in r]) == 6
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["iter"] == 6
    assert len(list(tmp_path.glob("tensorboard/events.out.tfevents.*"))) == tracked  # one writer, rank 0's


def error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_missing_data_is_one_error_line(tmp_path, capsys):
    assert run_train(tmp_path / "nowhere", tmp_path / "out") == 2
    assert "meta.json not found" in error_line(capsys)


def test_block_size_larger_than_val_split_is_an_error(data_dir, tmp_path, capsys):
    assert run_train(data_dir, tmp_path, "--block_size=100000") == 2
    assert "block_size" in error_line(capsys)


def test_unwritable_out_dir_is_an_error(data_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    assert run_train(data_dir, tmp_path / "file" / "out") == 2
    line = error_line(capsys)  # "cannot write to out_dir ..." or, once train.py checks it first, "... which is a file"
    assert str(tmp_path / "file") in line and line.endswith("; pick another --out_dir")


def test_unknown_key_suggests_the_closest(data_dir, tmp_path, capsys):
    assert run_train(data_dir, tmp_path, "--learning_rat=1e-3") == 2
    assert "did you mean learning_rate" in error_line(capsys)


def test_resume_with_another_model_shape_says_what_differs(data_dir, tmp_path, capsys):
    assert run_train(data_dir, tmp_path, "--max_iters=2") == 0
    capsys.readouterr()
    assert run_train(data_dir, tmp_path, "--max_iters=4", "--init_from=resume", "--n_embd=48", "--n_layer=3") == 2
    line = error_line(capsys)
    assert "as --n_layer=3 (it has 2), --n_embd=48 (it has 32): a resumed run keeps its model and optimizer" in line
    assert "{" not in line


def test_resume_with_another_optimizer_says_so_and_changes_nothing(data_dir, tmp_path, capsys):
    assert run_train(data_dir, tmp_path, "--max_iters=2") == 0
    before = (tmp_path / "ckpt.pt").read_bytes(), (tmp_path / "log.jsonl").read_bytes()
    capsys.readouterr()
    assert run_train(data_dir, tmp_path, "--max_iters=4", "--init_from=resume", "--optimizer=muon") == 2
    assert "as --optimizer=muon (it has adamw): a resumed run keeps its model and optimizer" in error_line(capsys)
    assert ((tmp_path / "ckpt.pt").read_bytes(), (tmp_path / "log.jsonl").read_bytes()) == before


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_resumed_run_trains_with_the_optimizer_settings_its_command_line_gives(data_dir, tmp_path, optimizer):
    assert run_train(data_dir, tmp_path, "--max_iters=2", f"--optimizer={optimizer}") == 0
    given = ["--weight_decay=0.3", "--beta1=0.8", "--beta2=0.95", "--muon_lr=0.02", "--muon_momentum=0.8"]
    assert run_train(data_dir, tmp_path, "--max_iters=4", "--init_from=resume", *given) == 0
    state = files.load_checkpoint(tmp_path / "ckpt.pt")["optimizer"]
    adamw, *muon = state["optimizers"] if optimizer == "muon" else [state]
    assert [(g["weight_decay"], g["betas"]) for g in adamw["param_groups"]] == [(0.3, (0.8, 0.95)), (0.0, (0.8, 0.95))]
    assert len(adamw["state"]) == len(adamw["param_groups"][0]["params"] + adamw["param_groups"][1]["params"])
    for group in (g for m in muon for g in m["param_groups"]):  # Muon's peak: muon_lr, whatever learning_rate says
        assert (group["lr_scale"], group["momentum"]) == (pytest.approx(0.02 / 1e-3), 0.8)


def test_a_compiled_run_trains_as_an_eager_one(data_dir, tmp_path, monkeypatch):
    compiled, real = [], torch.compile
    eager_backend = lambda model: compiled.append(model) or real(model, backend="eager")  # noqa: E731
    monkeypatch.setattr(system, "compiler_missing", lambda device_type: None)  # no C compiler needed
    monkeypatch.setattr(system.torch, "compile", eager_backend)
    assert run_train(data_dir, tmp_path / "compiled", "--max_iters=4", "--eval_interval=2", "--compile=true") == 0
    monkeypatch.undo()
    assert run_train(data_dir, tmp_path / "eager", "--max_iters=4", "--eval_interval=2") == 0
    assert len(compiled) == 1
    losses = [[r["val_loss"] for r in read_log(tmp_path / d) if "val_loss" in r] for d in ("compiled", "eager")]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_resuming_a_run_that_has_taken_all_its_steps_says_how_to_go_on(data_dir, tmp_path, capsys):
    assert run_train(data_dir, tmp_path, "--max_iters=4", "--eval_interval=2") == 0
    before = (tmp_path / "ckpt.pt").read_bytes(), (tmp_path / "log.jsonl").read_bytes()
    capsys.readouterr()
    for max_iters in ("4", "3"):
        assert run_train(data_dir, tmp_path, f"--max_iters={max_iters}", "--init_from=resume") == 2
        assert error_line(capsys) == (f"error: {tmp_path / 'ckpt.pt'} is at iteration 4 and --max_iters is "
                                      f"{max_iters}: nothing is left to train; to go on, give more, e.g. "
                                      "--max_iters=100")
    assert ((tmp_path / "ckpt.pt").read_bytes(), (tmp_path / "log.jsonl").read_bytes()) == before


def test_auto_dtype_on_a_cpu_is_the_same_idle_or_busy(monkeypatch):
    """What the CPU can do decides, not a timing: a clock that makes every matmul look slow or fast changes nothing."""
    import time

    chosen = set()
    for tick in (1e-9, 10.0):  # seconds each look at the clock adds: an idle machine, a very busy one
        clock = iter(range(10**6))
        monkeypatch.setattr(time, "perf_counter", lambda tick=tick, clock=clock: next(clock) * tick)
        monkeypatch.setattr(time, "time", lambda tick=tick, clock=clock: next(clock) * tick)
        chosen.add(system.pick_dtype("auto", "cpu", training=True))
    assert chosen == {torch.bfloat16 if system.cpu_has_bf16() else torch.float32}


def test_resume_without_a_checkpoint_is_an_error(data_dir, tmp_path, capsys):
    assert run_train(data_dir, tmp_path, "--init_from=resume") == 2
    assert "ckpt.pt not found" in error_line(capsys)


def test_head_count_that_does_not_divide_the_width_is_an_error(data_dir, tmp_path, capsys):
    assert run_train(data_dir, tmp_path, "--n_head=3") == 2
    assert "divisible" in error_line(capsys)


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_trains_in_bf16_only_on_a_cpu_with_native_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(system, "cpu_has_bf16", lambda: native)
    assert system.pick_dtype("auto", "cpu", training=True) == expected
    assert system.pick_dtype("auto", "cpu") == torch.float32  # sampling one token at a time: fp32
    assert system.pick_dtype("float32", "cpu", training=True) == torch.float32


def test_the_dtype_auto_chose_is_kept_with_the_run_and_resumed(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(system, "cpu_has_bf16", lambda: True)
    assert run_train(data_dir, tmp_path, "--max_iters=4", "--eval_interval=2", "--dtype=auto") == 0
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["train_config"]["dtype"] == "bfloat16"
    monkeypatch.setattr(system, "cpu_has_bf16", lambda: False)  # another machine
    assert run_train(data_dir, tmp_path, "--max_iters=6", "--init_from=resume") == 0
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["train_config"]["dtype"] == "bfloat16"


def test_bf16_training_on_a_cpu_evaluates_in_fp32(data_dir, tmp_path, monkeypatch):
    seen = []
    real = train.estimate_loss

    def spy(model, splits, cfg, device_name, autocast):
        seen.append(torch.get_autocast_dtype("cpu") if isinstance(autocast, torch.autocast) else torch.float32)
        return real(model, splits, cfg, device_name, autocast)

    monkeypatch.setattr(train, "estimate_loss", spy)
    assert run_train(data_dir, tmp_path, "--max_iters=4", "--eval_interval=2", "--dtype=bfloat16") == 0
    assert seen == [torch.float32] * 3
