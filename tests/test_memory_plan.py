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
import torch

from verify_worker.memory_plan import (GATEWAY_BYTES, GB, HEADROOM, PROCESS_BYTES, PlanRequest, make_plan,
                                       plan_lines, refusal, request_from_settings, start_decision)
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
    from conftest import write_hf_checkpoint
    from test_glm5_next import random_glm5
    from test_glm_moe_dsa import random_glm, write_fp8_copy

    glm, glm5 = tmp_path_factory.mktemp("plan_glm"), tmp_path_factory.mktemp("plan_glm5")
    random_glm().save_pretrained(glm)
    random_glm5().save_pretrained(glm5)
    fp8 = tmp_path_factory.mktemp("plan_glm_fp8") / "fp8"
    write_fp8_copy(glm, fp8)  # as GLM-5.2-FP8 ships: kept FP8 but for kv_b (read per head)
    bf16 = tmp_path_factory.mktemp("plan_qwen3_bf16")
    write_hf_checkpoint(bf16, "qwen3", dtype=torch.bfloat16, tie_word_embeddings=True)
    return {"qwen3": qwen3_pair[3], "qwen3_bf16": bf16, "glm_moe_dsa": glm, "glm5_next": glm5,
            "glm_moe_dsa_fp8": fp8}


def held_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes by dtype of the storages a loaded model's parameters and buffers hold, each storage once."""
    seen, held = set(), {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            dtype = str(tensor.dtype).removeprefix("torch.")
            held[dtype] = held.get(dtype, 0) + storage.nbytes()
    return held


@pytest.mark.parametrize("family,dtype", [("qwen3", "float32"), ("qwen3_bf16", "auto"), ("glm_moe_dsa", "float32"),
                                          ("glm5_next", "float32"), ("glm_moe_dsa_fp8", "float32")])
def test_the_plan_counts_what_the_loader_places_and_a_state_allocates(folders, family, dtype):
    """As served: packed for this CPU (a bfloat16 Qwen3 checkpoint's projections and lm_head as the C++ kernels'
    bfloat16 tiles beside a float32 embedding, its KV cache bfloat16, where the kernels build)."""
    folder = folders[family]
    config = json.loads((folder / "config.json").read_text())
    plan = make_plan(plan_for(config, max_model_len=48, dtype=dtype))
    target = load_target(folder, dtype=dtype)
    assert plan.weights == held_bytes(target)
    assert ("float8_e4m3fn" in plan.weights) == family.endswith("fp8")
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


def cpu_plan(**changes) -> PlanRequest:
    """Qwen3-0.6B as published, served with dflash-serve's defaults on a CPU host of `host_bytes`."""
    settings = dict(dtype="auto", max_model_len=4096, max_running=64, max_prefill_tokens=512, block_size=None,
                    host_bytes=23 * 2**30, host_source="test")
    return plan_for(published("qwen3-0.6b"), **{**settings, **changes})


def test_on_a_cpu_the_host_is_the_device_and_the_kv_pool_takes_what_is_left():
    """The 0.6B shape at its 4096-token context on 23 GiB: its paged cache's pool takes the memory left after the
    fixed part (fewer pages than 64 requests at the context would take), so all 64 slots start; a host that cannot
    hold one request at the context lowers them to what fits, and one that cannot load the weights refuses."""
    plan = make_plan(cpu_plan())
    assert plan.others == GATEWAY_BYTES and plan.process > 0
    assert plan.usable == int((23 * 2**30 - GATEWAY_BYTES) * (1 - HEADROOM))
    assert plan.paged and plan.page_bytes * plan.pages_per_request >= plan.kv_per_request
    pages = plan.pool_pages(64)
    assert pages == (plan.usable - plan.fixed) // plan.page_bytes < 64 * plan.pages_per_request
    assert plan.fitting_requests == 64 and plan.fits and start_decision(plan).why is None
    assert plan.asked(64) <= plan.usable < plan.asked(64) + plan.page_bytes
    pool = next(line for line in plan_lines(plan) if line.startswith("  KV pool:"))
    assert f"{pages} pages of 64 positions" in pool and f"{pages * 64} tokens at once" in pool, pool
    host_line = next(line for line in plan_lines(plan) if line.startswith("  host:"))
    assert "23.0 GiB (test)" in host_line and "for the gateway:" in host_line, host_line
    tight = make_plan(cpu_plan(host_bytes=int((plan.fixed + plan.kv_per_request / 2) / (1 - HEADROOM))
                               + GATEWAY_BYTES))
    assert tight.fitting_requests == 0 and not tight.fits  # the pool would not hold one request at the context


def test_on_a_cpu_a_draft_worker_and_tensor_parallel_ranks_share_the_host():
    """A draft worker beside the verify worker takes its weights and a context cache for every request it may
    hold; TP ranks split what is left (a wider TP is no way out on one host)."""
    from conftest import tiny_draft_config

    draft = tiny_draft_config(target_layers=28, hidden=1024, vocab=151936, num_heads=16, num_kv_heads=8,
                              head_dim=128).to_dict()
    alone = make_plan(cpu_plan())
    worker = make_plan(cpu_plan(draft_config=draft))
    local = make_plan(cpu_plan(draft_config=draft, local_drafter=True))
    assert worker.others == GATEWAY_BYTES + PROCESS_BYTES + worker.drafter_weights + 64 * worker.drafter_per_request
    assert local.others == GATEWAY_BYTES and local.fixed == alone.fixed + local.drafter_weights
    assert worker.slot_bytes > alone.slot_bytes == 0  # the drafter's feature rows, kept per request
    assert worker.pool_pages(64) < local.pool_pages(64) < alone.pool_pages(64)
    two = make_plan(cpu_plan(world_size=2))
    assert two.share == (23 * 2**30 - GATEWAY_BYTES) // 2
    assert "--tp" not in (refusal(two) or "")


def test_on_a_cpu_a_host_too_small_to_load_the_weights_refuses_the_start():
    plan = make_plan(cpu_plan(host_bytes=2 * 2**30))
    assert plan.loading > plan.usable and plan.fitting_requests == 0
    decision = start_decision(plan)
    assert decision.requests == 0
    assert "while loading" in decision.why and "nothing on this host" in decision.why, decision.why


def test_the_plan_reads_cpu_memory_gb_or_else_the_host(tmp_path):
    from shared.host_memory import read_host_memory
    from verify_worker.server import parse_args

    folder = tmp_path / "q06"
    folder.mkdir()
    shutil.copy(PUBLISHED / "qwen3-0.6b.json", folder / "config.json")
    given = request_from_settings(parse_args(["--target", str(folder), "--no-draft", "--cpu-memory-gb", "8"]), "cpu")
    assert given.host_bytes == 8 * GB and given.host_source.startswith("--cpu-memory-gb") and given.device_bytes is None
    read = request_from_settings(parse_args(["--target", str(folder), "--no-draft"]), "cpu")
    host = read_host_memory()
    assert read.host_source == host.source and abs(read.host_bytes - host.available) < 2**30


def test_dflash_serve_plan_on_a_cpu_gives_the_start_decision(tmp_path, capsys):
    """--plan's entry point for the 0.6B shape with 8 GB: the pool it would start with, and a fit; at its whole
    40960-token context the pool would not hold one request, and the plan says what would."""
    from verify_worker.memory_plan import main
    from verify_worker.server import parse_args

    folder = tmp_path / "q06"
    folder.mkdir()
    shutil.copy(PUBLISHED / "qwen3-0.6b.json", folder / "config.json")
    settings = ["--target", str(folder), "--no-draft", "--max-model-len", "4096", "--cpu-memory-gb", "8"]
    assert main(settings) == 0
    out = capsys.readouterr().out
    plan = make_plan(request_from_settings(parse_args(settings), "cpu"))
    assert f"KV pool: {plan.pool_pages(64)} pages of 64 positions" in out and "plan: fits" in out, out
    assert "host: 7.5 GiB (--cpu-memory-gb, as given" in out, out
    assert main([*settings[:3], "--max-model-len", "40960", *settings[5:]]) == 1
    out = capsys.readouterr().out
    assert "refuses to start" in out and "would fit: --max-model-len" in out, out
