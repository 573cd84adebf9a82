"""The house: the top level is the design card, the imports run one way, and the four files a reader
walks (model, train, sample, prepare) read in order. Their length is measured by what a run executes
(the lines a reader follows), not capped here."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STORY = ("model.py", "train.py", "sample.py", "prepare.py")  # the four files a reader walks
PACKAGE = "tinygpt"
TOP_LEVEL = {*STORY, "config", "data", "tests", "README.md", "docs", "bench", PACKAGE, ".ci",
             "pyproject.toml", "requirements.txt", "requirements-dev.txt", ".gitignore"}


def tracked_top_level():
    """The top-level names git tracks; without git (a copied tree), what is there, less what git ignores."""
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return {line.split("/")[0] for line in files.splitlines()}
    except (OSError, subprocess.CalledProcessError):
        ignored = ("out", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", ".git")
        return {p.name for p in ROOT.iterdir() if not p.name.startswith(ignored)}


def python_files():
    """Every Python file of the project but the tests: {module name: path}."""
    paths = [*ROOT.glob("*.py"), *ROOT.glob(f"{PACKAGE}/*.py"), *ROOT.glob("config/*.py"), *ROOT.glob("bench/*.py")]
    modules = {}
    for path in paths:
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imports_of(path, known):
    """The project's modules that the file imports, anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:  # `from tinygpt import budget` imports tinygpt.budget; `from model import GPT`, model
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != PACKAGE:
                found.add(name)
    return found


def import_graph():
    modules = python_files()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def test_the_top_level_is_the_design_card():
    top = tracked_top_level()
    assert top <= TOP_LEVEL, f"not on the design card: {sorted(top - TOP_LEVEL)}"
    assert {*STORY, "config", "data", "tests", "README.md", PACKAGE} <= top
    assert sorted(p.name for p in ROOT.glob("*.py")) == sorted(STORY)  # no other Python file at the top
    assert (ROOT / "data" / "README.md").is_file()


def test_no_module_imports_itself_round_a_circle():
    graph = import_graph()
    done, path = set(), []

    def visit(name):  # depth first; a module met again on the current path closes a circle
        if name in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for imported in sorted(graph.get(name, ())):
            visit(imported)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    # Decoding runs the model it is given, without importing model.py; the model never imports decoding.
    assert graph["sample"] >= {"tinygpt.decoding"} and "tinygpt.decoding" not in graph["model"]


def test_the_model_is_one_file_that_imports_torch_and_the_standard_library_alone():
    """A reader can copy model.py into a notebook: nothing of ours, nothing but torch beside Python's own."""
    imported = {node.names[0].name if isinstance(node, ast.Import) else node.module
                for node in ast.walk(ast.parse((ROOT / "model.py").read_text(encoding="utf-8")))
                if isinstance(node, (ast.Import, ast.ImportFrom))}
    roots = {name.split(".")[0] for name in imported}
    assert roots - {"torch"} <= set(sys.stdlib_module_names), f"not torch or the standard library: {sorted(roots)}"
    assert import_graph()["model"] == set()


def test_model_py_copied_alone_into_an_empty_folder_builds_and_runs_every_position_encoding(tmp_path):
    (tmp_path / "model.py").write_text((ROOT / "model.py").read_text(encoding="utf-8"), encoding="utf-8")
    code = ("import torch, model\n"
            "for pos in model.POSITIONS:\n"
            "    config = model.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, pos=pos)\n"
            "    print(pos, tuple(model.GPT(config)(torch.zeros(1, 8, dtype=torch.long))[0].shape))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == [f"{pos} (1, 8, 11)" for pos in ("learned", "sinusoidal", "rope", "none")]


def test_bench_machine_py_run_alone_from_another_folder_prints_the_machine(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "machine.py")], cwd=tmp_path, capture_output=True,
                          text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith(f"torch {torch.__version__}") and "cores" in done.stdout


def test_the_package_and_config_never_import_the_scripts_and_config_imports_nothing_of_ours():
    graph = import_graph()
    scripts = {"train", "sample", "prepare"}
    package = {name for name in graph if name.startswith(f"{PACKAGE}.")}
    assert package and not {name: graph[name] & scripts for name in package if graph[name] & scripts}
    assert graph["config"] == set()  # the package imports config (UserError, the loader), never the reverse
    assert any("config" in graph[name] for name in package)


def test_no_function_in_the_package_is_longer_than_50_lines():
    long = {}
    for path in (ROOT / PACKAGE).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                long[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


def test_the_first_rungs_take_the_stream_and_a_mask_and_use_nothing_beside_the_path():
    """CausalAverage, Head and FeedForward read as in the lecture: forward(x) or forward(x, mask), and no
    name they use is defined under "Beside the main path" in model.py."""
    source = (ROOT / "model.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    marker = source[: source.index("# --- Beside the main path")].count("\n") + 1
    beside = {node.name for node in tree.body if getattr(node, "lineno", 0) > marker
              and isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    beside |= {t.id for node in tree.body if getattr(node, "lineno", 0) > marker and isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Name)}
    assert {"where_tokens_are", "fused_attention", "additive_scores"} <= beside
    rungs = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for name in ("CausalAverage", "Head", "FeedForward"):
        cls = rungs[name]
        assert cls.lineno < marker
        forward = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward")
        assert [a.arg for a in forward.args.args] in (["self", "x"], ["self", "x", "mask"]), name
        used = {n.id for n in ast.walk(cls) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)}
        assert not used & beside, (name, used & beside)


def test_no_function_in_train_py_is_longer_than_a_screen():
    tree = ast.parse((ROOT / "train.py").read_text(encoding="utf-8"))
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60}
    assert not long, long
