"""fla's fused recurrent KDA kernel (the glm5_next family's recurrence on CUDA) checked on this CPU machine under
Triton's interpreter (tests/kda_fla_interpreted.py, in a process of its own: TRITON_INTERPRET must be set before
Triton is imported). Skipped where fla-core or Triton is not installed (the optional gpu extra)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_glm5_next import random_glm5

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None,
                                reason="fla-core and triton not installed (pip install -e '.[gpu]')")


def test_fla_kda_equals_its_one_token_steps_and_matches_the_cpu_recurrence(tmp_path):
    random_glm5().save_pretrained(tmp_path)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, str(HERE / "kda_fla_interpreted.py"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    # the kernel's rounding differs from PyTorch's ops (its own exp, fused sums): close, not equal
    assert found["fla_vs_torch_output"] < 1e-5 and found["fla_vs_torch_state"] < 1e-5, found
    # exactness: a verify block's state and outputs are those of as many one-token steps, bit for bit; padding
    # past a row's real tokens leaves its state alone; the commit's replay (no outputs) gives the forward's state
    assert found["block_equals_steps_output"] and found["block_equals_steps_state"], found
    assert found["padding_leaves_state"] and found["replay_equals_forward_state"], found
    # the family on that backend: greedy speculative == plain (drafts accepted and rejected), and plain decoding
    # gives the CPU recurrence's tokens (or differs only at a near-tie)
    assert found["backend"] == "fla" and found["speculative_equals_plain"], found
    assert 1 < found["committed_per_step"] < 4, found
