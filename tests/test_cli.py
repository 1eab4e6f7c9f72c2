"""dflash-generate: the --json contract, and clear errors (non-zero exit, no traceback) on bad input."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import tiny_draft_config, write_hf_checkpoint
from safetensors.torch import load_file, save_file

from draft_worker.draft_checkpoint import random_drafter, save_drafter
from shared.byte_tokenizer import write_byte_tokenizer
from shared.cpu_kernels.library import cpu_kernels
from verify_worker.generate_cli import main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    write_hf_checkpoint(root / "target", "qwen3", vocab_size=258)
    write_byte_tokenizer(root / "target")
    save_drafter(random_drafter(tiny_draft_config(vocab=258, block_size=4), seed=1, std=0.2), root / "draft")
    return root


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """dflash-generate sets PyTorch's threads for its process; these tests run it in the test process."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_cli(capsys, *argv):
    code = main(list(map(str, argv)))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_contract_and_spec_equals_plain(checkpoints, capsys):
    t, d = checkpoints / "target", checkpoints / "draft"
    code, out, _ = run_cli(capsys, "--target", t, "--draft", d, "--prompt", "def f(x):", "--max-tokens", 20, "--json")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert len(report["token_ids"]) == 20 and isinstance(report["text"], str)
    assert set(report["stats"]) == {"verify_steps", "draft_tokens", "accepted_tokens", "acceptance_length",
                                    "tokens_per_second"}
    assert report["stats"]["draft_tokens"] > 0
    code, out, _ = run_cli(capsys, "--target", t, "--prompt", "def f(x):", "--max-tokens", 20, "--json", "--no-spec")
    plain = json.loads(out.strip().splitlines()[-1])
    assert plain["token_ids"] == report["token_ids"] and plain["stats"]["draft_tokens"] == 0
    assert "logprobs" not in report
    runs = [json.loads(run_cli(capsys, "--target", t, *extra, "--prompt", "def f(x):", "--max-tokens", 20, "--json",
                               "--logprobs", 2)[1].strip().splitlines()[-1]) for extra in (["--draft", d], ["--no-spec"])]
    for run in runs:
        assert run["token_ids"] == report["token_ids"] and len(run["logprobs"]) == 20
        assert all(len(t["top"]) == 2 and t["top"][0] == [token, pytest.approx(t["logprob"])]
                   for token, t in zip(run["token_ids"], run["logprobs"]))  # greedy: the chosen token is the best
    assert [t["logprob"] for t in runs[0]["logprobs"]] == pytest.approx([t["logprob"] for t in runs[1]["logprobs"]],
                                                                         abs=1e-5)


def test_pytorch_threads_default_to_one_beside_the_cpu_kernels(checkpoints, capsys):
    """Idle PyTorch threads spinning beside the kernels' own pool slowed dflash-generate's speculative decoding
    by a quarter (the demo pair: 711 against 927 tok/s); --threads still sets them."""
    torch.set_num_threads(2)
    assert run_cli(capsys, "--target", checkpoints / "target", "--prompt-ids", "1,2", "--max-tokens", 2)[0] == 0
    assert torch.get_num_threads() == (1 if cpu_kernels() is not None else 2)
    assert run_cli(capsys, "--target", checkpoints / "target", "--prompt-ids", "1,2", "--max-tokens", 2,
                   "--threads", 2)[0] == 0
    assert torch.get_num_threads() == 2


def test_prompt_ids_without_tokenizer(checkpoints, tmp_path, capsys):
    shutil.copytree(checkpoints / "target", tmp_path / "t")
    (tmp_path / "t" / "tokenizer.json").unlink()
    code, out, _ = run_cli(capsys, "--target", tmp_path / "t", "--prompt-ids", "1,2,3", "--max-tokens", 5, "--json")
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and "text" not in report and len(report["token_ids"]) == 5
    code, _, err = run_cli(capsys, "--target", tmp_path / "t", "--prompt", "hello")
    assert code == 2 and "no tokenizer.json" in err


def test_seeded_sampling_is_reproducible(checkpoints, capsys):
    args = ["--target", checkpoints / "target", "--draft", checkpoints / "draft", "--prompt-ids", "5,6",
            "--max-tokens", 12, "--temperature", 1.0, "--top-p", 0.9, "--seed", 7, "--json"]
    first = json.loads(run_cli(capsys, *args)[1].strip().splitlines()[-1])
    second = json.loads(run_cli(capsys, *args)[1].strip().splitlines()[-1])
    assert first["token_ids"] == second["token_ids"]


