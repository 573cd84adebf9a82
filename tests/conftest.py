"""Shared fixtures: one thread for torch, and a small prepared character data set."""

import pytest
import torch

import prepare


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine lose much to them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A small character data set: a repetitive text that a tiny model learns fast."""
    root = tmp_path_factory.mktemp("data")
    words = ["the cat sat on the mat.", "a dog ran in the fog!", "to be or not to be?"]
    text = "\n".join(words[i % 3] + " " + words[(i * 7) % 3] for i in range(600))
    (root / "input.txt").write_text(text)
    assert prepare.main(["--input", str(root / "input.txt"), "--out_dir", str(root / "chars")]) == 0
    return str(root / "chars")
