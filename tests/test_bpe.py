"""BPE through tiktoken, the padded vocabulary, several documents, and large inputs in chunks.

Nothing here downloads: the BPE encoding is built locally and registered with
tiktoken the way a plugin's encodings are, so it goes through the same code as gpt2.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import requests
import tiktoken
import tiktoken.load
import tiktoken.registry
import torch

import prepare
import train
from config import UserError
from model import GPT, GPTConfig
from tinygpt import files, system, textfiles
from tinygpt.decoding import generate
from tinygpt.system import padded_vocab_size
from tinygpt.tokenizer import TiktokenTokenizer, cut_point, tokenizer_from_meta

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared/data/tinyshakespeare/input.txt"
LOCAL = "test_local_bpe"
LOCAL_VOCAB = 256 + 27 * 26 + 5 + 1  # bytes, merges, end-of-text
EOT = "<|endoftext|>"


def local_encoding():
    """tiktoken.Encoding arguments: the 256 bytes, merges of each pair of lowercase letters and of
    a space and a letter (so a word cut in two encodes differently), a few words, an end-of-text."""
    letters = [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyz"]
    merges = [a + b for a in [b" ", *letters] for b in letters] + [b"the", b" the", b"and", b" and", b"\n\n"]
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate(merges)}
    # Words with their leading space, numbers, punctuation, then runs of whitespace: the shape of GPT-2's split.
    pattern = r""" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return {"name": LOCAL, "pat_str": pattern, "mergeable_ranks": ranks, "special_tokens": {EOT: len(ranks)}}


@pytest.fixture
def local_bpe(monkeypatch):
    tiktoken.list_encoding_names()  # fills tiktoken's table of encoding constructors
    monkeypatch.setitem(tiktoken.registry.ENCODING_CONSTRUCTORS, LOCAL, local_encoding)
    yield LOCAL
    tiktoken.registry.ENCODINGS.pop(LOCAL, None)


def sample_text(n_chars=20_000):
    """Tiny Shakespeare (or made-up lines without it), with 2-, 3- and 4-byte characters after every paragraph."""
    plain = SHAKESPEARE.read_text(encoding="utf-8") if SHAKESPEARE.is_file() else "the cat sat in the sun.\n\n" * 2000
    odd = "naïve café, 3 crème brûlées — 東京 🙂\n  odd  spacing\tand tabs\n"
    return ("\n\n" + odd).join(plain[:n_chars].split("\n\n"))


def prepare_bpe(path, encoding, out_dir):
    return prepare.main(["--input", str(path), "--tokenizer", encoding, "--out_dir", str(out_dir)])


def read_tokens(out_dir):
    meta, splits = files.load_data(out_dir)
    ids = np.concatenate([splits["train"], splits["val"]])
    return meta, ids


# --- BPE ---------------------------------------------------------------------------


def test_bpe_decode_of_encode_gives_back_the_text(local_bpe):
    tokenizer = TiktokenTokenizer(local_bpe)
    text = sample_text(3000) + f"a literal {EOT} in the data stays text"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.eot_token not in ids
    assert tokenizer.unknown(text) == []
    assert list(tokenizer.encode_array(text, threads=4)) == ids


def test_prepared_bpe_data_decodes_to_the_input(local_bpe, tmp_path):
    text = sample_text()
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    assert prepare_bpe(tmp_path / "in.txt", local_bpe, tmp_path / "d") == 0
    meta, ids = read_tokens(tmp_path / "d")
    assert (meta["tokenizer"], meta["encoding"], meta["vocab_size"]) == ("tiktoken", LOCAL, LOCAL_VOCAB)
    assert meta["train_tokens"] == int(len(ids) * 0.9)
    tokenizer = tokenizer_from_meta(meta)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # the merges did merge


