"""A random-weight HF checkpoint of a published shape, written by transformers (the bench extra), with a byte-level
tokenizer (its <|endoftext|> the end of text), so that `dflash-serve --target` runs a model of real size: what a step, the memory plan and the server
cost there. Its outputs are noise; its cost is the real model's.

    python benchmarks/random_checkpoint.py --config benchmarks/published_configs/qwen3-0.6b.json --out /tmp/q06 \
        [--max-position-embeddings 4096] [--seed 0]
"""

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> None:
    import sys

    sys.path.insert(0, str(ROOT))
    from shared.byte_tokenizer import END_OF_TEXT, write_byte_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a config.json of a Qwen3 or Llama model")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--max-position-embeddings", type=int, default=None,
                        help="the model's context (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import transformers

    settings = json.loads(Path(args.config).read_text())
    if args.max_position_embeddings:
        settings["max_position_embeddings"] = args.max_position_embeddings
    settings.pop("architectures", None)
    kind = settings.pop("model_type")
    config_cls, model_cls = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                             "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[kind]
    dtype = getattr(torch, settings.pop("torch_dtype", "bfloat16"))
    config = config_cls(**settings)
    torch.manual_seed(args.seed)
    with torch.device("cpu"):
        model = model_cls(config).to(dtype).eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_byte_tokenizer(out)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT}))  # its end: a grammar's too
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{out}: {kind}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, "
          f"{size / 1e9:.2f} GB {str(dtype).removeprefix('torch.')}")


if __name__ == "__main__":
    main()
