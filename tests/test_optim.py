"""optim.py and --optimizer=muon: who gets Muon, what its update is, and resuming."""

import json
import signal
from pathlib import Path

import pytest
import torch

import train
from tinygpt import files
from tinygpt.optim import Muon, Optimizers, orthogonalize

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")



def run_train(data_dir, out_dir, *overrides):
    return train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--optimizer=muon", *overrides])


def read_log(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]


def test_muon_gets_the_block_matrices_and_adamw_everything_else():
    cfg = train.TrainConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, bias=True, dropout=0.0, pos="learned",
                            optimizer="muon", muon_weight_decay=0.0)
    model = train.GPT(train.model_config(cfg, 11))
    optimizer = train.make_optimizer(model, cfg, "cpu")
    adamw, muon = optimizer.optimizers
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = sorted(names[id(p)] for g in muon.param_groups for p in g["params"])
    assert muon_names == sorted(f"blocks.{i}.{m}.weight" for i in range(2)
                                for m in ("mixer.c_attn", "mixer.c_proj", "ffwd.c_fc", "ffwd.c_proj"))
    adamw_names = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "blocks.0.mixer.c_attn.bias"} <= adamw_names
    assert len(muon_names) + len(adamw_names) == len(list(model.parameters()))


def make_params(seed):
    torch.manual_seed(seed)
    shapes = [(48, 16), (16, 16), (64, 16), (16, 64)]  # the blocks' four shapes, two of each
    return [torch.nn.Parameter(0.02 * torch.randn(s)) for s in shapes for _ in range(2)]


def test_float32_muon_makes_torchs_bf16_update_to_within_bf16_precision():
    ours, theirs = make_params(0), make_params(0)
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    opt_ours, opt_theirs = Muon(ours, **settings), torch.optim.Muon(theirs, **settings)
    for _ in range(3):  # several steps, so the momentum buffers matter too
        before = [p.detach().clone() for p in ours]
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
        for a, b, p0 in zip(ours, theirs, before):
            ours_step, theirs_step = a.detach() - p0, b.detach() - p0
            # bf16 keeps 8 bits of mantissa (0.4%); five iterations compound it to about 2%.
            assert (ours_step - theirs_step).norm() < 0.05 * ours_step.norm()
            b.data.copy_(a.data)  # go on from the same point


def test_batched_orthogonalization_equals_one_matrix_at_a_time():
    torch.manual_seed(0)
    stacks = [torch.randn(3, 64, 16), torch.randn(2, 16, 16), torch.randn(2, 16, 48), torch.randn(2, 8, 24)]
    together = orthogonalize(stacks)  # the first three share one batch: their short side is 16
    for G, O in zip(stacks, together, strict=True):
        assert O.shape == G.shape
        torch.testing.assert_close(O, torch.stack([orthogonalize([g[None]])[0][0] for g in G]))


@pytest.mark.parametrize("shape", [(64, 16), (16, 64)])
def test_orthogonalization_brings_every_singular_value_near_one(shape):
    torch.manual_seed(0)
    k = min(shape)
    U, V = torch.linalg.qr(torch.randn(shape[0], k))[0], torch.linalg.qr(torch.randn(shape[1], k))[0]
    G = U @ torch.diag(torch.logspace(-2, 0, k)) @ V.T  # singular values from 0.01 to 1
    s = torch.linalg.svdvals(orthogonalize([G[None]])[0][0])
    assert s.min() > 0.5 and s.max() < 1.5  # the quintic's target band, not exactly 1


def test_each_optimizer_follows_the_schedule_from_its_own_peak(data_dir, tmp_path, stop_at):
    schedule = ["--max_iters=20", "--learning_rate=2e-3", "--muon_lr=0.03"]
    stop_at(7)  # stopped part way, where the rates are neither the peak nor the end's
    assert run_train(data_dir, tmp_path, *schedule) == 128 + signal.SIGTERM
    saved = files.load_checkpoint(tmp_path / "ckpt.pt")["optimizer"]["optimizers"]
    lr = train.get_lr(7 / 20, train.TrainConfig(warmup=0.25, learning_rate=2e-3, min_lr=1e-4))  # set, then saved
    assert [g["lr"] for g in saved[0]["param_groups"]] == pytest.approx([lr, lr])
    assert saved[1]["param_groups"][0]["lr"] == pytest.approx(lr * 0.03 / 2e-3)


def test_resume_with_muon_and_rope_matches_uninterrupted_run(data_dir, tmp_path, stop_at):
    common = ["--max_iters=16", "--log_interval=1", "--pos=rope", "--dropout=0.1"]
    assert run_train(data_dir, tmp_path / "whole", *common) == 0
    stop_at(8)
    assert run_train(data_dir, tmp_path / "split", *common) == 128 + signal.SIGTERM
    assert run_train(data_dir, tmp_path / "split", *common, "--init_from=resume") == 0
    whole = [(r["iter"], r["loss"]) for r in read_log(tmp_path / "whole") if "loss" in r]
    split = [(r["iter"], r["loss"]) for r in read_log(tmp_path / "split") if "loss" in r]
    assert len(whole) == 16 and split == whole  # bit-identical, momentum buffers included
    a, b = (files.load_checkpoint(tmp_path / d / "ckpt.pt") for d in ("whole", "split"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_combined_optimizer_refuses_another_optimizers_state():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    both = Optimizers(torch.optim.AdamW([p]), Muon([p]))
    with pytest.raises(ValueError, match="different optimizer"):
        both.load_state_dict(torch.optim.AdamW([p]).state_dict())


def test_unknown_optimizer_is_one_error_line(data_dir, tmp_path, capsys):
    assert run_train(data_dir, tmp_path, "--optimizer=sgd") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "adamw or muon" in err[0]


@pytest.mark.parametrize("classic,fast,same_model", [("shakespeare_char_cpu", "shakespeare_char_cpu_fast", False),
                                                     ("shakespeare_char", "shakespeare_char_fast", True)])
def test_fast_presets_train_the_classic_data_with_muon_and_rope(classic, fast, same_model):
    """The GPU's fast preset trains the classic's model; the CPU's a smaller one (3 x 96, not 4 x 128), as it
    reaches the classic's final loss sooner in fp32 and bf16 (docs/fast_recipe.md). Both: the same tokens."""
    load = lambda name: train.load_config(train.TrainConfig, [str(ROOT / "config" / f"{name}.toml")])  # noqa: E731
    a, b = load(classic), load(fast)
    shape = ("n_layer", "n_embd") if same_model else ()
    same = (*shape, "n_head", "block_size", "dropout", "data_dir", "device")
    assert [getattr(a, k) for k in same] == [getattr(b, k) for k in same]
    assert same_model or (b.n_layer, b.n_embd) < (a.n_layer, a.n_embd)
    assert (a.optimizer, a.pos, b.optimizer, b.pos) == ("adamw", "learned", "muon", "rope")
    assert a.batch_size * a.max_iters == b.batch_size * b.max_iters  # the same tokens
