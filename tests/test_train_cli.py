"""dflash-train-drafter end to end on a tiny target: regenerates data, trains, writes the published layout,
resumes, and reports per-position validation accuracy."""

import json

import torch
from conftest import write_hf_checkpoint

from draft_worker.draft_checkpoint import load_drafter
from shared.byte_tokenizer import write_byte_tokenizer
from training.cli import main


def test_train_drafter_cli(tmp_path, capsys):
    target = tmp_path / "target"
    write_hf_checkpoint(target, "qwen3", seed=3, vocab_size=258, max_position_embeddings=256)
    write_byte_tokenizer(target)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"f{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j}\n\n" for j in range(60)))
    out = tmp_path / "drafter"
    args = ["--target", str(target), "--corpus", str(corpus), "--out", str(out), "--steps", "4", "--prompts", "12",
            "--prompt-len", "8:16", "--new-tokens", "24", "--anchors", "8", "--block-size", "8",
            "--target-layer-ids", "1,2", "--val-fraction", "0.25", "--checkpoint-minutes", "100"]
    assert main(args) == 0
    log = capsys.readouterr().out
    assert "regenerated 12 sequences" in log and "accuracy by position" in log
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == [1, 2]
    assert config["dflash_config"]["mask_token_id"] == 257
    first = load_drafter(out)
    assert main(args[:-2] + ["--steps", "6", "--checkpoint-minutes", "100"]) == 0  # resumes at step 4
    assert "resumed at step 4" in capsys.readouterr().out
    second = load_drafter(out)
    assert any((a != b).any() for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    # DFlash 2 from that drafter, training only the convolutions and the selector
    out2 = tmp_path / "drafter2"
    extra = ["--kind", "dflash2", "--from-drafter", str(out), "--train-only-additions", "--selector-rank", "8",
             "--selector-top-k", "4", "--selector-soft-weight", "0.7", "--selector-sample-top-k", "64", "--steps", "3"]
    assert main([*args[:5], str(out2), *args[6:], *extra]) == 0
    config = json.loads((out2 / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 4
    assert config["dflash_config"]["selector_sample_top_k"] == 64 and load_drafter(out2).sample_top_k == 64
    third = load_drafter(out2).state_dict()
    for name, tensor in second.state_dict().items():
        assert torch.equal(third[name], tensor), name  # the backbone stayed frozen


def test_train_drafter_cli_on_a_bfloat16_checkpoint(tmp_path, capsys):
    """A bf16 target (as published checkpoints are) trains in float32 whatever the serving default."""
    target = tmp_path / "target"
    write_hf_checkpoint(target, "qwen3", seed=3, vocab_size=258, max_position_embeddings=256, dtype=torch.bfloat16)
    write_byte_tokenizer(target)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("".join(f"def g{j}(x):\n    return x + {j}\n\n" for j in range(80)))
    args = ["--target", str(target), "--corpus", str(corpus), "--out", str(tmp_path / "drafter"), "--steps", "2",
            "--prompts", "6", "--prompt-len", "8:16", "--new-tokens", "16", "--anchors", "4", "--block-size", "4",
            "--target-layer-ids", "1,2", "--val-fraction", "0.34"]
    assert main(args) == 0
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def test_train_drafter_cli_errors(tmp_path, capsys):
    target = tmp_path / "target"
    write_hf_checkpoint(target, "qwen3", seed=3, vocab_size=258)
    code = main(["--target", str(target), "--corpus", str(tmp_path), "--out", str(tmp_path / "o")])
    assert code == 2 and "tokenizer.json" in capsys.readouterr().err
    write_byte_tokenizer(target)
    code = main(["--target", str(target), "--corpus", str(tmp_path / "none"), "--out", str(tmp_path / "o")])
    assert code == 2 and "neither a folder nor a .jsonl" in capsys.readouterr().err
    code = main(["--target", str(target), "--corpus", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--mask-token", "<nope>"])
    assert code == 2 and "not in the target's vocabulary" in capsys.readouterr().err
    code = main(["--target", str(target), "--corpus", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--selector-soft-weight", "1.5"])
    assert code == 2 and "--selector-soft-weight must be between 0 and 1" in capsys.readouterr().err
