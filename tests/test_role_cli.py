"""The role commands and dflash-serve fail clearly (exit 2, a message, no traceback) on bad settings."""

import subprocess
import sys

import pytest
from server_harness import write_server_models


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_server_models(tmp_path_factory.mktemp("role_cli"))


def run(module, *args):
    proc = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize(
    "module,args,message",
    [
        ("gateway.launcher", ["--tp", "0"], "--tp must be >= 1"),
        ("verify_worker.server", ["--target", "t", "--world-size", "2", "--rank", "5", "--metrics-port", "0"],
         "rank 5 is outside a world of size 2"),
        ("gateway.launcher", ["--target", "/no/such/folder"], "does not exist"),
        ("gateway.launcher", ["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        ("verify_worker.server", ["--metrics-port", "0"], "--target is required"),
        ("draft_worker.server", ["--metrics-port", "0"], "--target and --draft are required"),
        ("verify_worker.server", ["--target", "t", "--metrics-port", "0", "--cuda-graphs"],
         "--cuda-graphs needs a CUDA device (--device cuda), not 'cpu'"),
        ("verify_worker.server", ["--target", "t", "--metrics-port", "0", "--batch-invariant"],
         "--batch-invariant is for a CUDA device (--device cuda), not 'cpu'"),
        ("gateway.launcher", ["--batch-invariant"], "--batch-invariant needs --device cuda and --tp 1"),
        ("verify_worker.generate_cli", ["--batch-invariant", "--prompt-ids", "1,2"],
         "--batch-invariant is for a CUDA device (--device cuda), not 'cpu'"),
    ],
)
def test_bad_settings(module, args, message):
    code, err = run(module, *args)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_kv_cache_budget_too_small_for_one_request(models):
    target, draft = models
    code, err = run("verify_worker.server", "--target", target, "--draft", draft, "--metrics-port", 0,
                    "--kv-cache-budget-mb", 0.01, "--requests-addr", "tcp://127.0.0.1:0",
                    "--events-addr", "tcp://127.0.0.1:0")
    assert code == 2 and "holds no request of 512 tokens" in err, err
