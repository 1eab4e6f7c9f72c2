"""The demo pair's twin (demo_build.twin) computes the demo's function at a wider, deeper published-style shape:
the same logits up to rounding, padded vocabulary rows far below, the same greedy output and acceptance."""

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from client.bench import first_divergence
from demo_build.twin import TwinError, main, write_twin
from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import LocalProposer
from shared.demo_models import DEMO_DIR
from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine
from verify_worker.target_loader import load_target

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts_heldout.json"
# a small published-style shape: wider hidden, 4 query heads a key head (the demo has 2), heads of 128 (the demo's
# are 64), more layers and vocabulary rows
SHAPE = {"hidden_size": 512, "intermediate_size": 1280, "num_hidden_layers": 11, "num_attention_heads": 12,
         "num_key_value_heads": 3, "head_dim": 128, "vocab_size": 6000}


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    out = tmp_path_factory.mktemp("twin")
    write_twin(DEMO_DIR, SHAPE, out, taps=5, draft_layers=2)
    return out


def prefill_logits(target, ids: list[int]) -> torch.Tensor:
    cache = target.new_cache(1, len(ids))
    out = target(torch.tensor([ids]), torch.arange(len(ids))[None], cache, torch.tensor([0]))
    return target.logits(out.hidden[0])  # [len(ids), vocab]


def prompt_ids(count: int) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "target" / "tokenizer.json"))
    return [tokenizer.encode(p["prompt"]).ids for p in json.loads(PROMPTS.read_text())[:count]]


def test_the_twin_has_the_published_shape_and_the_demos_logits(twin):
    config = json.loads((twin / "target" / "config.json").read_text())
    assert {k: config[k] for k in SHAPE} == SHAPE
    demo, wide = load_target(DEMO_DIR / "target"), load_target(twin / "target")
    ids = prompt_ids(1)[0][:96]
    want, got = prefill_logits(demo, ids), prefill_logits(wide, ids)  # [96, 4096], [96, 6000]
    vocab = want.shape[1]
    assert (got[:, :vocab] - want).abs().max() < 2e-3 * want.abs().max()
    assert (got[:, :vocab].argmax(-1) == want.argmax(-1)).all()
    assert (got[:, vocab:].max(-1).values < want.max(-1).values - 100).all()  # padded rows never win or get sampled


def test_the_twin_drafters_tap_the_demos_layers_where_they_went(twin):
    for name in ("draft", "draft2"):
        demo, wide = load_drafter(DEMO_DIR / name), load_drafter(twin / name)
        assert wide.config.num_layers == 2 and wide.config.num_taps == 5 and wide.config.num_target_layers == 11
        assert wide.config.hidden_size == SHAPE["hidden_size"] and wide.config.kind == demo.config.kind
        # the demo's taps [1, 3, 5] of 8 layers sit at the twin's layers 1, 4 and 7 (of 0..10, spread evenly)
        assert set(wide.config.target_layer_ids) >= {1, 4, 7}


@pytest.mark.parametrize("drafter_name", ["draft", "draft2"])
def test_the_twin_speculates_as_the_demo_does(twin, drafter_name):
    prompts = [ids[:160] for ids in prompt_ids(3)]
    requests = [GenerationRequest(tuple(ids), 40) for ids in prompts]
    results = {}
    for name, folder in (("demo", DEMO_DIR), ("twin", twin)):
        target, drafter = load_target(folder / "target"), load_drafter(folder / drafter_name)
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8,
                                 max_requests=3, max_model_len=1024)
        spec = SpeculativeEngine(target, proposer, max_requests=3, max_model_len=1024).generate(requests)
        plain = SpeculativeEngine(target, None, max_requests=3, max_model_len=1024).generate(requests)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]  # lossless on the twin too
        results[name] = spec
    for request, demo, wide in zip(requests, results["demo"], results["twin"]):
        first = first_divergence(wide.token_ids, demo.token_ids)
        assert first is None, f"the twin leaves the demo's greedy output at token {first}"
    steps = {name: sum(r.stats.verify_steps for r in out) for name, out in results.items()}
    assert abs(steps["twin"] - steps["demo"]) <= 0.1 * steps["demo"]  # the demo's acceptance, up to rounding


def test_a_shape_too_small_is_refused_with_its_name(tmp_path, capsys):
    with pytest.raises(TwinError, match="num_key_value_heads 1 is below 2"):
        write_twin(DEMO_DIR, dict(SHAPE, num_key_value_heads=1, num_attention_heads=12), tmp_path, 5, 2)
    config = tmp_path / "small.json"
    config.write_text(json.dumps(dict(SHAPE, hidden_size=256)))
    assert main(["--config", str(config), "--out", str(tmp_path / "out")]) == 2
    assert "hidden_size 256 is below 257" in capsys.readouterr().err
