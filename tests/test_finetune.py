"""Fine-tuning: train.py --init_from=CHECKPOINT starts from its weights on new data,
with a fresh optimizer and schedule, into a new out_dir."""

import json
import signal
from pathlib import Path

import pytest
import torch

import prepare
import train
from tinygpt import files

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")
# Characters the shared data set (conftest.data_dir) lacks: upper case, digits, ';' and ','; and no '!' or '?'.
OTHER_TEXT = "".join(f"The bat {i % 10} sat by the hat; a cat, the dog and THE END.\n" for i in range(300))
# What a fine-tuning run sets without a preset: the model's shape comes from the checkpoint.
RUN = ["--block_size=16", "--batch_size=8", "--eval_iters=0", "--dropout=0", "--device=cpu", "--warmup=0.1"]


def read_log(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]


def val_losses(out_dir):
    return [r["val_loss"] for r in read_log(out_dir) if "val_loss" in r]


def error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def base(data_dir, tmp_path_factory):
    """The checkpoint of config/tiny.toml, trained briefly on the shared character data set."""
    out = tmp_path_factory.mktemp("base")
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=30",
                       "--learning_rate=3e-3"]) == 0
    return out / "ckpt.pt"


@pytest.fixture(scope="module")
def other_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("other")
    (root / "other.txt").write_text(OTHER_TEXT)
    assert prepare.main(["--input", str(root / "other.txt"), "--out_dir", str(root / "chars")]) == 0
    return root / "chars"


def finetune(source, data, out_dir, *extra):
    return train.main([f"--init_from={source}", f"--data_dir={data}", f"--out_dir={out_dir}", *RUN, *extra])


# --- Character vocabularies ------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_known_characters_keep_their_rows_and_new_ones_start_fresh(base, data_dir, other_data, tmp_path, capsys,
                                                                    tied):
    if not tied:  # a model whose output head has rows of its own
        assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'untied'}", "--max_iters=2",
                           "--tie_weights=false"]) == 0
        base = tmp_path / "untied" / "ckpt.pt"
    capsys.readouterr()
    assert finetune(base, other_data, tmp_path / "ft", "--max_iters=0") == 0  # the weights as loaded
    old, new = (files.load_checkpoint(p) for p in (base, tmp_path / "ft" / "ckpt.pt"))
    old_vocab, new_vocab = old["meta"]["vocab"], new["meta"]["vocab"]
    fresh = [ch for ch in new_vocab if ch not in old_vocab]
    assert len(fresh) > 10 and "!" in old_vocab and "!" not in new_vocab  # characters come and go
    assert f"{len(fresh)} of the {len(new_vocab)} characters in the data are new to it" in capsys.readouterr().out
    for name in ("wte.weight", "lm_head.weight"):
        for i, ch in enumerate(new_vocab):
            if ch in old_vocab:
                assert torch.equal(new["model"][name][i], old["model"][name][old_vocab.index(ch)]), (name, ch)
            else:  # drawn as a new model's rows are: nothing like a copy, nothing like zero
                assert 0.005 < new["model"][name][i].std() < 0.05
                assert not any(torch.equal(new["model"][name][i], row) for row in old["model"][name])
    assert torch.equal(new["model"]["lm_head.weight"], new["model"]["wte.weight"]) == tied
    for name, tensor in old["model"].items():  # everything that is not a row per token: as it was
        if name not in ("wte.weight", "lm_head.weight"):
            assert torch.equal(new["model"][name], tensor), name


def test_finetuning_starts_at_iteration_zero_ahead_of_a_model_from_scratch(base, other_data, tmp_path):
    assert finetune(base, other_data, tmp_path / "ft", "--max_iters=10", "--eval_interval=5") == 0
    assert train.main([TINY, f"--data_dir={other_data}", f"--out_dir={tmp_path / 'scratch'}", *RUN,
                       "--max_iters=10", "--eval_interval=5"]) == 0
    assert [r["iter"] for r in read_log(tmp_path / "ft") if "val_loss" in r] == [0, 5, 10]
    assert files.load_checkpoint(tmp_path / "ft" / "ckpt.pt")["iter"] == 10
    finetuned, scratch = val_losses(tmp_path / "ft"), val_losses(tmp_path / "scratch")
    assert finetuned[0] < scratch[0] - 0.25  # what the checkpoint learned carries over to the new text
    assert finetuned[-1] < scratch[-1]


def test_a_finetuned_run_resumes_like_an_uninterrupted_one(base, other_data, tmp_path, stop_at):
    common = ["--max_iters=8", "--log_interval=1", "--eval_interval=4"]
    assert finetune(base, other_data, tmp_path / "whole", *common) == 0
    stop_at(4)
    assert finetune(base, other_data, tmp_path / "split", *common) == 128 + signal.SIGTERM
    # The same command with --init_from=resume: no model keys needed, the shape is the checkpoint's.
    assert train.main(["--init_from=resume", f"--data_dir={other_data}", f"--out_dir={tmp_path / 'split'}",
                       *RUN, *common]) == 0
    whole, split = ([(r["iter"], r["loss"]) for r in read_log(tmp_path / d) if "loss" in r] for d in ("whole", "split"))
    assert len(whole) == 8 and split == whole