def test_bpe_ids_do_not_depend_on_chunk_size_or_threads(local_bpe, tmp_path, monkeypatch):
    text = sample_text()
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    whole = TiktokenTokenizer(local_bpe).encode(text)
    monkeypatch.setattr(textfiles, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(system, "cpu_count", lambda: 3)
    assert prepare_bpe(tmp_path / "in.txt", local_bpe, tmp_path / "d") == 0
    assert list(read_tokens(tmp_path / "d")[1]) == whole


def test_cut_point_is_a_word_boundary():
    assert cut_point("one two three", 11) == 7  # before " three"
    assert cut_point("one\ntwo", 7) == 4  # after the newline
    assert cut_point("one  two", 8) == 8  # no cut inside a run of spaces: the end it is


def test_default_out_dir_names_the_encoding(local_bpe, tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text(sample_text(2000))
    monkeypatch.chdir(tmp_path)
    assert prepare.main(["--input", "notes.txt", "--tokenizer", local_bpe]) == 0
    assert (tmp_path / "data" / f"notes_{LOCAL}" / "meta.json").is_file()


# --- Offline -------------------------------------------------------------------------


def test_offline_named_encoding_is_one_error_line(tmp_path, monkeypatch, capsys):
    # What happens without a network: nothing in the cache, and requests cannot connect.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "gpt2", raising=False)

    def no_network(url):
        raise requests.exceptions.ConnectionError(f"Max retries exceeded with url: {url}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    (tmp_path / "in.txt").write_text(sample_text(2000))
    out_dir = tmp_path / "d"
    assert prepare.main(["--input", str(tmp_path / "in.txt"), "--tokenizer", "gpt2", "--out_dir", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "'gpt2'" in err and "download" in err and "TIKTOKEN_CACHE_DIR" in err
    assert not out_dir.exists()


def test_unknown_encoding_suggests_the_closest(capsys, tmp_path):
    (tmp_path / "in.txt").write_text("hello")
    assert prepare.main(["--input", str(tmp_path / "in.txt"), "--tokenizer", "gtp2"]) == 2
    err = capsys.readouterr().err
    assert "did you mean gpt2?" in err and "char" in err


# --- The padded vocabulary ---------------------------------------------------------------


def test_padded_vocab_size_rounds_up_to_a_multiple_of_64():
    assert [padded_vocab_size(n) for n in (1, 64, 65, 270, 50257)] == [64, 64, 128, 320, 50304]


def huge_padding_logits(model, real):
    """Makes every padding logit 1e4 before the model sees them, whatever the weights."""
    def hook(module, inputs, logits):
        return logits.index_fill(-1, torch.arange(real, logits.size(-1)), 1e4)
    model.lm_head.register_forward_hook(hook)


def test_padding_logits_are_never_sampled_nor_in_the_loss():
    torch.manual_seed(0)
    real = 70
    conf = dict(vocab_size=padded_vocab_size(real), block_size=16, n_layer=1, n_head=2, n_embd=32)
    padded, unpadded = GPT(GPTConfig(real_vocab_size=real, **conf)).eval(), GPT(GPTConfig(**conf)).eval()
    for model in (padded, unpadded):
        huge_padding_logits(model, real)
    idx = torch.randint(real, (4, 5))
    targets = torch.randint(real, (4, 5))

    logits, loss = padded(idx, targets)
    assert logits.shape == (4, 5, real)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits.reshape(-1, real), targets.reshape(-1)))
    assert loss.item() < 10  # a padding logit of 1e4 in the softmax would make it about 1e4
    sampled = generate(padded, idx, 30, temperature=1.0)[:, 5:]
    assert sampled.max().item() < real
    # Without real_vocab_size the same huge logits are all that is sampled: the test can fail.
    assert generate(unpadded, idx, 5, temperature=1.0)[:, 5:].min().item() >= real


def test_training_on_bpe_data_pads_the_embedding(local_bpe, tmp_path):
    (tmp_path / "in.txt").write_text(sample_text(8000))
    assert prepare_bpe(tmp_path / "in.txt", local_bpe, tmp_path / "d") == 0
    args = [str(ROOT / "config" / "tiny.toml"), f"--data_dir={tmp_path / 'd'}", f"--out_dir={tmp_path / 'out'}"]
    assert train.main([*args, "--max_iters=2", "--eval_interval=2"]) == 0
    ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert (ckpt["model_config"]["vocab_size"], ckpt["model_config"]["real_vocab_size"]) == (1024, LOCAL_VOCAB)
    assert ckpt["model"]["wte.weight"].shape[0] == 1024
    assert ckpt["meta"]["encoding"] == LOCAL


# --- Several documents ---------------------------------------------------------------


def test_documents_are_separated_by_end_of_text(local_bpe, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = {"b.txt": "the second one\n" * 20, "a.txt": "and the first one\n" * 20, "c.md": "not a document"}
    for name, text in texts.items():
        (docs / name).write_text(text)
    assert prepare.main(["--input", str(docs), "--tokenizer", local_bpe, "--out_dir", str(tmp_path / "d")]) == 0
    meta, ids = read_tokens(tmp_path / "d")
    tokenizer = tokenizer_from_meta(meta)
    assert list(ids).count(tokenizer.eot_token) == 1
    assert tokenizer.decode(ids) == texts["a.txt"] + EOT + texts["b.txt"]  # sorted by name; .md left out
    assert meta["documents"] == 2


def test_char_documents_are_separated_by_a_blank_line(tmp_path):
    (tmp_path / "a.txt").write_text("first document, no newline at the end " * 5)
    (tmp_path / "b.txt").write_text("second document\n" * 10)
    (tmp_path / "c.txt").write_text("third document\n" * 10)
    paths = [str(tmp_path / name) for name in ("a.txt", "b.txt", "c.txt")]
    assert prepare.main(["--input", paths[0], "--input", paths[1], "--input", paths[2],
                         "--out_dir", str(tmp_path / "d")]) == 0
    meta, ids = read_tokens(tmp_path / "d")
    expected = "\n\n".join(Path(p).read_text().rstrip("\n") for p in paths) + "\n"
    assert tokenizer_from_meta(meta).decode(ids) == expected
    assert meta["source"] == "a.txt, b.txt, c.txt"


# --- Large inputs, in chunks -----------------------------------------------------------


def test_chunked_char_prepare_writes_the_same_bins_as_one_chunk(tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text(sample_text(), encoding="utf-8")  # has 2-, 3- and 4-byte characters
    assert prepare.main(["--input", str(tmp_path / "in.txt"), "--out_dir", str(tmp_path / "whole")]) == 0
    monkeypatch.setattr(textfiles, "CHUNK_BYTES", 7)  # splits many characters' bytes between reads
    assert prepare.main(["--input", str(tmp_path / "in.txt"), "--out_dir", str(tmp_path / "chunked")]) == 0
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "chunked" / name).read_bytes()


@pytest.mark.parametrize("chunk", [3, 4, 1 << 20])
def test_invalid_utf8_split_between_reads_reports_its_offset(tmp_path, monkeypatch, capsys, chunk):
    # "é" is c3 a9; a c3 followed by "x" is invalid. With 3-byte reads the c3 ends the first read.
    (tmp_path / "in.txt").write_bytes(b"ab\xc3xyz" + b"more text" * 10)
    monkeypatch.setattr(textfiles, "CHUNK_BYTES", chunk)
    assert prepare.main(["--input", str(tmp_path / "in.txt"), "--out_dir", str(tmp_path / "d")]) == 2
    assert "byte 0xc3 at offset 2" in capsys.readouterr().err


def test_truncated_character_at_the_end_reports_its_offset(tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_bytes("plain text then é".encode()[:-1])
    monkeypatch.setattr(textfiles, "CHUNK_BYTES", 5)
    with pytest.raises(UserError, match="byte 0xc3 at offset 16"):
        "".join(textfiles.read_chunks(tmp_path / "in.txt"))


def test_a_failed_run_keeps_the_old_data_and_leaves_no_temporary_files(local_bpe, tmp_path, monkeypatch, capsys):
    (tmp_path / "good.txt").write_text(sample_text(5000))
    out_dir = tmp_path / "d"
    assert prepare_bpe(tmp_path / "good.txt", local_bpe, out_dir) == 0
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    # BPE has no first pass: the bad byte is found after the first file is already encoded.
    (tmp_path / "bad.txt").write_bytes(b"fine at first, " * 1000 + b"\xff")
    monkeypatch.setattr(textfiles, "CHUNK_BYTES", 1024)
    args = ["--input", str(tmp_path / "good.txt"), "--input", str(tmp_path / "bad.txt")]
    assert prepare.main([*args, "--tokenizer", local_bpe, "--out_dir", str(out_dir)]) == 2
    assert "byte 0xff at offset 15000" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before
    assert json.loads(before["meta.json"])["documents"] == 1
