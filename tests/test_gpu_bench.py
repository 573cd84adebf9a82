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
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu.json").read_text(encoding="utf-8"))
    status = {row["part"]: row["status"] for row in report["rows"]}
    assert status == {"machine": "ok", "prepare": "ok", "bf16": "ok", "steps": "ok", "compiled": "skipped",
                      "fast": "ok", "compiling": "ok", "auto": "ok", "fp16": "ok", "sampling": "ok",
                      "torchrun": "ok"}, report["rows"]
    figures = report["figures"]
    steps = figures["steps"]
    assert min(steps["reference"], steps["fast"], steps["fast_torch_muon"], steps["fast_compiled_muon"]) > 0
    assert all(steps[f"{key}_costliest"] for key in ("reference", "fast", "fast_torch_muon", "fast_compiled_muon"))
    assert figures["compiling"]["eager_ms"] > 0 and figures["compiling"]["compiled_ms"] > 0
    assert figures["bf16"]["ms_per_step"] > 0 and figures["bf16"]["best_val"] < 4.2  # ln(65): it learned
    assert figures["fp16"]["stop_exit"] == 143 and figures["fp16"]["resumed_to"] == 20
    assert 0 < figures["auto"]["whole_val"] < 4.2 and figures["auto"]["sized"].startswith("auto: ")
    assert figures["auto"]["setup_s"] > 0  # to the first step: a busy machine takes longer, and still runs
    assert figures["sampling"]["ours"] > 0 and "nanogpt" not in figures["sampling"]  # no nanoGPT here
    assert figures["torchrun"]["backend"] == "gloo"
    table = (tmp_path / "out" / "gpu.md").read_text(encoding="utf-8")
    assert table.startswith("| part | status |") and "| compiled | skipped | needs a GPU and --nanogpt" in table


FAKE_NANOGPT = '''
from dataclasses import dataclass
import torch

@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 65
    n_layer: int = 1
    n_head: int = 1
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = False

class GPT(torch.nn.Module):  # the names and calls bench/gpu.py uses of nanoGPT's model.py, a bigram model
    def __init__(self, config):
        super().__init__()
        self.table = torch.nn.Embedding(config.vocab_size, config.vocab_size)

    def forward(self, idx, targets=None):
        logits = self.table(idx)
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        print("its parameter groups")
        return torch.optim.AdamW(self.parameters(), learning_rate, betas, weight_decay=weight_decay)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            probs = torch.softmax(self.table(idx[:, -1]).float() / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1)], dim=1)
        return idx
'''


def test_the_gpu_script_takes_turns_with_nanogpts_step_and_samples_with_its_model(tmp_path):
    nanogpt = tmp_path / "nanoGPT"
    (nanogpt / "data" / "shakespeare_char").mkdir(parents=True)
    (nanogpt / "data" / "shakespeare_char" / "prepare.py").write_text("", encoding="utf-8")
    (nanogpt / "model.py").write_text(FAKE_NANOGPT, encoding="utf-8")
    text = tmp_path / "input.txt"
    text.write_text("to be or not to be\n" * 50, encoding="utf-8")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", f"--work={tmp_path / 'work'}",
           f"--out={tmp_path / 'out'}", f"--nanogpt={nanogpt}", f"--input={text}", "--parts=prepare",
           "--parts=steps", "--parts=sampling"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu.json").read_text(encoding="utf-8"))
    assert [row["status"] for row in report["rows"]] == ["ok"] * 4, report["rows"]
    steps, sampling = report["figures"]["steps"], report["figures"]["sampling"]
    assert steps["nanogpt"] > 0 and steps["nanogpt_costliest"]
    assert steps["reference_vs_nanogpt"] == steps["reference"] / steps["nanogpt"]
    assert sampling["nanogpt"] > 0 and sampling["ratio"] == sampling["ours"] / sampling["nanogpt"]
