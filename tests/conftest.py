"""Shared fixtures: one thread for torch, a fresh clock for each test, a small prepared character data set, a
stop part way through a run."""

import os
import signal
import time

import pytest
import torch

import prepare
import train
from tinygpt import system


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine lose much to them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_clock(monkeypatch):
    """A run's clock counts from its process's start (system.process_age); a run inside the tests' process
    counts from its test's start, as a new process would, however long the suite has been running."""
    started = time.monotonic()
    monkeypatch.setattr(system, "process_age", lambda: time.monotonic() - started)


@pytest.fixture
def stop_at(monkeypatch):
    """stop_at(n): the next run in this process gets a SIGTERM once it has taken n steps, as a user's kill would."""

    def arm(iteration):
        real = train.log_step

        def log_step(run, *args):
            real(run, *args)
            if run.it == iteration:
                monkeypatch.setattr(train, "log_step", real)  # once
                os.kill(os.getpid(), signal.SIGTERM)

        monkeypatch.setattr(train, "log_step", log_step)

    return arm


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A small character data set: a repetitive text that a tiny model learns fast."""
    root = tmp_path_factory.mktemp("data")
    words = ["the cat sat on the mat.", "a dog ran in the fog!", "to be or not to be?"]
    text = "\n".join(words[i % 3] + " " + words[(i * 7) % 3] for i in range(600))
    (root / "input.txt").write_text(text)
    assert prepare.main(["--input", str(root / "input.txt"), "--out_dir", str(root / "chars")]) == 0
    return str(root / "chars")


def small_bpe_ranks():
    """A byte-level BPE small enough for a test: the 256 bytes and a few merges."""
    letters = [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyz"]
    merges = [b" " + c for c in letters] + [b"th", b"he", b"the", b" the", b"an", b"nd", b" and", b"er", b"\n\n"]
    return {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate(merges)}


@pytest.fixture
def small_gpt2(monkeypatch):
    """tiktoken's "gpt2" encoding replaced, in this process only, by a small local one (the
    real one downloads its files): GPT-2's split pattern over small_bpe_ranks(), then
    <|endoftext|>. Returns its vocabulary size."""
    import tiktoken
    import tiktoken.registry

    ranks = small_bpe_ranks()
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    encoding = {"name": "gpt2", "pat_str": pattern, "mergeable_ranks": ranks,
                "special_tokens": {"<|endoftext|>": len(ranks)}}
    tiktoken.list_encoding_names()  # fills tiktoken's table of encoding constructors
    monkeypatch.setitem(tiktoken.registry.ENCODING_CONSTRUCTORS, "gpt2", lambda: encoding)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "gpt2", raising=False)
    yield len(ranks) + 1
    tiktoken.registry.ENCODINGS.pop("gpt2", None)  # the next get_encoding("gpt2") builds the real one
