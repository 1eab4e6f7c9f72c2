"""dflash-bench against a real dflash-serve: one run, speculative and plain waves, two servers side by side
(here the same server under two labels), per-position acceptance and step phases from the verify metrics."""

import json

import pytest

from gateway.bench import main as bench_main
from server_harness import Server, write_server_models


def test_bench_reports_speedup_acceptance_and_phases(tmp_path):
    target, draft = write_server_models(tmp_path)
    server = Server(target, draft, log_dir=tmp_path)
    try:
        server.wait_ready()
        prompts = tmp_path / "prompts.json"
        prompts.write_text(json.dumps([{"prompt": "def f(x):"}, {"prompt": "while True:"}]))
        metrics = f"http://127.0.0.1:{server.metrics_base}/metrics"
        code = bench_main(["--url", f"{server.url},{server.url}", "--metrics-url", f"{metrics},{metrics}",
                           "--labels", "a,b", "--prompts", str(prompts), "--num-prompts", "2", "--block-sizes", "4",
                           "--concurrency", "1", "--max-tokens", "24", "--rounds", "1", "--out", str(tmp_path / "out")])
        assert code == 0
        report = json.loads((tmp_path / "out" / "bench.json").read_text())
        assert set(report["by_server"]) == {"a", "b"} and report["greedy_mismatches"] == 0
        result = report["by_server"]["b"]["4"]["by_concurrency"]["1"]
        assert result["speculative"]["acceptance_length"] >= 1.0 and len(result["per_position_acceptance"]) == 3
        assert result["plain"]["tokens_per_second_aggregate"] > 0 and result["speedup_aggregate"] > 0
        assert result["speculative_step_ms_by_phase"]["draft"] > 0  # the drafter really ran
        assert report["by_block_size"] == report["by_server"]["a"]
        # 4 tokens: the first step may draft only 2 of block 4's 3 (one token is the prompt's): not a cap.
        assert bench_main(["--url", server.url, "--metrics-url", metrics, "--prompts", str(prompts), "--num-prompts",
                           "1", "--block-sizes", "4", "--concurrency", "1", "--max-tokens", "4", "--rounds", "1",
                           "--out", str(tmp_path / "out4")]) == 0
        # The server drafts at most 3 tokens (block 4): block 8 would be mislabelled, so the bench refuses.
        with pytest.raises(SystemExit, match="drafted at most 3 tokens per step.*--block-size 8"):
            bench_main(["--url", server.url, "--metrics-url", metrics, "--prompts", str(prompts), "--num-prompts",
                        "1", "--block-sizes", "8", "--concurrency", "1", "--max-tokens", "24", "--rounds", "1",
                        "--out", str(tmp_path / "out8")])
    finally:
        server.stop()
