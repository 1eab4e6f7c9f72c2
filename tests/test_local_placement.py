"""dflash-serve --draft-placement local: the drafter inside the verify worker, no draft worker process."""

import subprocess
import sys

import httpx
import pytest
from server_harness import metric_value, serving, write_server_models


@pytest.fixture(scope="module")
def local_server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("local"), "--draft-placement", "local")


def _tokens(server, **body) -> dict:
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0,
            "return_token_ids": True, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_local_drafter_speculates_and_serves_the_plain_tokens(local_server):
    spec = _tokens(local_server)
    plain = _tokens(local_server, num_speculative_tokens=0)
    local_server.assert_same_or_near_tie("def add(a, b):", spec["choices"][0]["token_ids"],
                                         plain["choices"][0]["token_ids"])
    assert spec["usage"]["speculative"]["draft_tokens"] > 0 and plain["usage"]["speculative"]["draft_tokens"] == 0
    verify = local_server.metrics("verify")
    assert metric_value(verify, "dflash_drafter_available", {"kind": "dflash"}) == 1
    with pytest.raises(httpx.HTTPError):  # no draft worker: nothing serves its metrics port
        httpx.get(f"http://127.0.0.1:{local_server.metrics_base + 1}/metrics", timeout=2)


def test_local_placement_with_tensor_parallelism_is_a_one_line_error(tmp_path):
    target, draft = write_server_models(tmp_path)
    run = subprocess.run([sys.executable, "-m", "gateway.launcher", "--target", str(target), "--draft", str(draft),
                          "--tp", "2", "--draft-placement", "local"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip() == ("dflash-serve: error: --draft-placement local needs --tp 1 "
                                  "(the drafter needs the whole lm_head)")
