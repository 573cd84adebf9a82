"""bench/gpu.py, the one prepared GPU run, at its smoke size on the CPU: every part that can run without
a GPU runs, and the table and the JSON say what each part saw."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_script_runs_every_part_it_can_on_a_cpu(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", f"--work={tmp_path / 'work'}",
           f"--out={tmp_path / 'out'}", f"--nanogpt={tmp_path / 'no_nanogpt'}"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu.json").read_text(encoding="utf-8"))
    status = {row["part"]: row["status"] for row in report["rows"]}
    assert status == {"machine": "ok", "prepare": "ok", "bf16": "ok", "steps": "ok", "compiled": "skipped",
                      "fast": "ok", "compiling": "ok", "auto": "ok", "fp16": "ok", "sampling": "ok",
                      "torchrun": "ok"}, report["rows"]
    figures = report["figures"]
    steps = figures["steps"]
    assert min(steps["reference"], steps["fast"], steps["fast_torch_muon"]) > 0
    assert all(steps[f"{key}_costliest"] for key in ("reference", "fast", "fast_torch_muon"))
    assert figures["compiling"]["eager_ms"] > 0 and figures["compiling"]["compiled_ms"] > 0
    assert figures["bf16"]["ms_per_step"] > 0 and figures["bf16"]["best_val"] < 4.2  # ln(65): it learned
    assert figures["fp16"]["stop_exit"] == 143 and figures["fp16"]["resumed_to"] == 20
    assert 0 < figures["auto"]["whole_val"] < 4.2 and figures["auto"]["sized"].startswith("no preset")
    assert 0 < figures["auto"]["setup_s"] < 12  # to the first step, within the run's 12 s
    assert figures["sampling"]["ours"] > 0 and "nanogpt" not in figures["sampling"]  # no nanoGPT here
    assert figures["torchrun"]["backend"] == "gloo"
    table = (tmp_path / "out" / "gpu.md").read_text(encoding="utf-8")
    assert table.startswith("| part | status |") and "| compiled | skipped | needs a GPU and --nanogpt" in table