# --- BPE ----------------------------------------------------------------------------------------------


def test_bpe_data_of_the_same_encoding_just_works(small_gpt2, tmp_path):
    for name, text in (("a", "the hat and the cat. " * 300), ("b", "then the other hand, and then the end. " * 200)):
        (tmp_path / f"{name}.txt").write_text(text)
        assert prepare.main(["--input", str(tmp_path / f"{name}.txt"), "--tokenizer=gpt2",
                             "--out_dir", str(tmp_path / name)]) == 0
    assert train.main([TINY, f"--data_dir={tmp_path / 'a'}", f"--out_dir={tmp_path / 'base'}", "--max_iters=2"]) == 0
    assert finetune(tmp_path / "base" / "ckpt.pt", tmp_path / "b", tmp_path / "ft", "--max_iters=0") == 0
    old, new = (files.load_checkpoint(tmp_path / run / "ckpt.pt")["model"] for run in ("base", "ft"))
    assert all(torch.equal(new[name], old[name]) for name in old)
    assert finetune(tmp_path / "base" / "ckpt.pt", tmp_path / "b", tmp_path / "ft2", "--max_iters=3") == 0


# --- Mistakes: one error line, and nothing written ------------------------------------------------------


@pytest.fixture
def bpe_data(small_gpt2, tmp_path):
    (tmp_path / "bpe.txt").write_text("the hat and the cat. " * 300)
    assert prepare.main(["--input", str(tmp_path / "bpe.txt"), "--tokenizer=gpt2",
                         "--out_dir", str(tmp_path / "b")]) == 0
    return tmp_path / "b"


def test_a_character_checkpoint_on_bpe_data_is_one_error_line(base, bpe_data, tmp_path, capsys):
    assert finetune(base, bpe_data, tmp_path / "out") == 2
    assert "reads character tokens" in error_line(capsys) and not (tmp_path / "out").exists()


def test_a_bpe_checkpoint_on_character_data_is_one_error_line(bpe_data, other_data, tmp_path, capsys):
    assert train.main([TINY, f"--data_dir={bpe_data}", f"--out_dir={tmp_path / 'base'}", "--max_iters=1"]) == 0
    capsys.readouterr()
    assert finetune(tmp_path / "base" / "ckpt.pt", other_data, tmp_path / "out") == 2
    assert "--tokenizer=gpt2" in error_line(capsys) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra,says", [
    (["--n_layer=3"], "--n_layer=3 contradicts"),
    (["--pos=rope"], "whose pos is learned"),
    (["--mixer=head"], "--mixer=head contradicts"),
    (["--window=8"], "whose window is 0"),
    (["--bias=true"], "drop it or pass --bias=False"),
    (["--block_size=32"], "--block_size=16 or less"),
    (["--init_from=no/such/ckpt.pt"], "not found"),
])
def test_what_cannot_be_finetuned_is_one_error_line(base, other_data, tmp_path, capsys, extra, says):
    assert finetune(base, other_data, tmp_path / "out", *extra) == 2
    assert says in error_line(capsys) and not (tmp_path / "out").exists()


def test_finetuning_into_the_checkpoints_own_directory_is_refused(base, other_data, capsys):
    before = base.read_bytes()
    assert finetune(base, other_data, base.parent) == 2
    assert "would overwrite" in error_line(capsys)
    assert base.read_bytes() == before


def test_finetuning_over_another_run_needs_overwrite(base, other_data, tmp_path, capsys):
    assert finetune(base, other_data, tmp_path / "ft", "--max_iters=0") == 0
    capsys.readouterr()
    assert finetune(base, other_data, tmp_path / "ft", "--max_iters=0") == 2
    assert "--overwrite=true" in error_line(capsys)


def test_a_runs_directory_fine_tunes_from_its_best_checkpoint_as_sample_py_reads_it(base, other_data, tmp_path,
                                                                                      capsys):
    assert finetune(base.parent, other_data, tmp_path / "out", "--max_iters=2") == 0
    assert f"fine-tuning {base.parent / 'best.pt'}: " in capsys.readouterr().out


def test_the_finetune_bench_joins_a_directorys_text_files_in_name_order(tmp_path):
    import finetune  # bench/finetune.py

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "b.txt").write_text("second\n", encoding="utf-8")
    (texts / "a.txt").write_text("  first  \n", encoding="utf-8")
    joined = finetune.other_text(texts, tmp_path)
    assert joined.read_text(encoding="utf-8") == "first\n\nsecond\n"
