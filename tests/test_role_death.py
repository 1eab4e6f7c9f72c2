"""dflash-serve names why a role died before it was ready: a verify worker its memory plan refused (its exit status
and its last log lines), and one the kernel's OOM killer ended in a memory cgroup too small for what it allocates
(the kill named as such, its peak memory and what its plan asked), on real processes."""

import subprocess
import sys

import pytest
from conftest import write_hf_checkpoint
from memory_cgroup import MemoryCgroup
from server_harness import free_port_block, write_server_models

from shared.byte_tokenizer import write_byte_tokenizer


def serve(*args: str, preexec_fn=None, timeout: float = 240) -> subprocess.CompletedProcess:
    base = free_port_block(8)
    command = [sys.executable, "-m", "gateway.launcher", "--port", str(base), "--zmq-base-port", str(base + 1),
               "--metrics-base-port", str(base + 4), "--tp-master-port", str(base + 6), "--feature-pair-port",
               str(base + 7), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn)


def test_a_verify_worker_its_plan_refuses_is_named_with_its_status_and_log(tmp_path):
    target, _ = write_server_models(tmp_path)
    done = serve("--target", str(target), "--no-draft", "--cpu-memory-gb", "0.6")  # a 0.31 GiB share
    assert done.returncode == 2, done.stderr
    assert "dflash-serve: error: the verify role exited with status 2 before it was ready" in done.stderr
    message = done.stderr.split("dflash-serve: error: ", 1)[1]
    assert "its memory plan asked for" in message and "of the 0.31 GiB it was given" in message, message
    log = message.split("its last log lines:\n", 1)[1]
    assert "the model does not fit" in log and "while loading" in log, log
    assert "Traceback" not in done.stderr


def test_a_role_the_oom_killer_ends_is_named_with_the_kill_and_the_memory_asked(tmp_path):
    """A 1 GiB cgroup and --cpu-memory-gb claiming 24 GB: the plan admits a target of 0.9 GB of float32 weights,
    which the loader's packed copies take past 1 GiB, and the kernel kills the worker as it loads them (the KV pool
    is taken from the system as pages are used, so an empty one kills nothing)."""
    group = MemoryCgroup.make(2**30)
    if group is None:
        pytest.skip("this host lets the test make no memory cgroup (needs root and a writable hierarchy)")
    try:
        target = tmp_path / "wide"
        write_hf_checkpoint(target, "qwen3", seed=1, std=0.02, vocab_size=258, num_hidden_layers=2,
                            intermediate_size=600_000)
        write_byte_tokenizer(target)
        done = serve("--target", str(target), "--no-draft", "--cpu-memory-gb", "24", preexec_fn=group.enter)
    finally:
        group.remove()
    assert done.returncode == 2, done.stderr
    message = done.stderr.split("dflash-serve: error: ", 1)[1]
    assert message.startswith("the verify role was killed by SIGKILL from the kernel's OOM killer"), message
    assert "GiB resident" in message and "its memory plan asked for" in message, message
    asked = float(message.split("its memory plan asked for ")[1].split()[0])
    assert asked > 1.0, message  # more than the cgroup holds: --cpu-memory-gb claimed more than there was
