"""The memory plan (verify_worker/memory_plan.py) from config.json alone: against what the loader places and what a
state allocates on tiny checkpoints of every family, the published configs' refusals and their fixes, and
`dflash-serve --plan` on a folder holding nothing but a config.json."""

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from verify_worker.memory_plan import (GB, HEADROOM, PlanRequest, make_plan, plan_lines, refusal,
                                       request_from_settings)
from verify_worker.target_loader import load_target

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "benchmarks" / "published_configs"


def plan_for(config: dict, tp: int = 1, **changes) -> PlanRequest:
    settings = dict(target_config=config, draft_config=None, world_size=tp, max_model_len=None, max_running=4,
                    max_prefill_tokens=64, block_size=4, dtype="float32", device="cpu", device_bytes=None,
                    local_drafter=False, cuda_graphs=False)
    return PlanRequest(**{**settings, **changes})


@pytest.fixture(scope="module")
def folders(tmp_path_factory, qwen3_pair):
    from test_glm5_next import random_glm5
    from test_glm_moe_dsa import random_glm, write_fp8_copy

    glm, glm5 = tmp_path_factory.mktemp("plan_glm"), tmp_path_factory.mktemp("plan_glm5")
    random_glm().save_pretrained(glm)
    random_glm5().save_pretrained(glm5)
    fp8 = tmp_path_factory.mktemp("plan_glm_fp8") / "fp8"
    write_fp8_copy(glm, fp8)  # as GLM-5.2-FP8 ships: kept FP8 but for kv_b (read per head)
    return {"qwen3": qwen3_pair[3], "glm_moe_dsa": glm, "glm5_next": glm5, "glm_moe_dsa_fp8": fp8}


@pytest.mark.parametrize("family", ["qwen3", "glm_moe_dsa", "glm5_next", "glm_moe_dsa_fp8"])
def test_the_plan_counts_what_the_loader_places_and_a_state_allocates(folders, family):
    folder = folders[family]
    config = json.loads((folder / "config.json").read_text())
    plan = make_plan(plan_for(config, max_model_len=48))
    target = load_target(folder, dtype="float32", pack=False)
    placed: dict[str, int] = {}
    for parameter in target.parameters():
        dtype = str(parameter.dtype).removeprefix("torch.")
        placed[dtype] = placed.get(dtype, 0) + parameter.numel() * parameter.element_size()
    assert plan.weights == placed
    assert ("float8_e4m3fn" in placed) == family.endswith("fp8")
    states = [target.new_state(slots, plan.context + plan.block, plan.block).nbytes() for slots in (1, 2)]
    assert plan.per_request == states[1] - states[0]  # a request's share; no drafter: the target's state alone


def published(name: str) -> dict:
    return json.loads((PUBLISHED / f"{name}.json").read_text())


def test_glm_5_2_fp8_is_refused_on_one_h200_and_fits_the_eight_it_was_made_for():
    """GLM-5.2-FP8 as published (744B parameters): its experts and projections stay FP8 (about 750 GB, not the
    1.5 TB of bfloat16), so TP 8 on H200s (141 GB) fits; one GPU is refused with that fix named."""
    request = plan_for(published("glm-5.2-fp8"), dtype="auto", device="cuda", device_bytes=141 * GB,
                       max_model_len=32768, max_running=64, block_size=8, taps=5)
    plan = make_plan(request)
    assert 7.0e11 < plan.weights["float8_e4m3fn"] < 7.6e11 and plan.weights["bfloat16"] < 1e10, plan.weights
    assert not plan.fits and plan.fitting_requests == 0
    why = refusal(plan)
    assert "do not fit one GPU" in why and "--tp 8" in why, why
    assert any("experts and projections stay FP8" in line for line in plan_lines(plan))
    eight = make_plan(replace(request, world_size=8))
    assert f"{eight.fitting_requests} requests of 32768 tokens fit" in why and 0 < eight.fitting_requests < 64
    assert make_plan(replace(request, world_size=8, max_running=eight.fitting_requests)).fits


def test_too_many_long_requests_are_refused_with_the_settings_that_fit():
    request = plan_for(published("qwen3-8b"), dtype="auto", device="cuda", device_bytes=80 * GB,
                       max_model_len=40960, max_running=64, block_size=8, taps=5)
    plan = make_plan(request)
    assert 0 < plan.fitting_requests < 64
    why = refusal(plan)
    assert f"{plan.fitting_requests} of --max-running 64 requests of 40960 tokens fit" in why, why
    assert f"--max-running {plan.fitting_requests}" in why and "--max-model-len" in why, why
    shorter = int(why.split("--max-model-len ")[1].split()[0].rstrip(";"))
    assert make_plan(replace(request, max_model_len=shorter)).fits


def test_dflash_serve_plan_reads_only_config_json_and_exits_by_the_fit(tmp_path, capsys):
    """dflash-serve --plan (the launcher, which runs the plan with the verify worker's settings) refuses with the
    fix; the plan's own entry point, with the settings the fix names, exits 0."""
    from verify_worker.memory_plan import main

    folder = tmp_path / "glm-5.2"
    folder.mkdir()
    shutil.copy(PUBLISHED / "glm-5.2.json", folder / "config.json")  # no tokenizer, no weights
    settings = ["--target", str(folder), "--no-draft", "--device", "cuda", "--gpu-memory-gb", "141",
                "--max-model-len", "32768"]
    refused = subprocess.run([sys.executable, "-m", "gateway.launcher", "--plan", *settings, "--tp", "8"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode == 1, refused.stderr
    assert "memory plan (glm_moe_dsa, TP 8, cuda" in refused.stdout and "--tp 16" in refused.stdout, refused.stdout
    assert main([*settings, "--tp", "16", "--max-running", "8"]) == 0
    assert "requests that fit" in capsys.readouterr().out


def test_a_worker_refuses_only_what_cannot_fit_and_otherwise_lowers_max_running(folders, caplog):
    """At start: the weights and one request past the device is a refusal naming the fix; a fit that only the
    activations' estimate spoils lowers --max-running to 1 with a warning (the estimate is not a reason to refuse)."""
    import logging

    from shared.errors import DFlashError
    from verify_worker.memory_plan import planned_requests
    from verify_worker.server import parse_args

    folder = str(folders["glm_moe_dsa"])
    base = ["--target", folder, "--no-draft", "--device", "cuda", "--dtype", "float32", "--max-model-len", "64"]
    plan = make_plan(request_from_settings(parse_args(base + ["--gpu-memory-gb", "1"]), "cuda"))
    counted = plan.fixed - plan.activations + plan.request_total  # what is sure to be needed
    log = logging.getLogger("test.plan")
    with pytest.raises(DFlashError, match="does not fit"):
        planned_requests(parse_args(base + ["--gpu-memory-gb", str(counted / 2 / GB)]), "cuda", log)
    squeezed = (counted + plan.activations / 2) / (1 - HEADROOM) / GB  # the estimate alone leaves no room
    with caplog.at_level(logging.WARNING, logger="test.plan"):
        assert planned_requests(parse_args(base + ["--gpu-memory-gb", str(squeezed)]), "cuda", log) == 1
    assert "max running lowered from 64" in caplog.text
