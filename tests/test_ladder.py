"""config/ladder/: one preset per rung, each adding one idea on the same budget,
and each one trains."""

import dataclasses
from pathlib import Path

import pytest

import train
from config import load_config
from tinygpt.files import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "config" / "ladder").glob("*.toml"))
SWITCHES = ("n_layer", "mixer", "feedforward", "residual", "layernorm", "pos", "tie_weights", "dropout", "score",
            "window")
RECIPE = ("optimizer", "learning_rate", "muon_lr", "muon_momentum", "muon_weight_decay")  # the modern GPT's own
CLASSIC = ("adamw", 1e-3, 0.015, 0.9, "auto")  # AdamW at nanoGPT's rate (the Muon settings are the unused defaults)
FAST = ("muon", 1.5e-3, 0.015, 0.9, 0.0)  # config/shakespeare_char_cpu_fast.toml's

# What each rung switches on, in the order of model.py and the README; the b and c rows beside a rung
# change one thing in it.
LADDER = {
    "01_bigram": ((0, "none", False, False, False, "none", False, 0.0, "dot", 0), CLASSIC),
    "02_average": ((1, "average", False, False, False, "learned", False, 0.0, "dot", 0), CLASSIC),
    "03_head": ((1, "head", False, False, False, "learned", False, 0.0, "dot", 0), CLASSIC),
    "03b_head_additive": ((1, "head", False, False, False, "learned", False, 0.0, "additive", 0), CLASSIC),
    "04_multihead": ((1, "multihead", False, False, False, "learned", False, 0.0, "dot", 0), CLASSIC),
    "04b_multihead_additive": ((1, "multihead", False, False, False, "learned", False, 0.0, "additive", 0), CLASSIC),
    "05_feedforward": ((1, "multihead", True, False, False, "learned", False, 0.0, "dot", 0), CLASSIC),
    "06_residual": ((4, "multihead", True, True, False, "learned", False, 0.0, "dot", 0), CLASSIC),
    "07_layernorm": ((4, "multihead", True, True, True, "learned", False, 0.0, "dot", 0), CLASSIC),
    "08_full": ((4, "multihead", True, True, True, "learned", True, 0.0, "dot", 0), CLASSIC),
    "09_modern": ((4, "multihead", True, True, True, "rope", True, 0.0, "dot", 0), FAST),
    "09b_modern_window32": ((4, "multihead", True, True, True, "rope", True, 0.0, "dot", 32), FAST),
    "09c_modern_window16": ((4, "multihead", True, True, True, "rope", True, 0.0, "dot", 16), FAST),
}



def test_there_is_one_preset_per_rung_and_they_sort_in_lesson_order():
    assert [p.stem for p in PRESETS] == list(LADDER)


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_sets_its_rungs_switches(preset):
    cfg = load_config(train.TrainConfig, [str(preset)])
    assert tuple(getattr(cfg, name) for name in SWITCHES) == LADDER[preset.stem][0]
    assert tuple(getattr(cfg, name) for name in RECIPE) == LADDER[preset.stem][1]
    assert cfg.out_dir == f"out/ladder/{preset.stem}"


def test_every_rung_has_the_same_budget():
    def budget(preset):
        cfg = dataclasses.asdict(load_config(train.TrainConfig, [str(preset)]))
        return {k: v for k, v in cfg.items() if k not in SWITCHES + RECIPE + ("out_dir",)}

    first = budget(PRESETS[0])
    assert all(budget(p) == first for p in PRESETS[1:])
    assert (first["n_embd"], first["n_head"], first["block_size"], first["batch_size"]) == (128, 4, 64, 12)



@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_trains_a_few_steps(preset, data_dir, tmp_path):
    out = tmp_path / "out"
    tiny = ["--max_iters=3", "--n_embd=16", "--block_size=32", "--batch_size=2", "--eval_interval=3",
            "--eval_iters=2", "--log_interval=1", "--warmup=0.3"]  # block 32: the windows of 16 and 32 fit
    assert train.main([str(preset), f"--data_dir={data_dir}", f"--out_dir={out}", *tiny]) == 0
    ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["iter"] == 3
    model_config = ckpt["model_config"]
    assert tuple(model_config[name] for name in SWITCHES) == LADDER[preset.stem][0]


def test_the_docs_point_at_every_rung_and_the_readme_at_every_class():
    ladder = (ROOT / "docs" / "ladder.md").read_text(encoding="utf-8")
    for preset in PRESETS:
        assert f"config/ladder/{preset.name}" in ladder
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in ("CausalAverage", "Head", "MultiHeadAttention", "FeedForward", "Block", "GPT"):
        assert f"`{name}`" in readme
