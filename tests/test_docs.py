"""README.md and docs/: every command they give names a script that exists, every --flag is one of
that script's options, every preset and page they point to is there, and no path they name is outside
the repository."""

import dataclasses
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "data" / "README.md"]
# python SCRIPT.py, python -m tinygpt.NAME, or torchrun ... train.py; then its arguments, to the end of the
# command: a comment, a pipe, the next command, the end of a code span or line.
COMMAND = re.compile(r"(?:python3?|torchrun[^`\n]*?)[ \t]+(-m[ \t]+tinygpt\.\w+|[\w/]+\.py)\b([^`\n#|;&]*)")
FLAG = re.compile(r"(?<![\w-])--([a-z][\w-]*)")
# A path a user's clone does not have: above the repository (commands run from its root), /tmp, a home directory.
OUTSIDE = re.compile(r"(?<![\w.])(?:\.\./|/tmp/|~/|\$HOME\b|/home/|/root/|/Users/)")
LINK = re.compile(r"\]\(([^)\s]*)\)")


def options_of(module):
    """The option names of a script's settings: every dataclass field with help text in the module, and
    train.py's where the script passes them through or reads them (the ladder, some benchmarks)."""
    names = set()
    for value in vars(module).values():
        if dataclasses.is_dataclass(value) and isinstance(value, type) and value.__module__ == module.__name__:
            names |= {f.name for f in dataclasses.fields(value) if "help" in f.metadata}
    if "train.TrainConfig" in Path(module.__file__).read_text(encoding="utf-8"):
        names |= options_of(importlib.import_module("train"))
    return names


def module_of(script):
    """The module behind `-m tinygpt.score` or `bench/nanogpt.py`, imported; None if there is no such file."""
    if script.startswith("-m"):
        name = script.split()[-1]
        path = ROOT / (name.replace(".", "/") + ".py")
    else:
        path, name = ROOT / script, Path(script).stem
        if path.parent != ROOT:
            sys.path.insert(0, str(path.parent))  # a benchmark, imported as its folder would run it
    return importlib.import_module(name) if path.is_file() else None


def anchors(page):
    """The link targets of a page's headings, as GitHub makes them: lower case, no punctuation, dashes."""
    headings = re.findall(r"^#+\s+(.*)$", page.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def commands():
    """(page, script, arguments) of every command in the pages."""
    found = []
    for page in PAGES:
        for match in COMMAND.finditer(page.read_text(encoding="utf-8")):
            found.append((page.relative_to(ROOT), re.sub(r"\s+", " ", match[1]), match[2]))
    return found


def test_the_pages_give_commands_to_check():
    scripts = {script for _, script, _ in commands()}
    assert {"train.py", "sample.py", "prepare.py", "-m tinygpt.score", "-m tinygpt.plot", "bench/ladder.py"} \
        <= scripts


@pytest.mark.parametrize("page, script, arguments", commands(), ids=lambda v: str(v)[:60])
def test_every_command_names_a_script_and_its_options(page, script, arguments):
    module = module_of(script)
    assert module is not None, f"{page}: no script {script}"
    unknown = {flag.replace("-", "_") for flag in FLAG.findall(arguments)} - options_of(module) - {"help"}
    assert not unknown, f"{page}: {script} has no option {sorted(unknown)} (in: {script}{arguments})"


def test_every_flag_named_alone_is_an_option_of_some_script():
    scripts = ("train", "sample", "prepare", "tinygpt.score", "tinygpt.plot", "tinygpt.export", "ladder", "gpu")
    every = set().union(*(options_of(importlib.import_module(name)) for name in scripts))
    for page in PAGES:
        for span in re.findall(r"`(--[^`]+)`", page.read_text(encoding="utf-8")):
            name = FLAG.match(span)[1].replace("-", "_")
            assert name in every | {"key", "help"}, f"{page.relative_to(ROOT)}: `{span}` is no option of any script"


def test_every_preset_and_page_named_exists():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for preset in re.findall(r"\bconfig/[\w/.-]*\.toml\b", text):
            assert (ROOT / preset).is_file(), f"{page.relative_to(ROOT)}: {preset} does not exist"
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)]*))?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            linked = page.parent / target if target else page
            assert linked.exists(), f"{page.relative_to(ROOT)}: link to {target}, not there"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), f"{page.relative_to(ROOT)}: no heading #{anchor} in {target}"


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200
    headings = [line for line in lines if line.startswith("#")]
    assert len(headings) == len(set(headings))  # a link to a heading lands on the one meant


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_the_pages_name_no_path_outside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    for target in LINK.findall(text):  # a link is read from its page's folder: docs/ links ../README.md
        if not target.startswith(("http://", "https://")):
            linked = (page.parent / target.split("#")[0]).resolve()
            assert linked.is_relative_to(ROOT), f"{page.relative_to(ROOT)}: a link out of the repository: {target}"
    for number, line in enumerate(LINK.sub("]()", text).splitlines(), 1):
        found = OUTSIDE.search(line)
        assert not found, f"{page.relative_to(ROOT)}:{number}: {found[0]!r} is outside the repository: {line.strip()}"