def corrupt(src, dst, edit):
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def edit_config(**changes):
    def apply(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return apply


def edit_tensors(change):
    def apply(folder):
        path = next(folder.glob("*.safetensors"))
        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path))
    return apply


def drop(name):
    return edit_tensors(lambda t: t.pop(name))


def reshape(name):
    return edit_tensors(lambda t: t.__setitem__(name, t[name][:-1]))


def add_extra(t):
    t["model.layers.99.mystery.weight"] = t["model.norm.weight"].clone()


CASES = {
    "missing folder": ("target", lambda f: shutil.rmtree(f), "does not exist"),
    "missing config": ("target", lambda f: (f / "config.json").unlink(), "config.json"),
    "bad json": ("target", lambda f: (f / "config.json").write_text("{oops"), "not valid JSON"),
    "no weights": ("target", lambda f: next(f.glob("*.safetensors")).unlink(), "no *.safetensors"),
    "missing tensor": ("target", drop("model.layers.1.mlp.up_proj.weight"), "missing tensor(s): model.layers.1.mlp.up_proj.weight"),
    "unexpected tensor": ("target", edit_tensors(add_extra), "unexpected tensor(s): model.layers.99.mystery.weight"),
    "wrong shape": ("target", reshape("model.layers.0.self_attn.q_proj.weight"), "model.layers.0.self_attn.q_proj.weight' in"),
    "unknown target arch": ("target", edit_config(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "unknown target architecture"),
    "drafter wrong shape": ("draft", reshape("fc.weight"), "tensor 'fc.weight'"),
    "drafter hidden mismatch": ("draft", edit_config(hidden_size=32), "shape"),
    "unknown drafter arch": ("draft", edit_config(architectures=["EagleDraftModel"]), "unknown drafter architecture"),
    "drafter block size 1": ("draft", edit_config(block_size=1, dflash_config={"mask_token_id": 5, "target_layer_ids": [1, 2], "block_size": 1}), "block_size must be >= 2"),
    "mask token outside vocab": ("draft", edit_config(dflash_config={"mask_token_id": 300, "target_layer_ids": [1, 2]}), "mask_token_id 300 is outside"),
    "drafter for another target": ("draft", edit_config(num_target_layers=12), "built for a target of 12 layers"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoints_give_clear_errors(checkpoints, tmp_path, capsys, case):
    which, edit, message = CASES[case]
    target, draft = checkpoints / "target", checkpoints / "draft"
    broken = corrupt(checkpoints / which, tmp_path / which, edit)
    args = ["--target", broken if which == "target" else target, "--draft", broken if which == "draft" else draft,
            "--prompt-ids", "1,2", "--max-tokens", 3]
    code, _, err = run_cli(capsys, *args)
    assert code == 2
    assert "dflash-generate: error:" in err and message in err, err


def test_hidden_size_mismatch_between_target_and_drafter(checkpoints, tmp_path, capsys):
    cfg = tiny_draft_config(vocab=258, hidden=32, head_dim=8, intermediate_size=64)
    save_drafter(random_drafter(cfg), tmp_path / "d32")
    code, _, err = run_cli(capsys, "--target", checkpoints / "target", "--draft", tmp_path / "d32", "--prompt-ids", "1")
    assert code == 2 and "does not match the drafter's hidden_size 32" in err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--block-size", "1"], "--block-size must be >= 2"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--prompt-ids", "1,999"], "prompt token id 999 is outside the vocabulary"),
        (["--prompt-ids", ""], "the prompt is empty"),
        (["--max-tokens", "100000"], "exceeds this model's context"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--logprobs", "21"], "logprobs must be an integer from 0 to 20"),
    ],
)
def test_bad_flags_give_clear_errors(checkpoints, capsys, flags, message):
    args = ["--target", checkpoints / "target", "--draft", checkpoints / "draft"]
    if "--prompt-ids" not in flags:
        args += ["--prompt-ids", "1,2"]
    code, _, err = run_cli(capsys, *args, *flags)
    assert code == 2 and message in err, err


def test_console_script_exits_non_zero_without_traceback(tmp_path):
    """The real entry point, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "verify_worker.generate_cli", "--target", str(tmp_path / "none"),
                           "--prompt-ids", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr
