"""benchmarks/gpu_glm_step.py's dry run (--device cpu --config tiny), as the GPU session runs it at full size: both
GLM families built as their loaders build them, stepped, and decoded through the engine with the replay drafter,
which must commit the acceptance asked for while the output stays the plain decoding's, and with a random drafter
of the family's kind, whose drafts the target rejects while the output stays the plain decoding's."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_glm_step_benchmark_runs_on_cpu_and_its_replay_drafter_is_exact():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_glm_step.py"), "--device", "cpu",
                          "--config", "tiny", "--batches", "2", "--rounds", "1", "--speedup-batches", "2",
                          "--prompts", "2", "--tokens", "12", "--acceptances", "3", "--qwen", "none"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for family in ("glm5", "glm52"):
        table = re.search(rf"^{family} \(tiny.*?\n((?:  .*\n)+)", run.stdout, re.M)
        assert table, run.stdout
        steps = re.findall(r"^\s+2 x (\d+)\s+([\d.]+)", table.group(1), re.M)
        assert [tokens for tokens, _ in steps] == ["1", "8"] and all(float(ms) > 0 for _, ms in steps), table.group(1)
        line = re.search(rf"^  {family} batch  2: .*acceptance 3 \(([\d.]+)/step\): +[\d.]+x, (\d+)/2 mismatches",
                         run.stdout, re.M)
        assert line, run.stdout
        # 12 tokens: a prefill token, then steps of 3 until the last one is cut short
        assert 2.5 <= float(line.group(1)) <= 3.0 and line.group(2) == "0", line.group(0)
        kind = "DFlash 2" if family == "glm5" else "DFlash"
        drafted = re.search(rf"^  {family} with a random {kind} drafter: 0/2 greedy mismatches .*\((\d+) drafts",
                            run.stdout, re.M)
        assert drafted and int(drafted.group(1)) > 0, run.stdout


def test_the_fp8_slices_with_fp8_activations_decode_exactly():
    """--fp8 w8a8: FP8 weights and activations (kernel_set.py), the GLM-5.2 family; speculative == plain still."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_glm_step.py"), "--device", "cpu",
                          "--config", "tiny", "--families", "glm52", "--fp8", "w8a8", "--batches", "2", "--rounds",
                          "1", "--speedup-batches", "2", "--prompts", "2", "--tokens", "12", "--acceptances", "3",
                          "--qwen", "none"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "glm52 (tiny, FP8 weights (w8a8), 2 layers)" in run.stdout, run.stdout
    assert re.search(r"^  glm52 batch  2: .*acceptance 3 .*, 0/2 mismatches", run.stdout, re.M), run.stdout
