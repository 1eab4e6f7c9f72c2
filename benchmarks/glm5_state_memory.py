"""State memory per request of a GLM-5.3-Flash target (the published config), ours against vLLM's layout.

Ours: per KDA layer two float32 states (committed and tip) and two conv windows, whatever the block size, and the
kept recurrence inputs of one block's pending tokens (k, v, exp(g), g, beta in float32, the raw conv input in the
compute dtype; state.py), allocated with the state; per MLA layer
the latent per position, per indexing layer the indexer key and gate per position. vLLM (1 + K snapshots):
per KDA layer 1 + K recurrent states and a conv window of kernel - 1 + K inputs per request.

    python benchmarks/glm5_state_memory.py [--block-size 8] [--context 32768]
"""

import argparse

import torch

from verify_worker.families.glm5_next.config import Glm5NextConfig
from verify_worker.families.glm5_next.model import Glm5NextModel

PUBLISHED = {  # text_config of GLM-5.3-Flash (../shared/docs/glm-targets.md section 0)
    "vocab_size": 154880, "hidden_size": 4096, "num_hidden_layers": 45, "num_attention_heads": 64,
    "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 256,
    "qk_rope_head_dim": 0, "v_head_dim": 256, "n_routed_experts": 288, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "moe_intermediate_size": 2048, "intermediate_size": 12288, "first_k_dense_replace": 3,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "index_topk": 2048, "index_head_dim": 128,
    "index_n_heads": 32, "index_kpool": 4, "index_kpool_always_select_tail": True, "swiglu_limit": 10.0,
    "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    "max_position_embeddings": 1048576, "dtype": "bfloat16",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    cfg = Glm5NextConfig.from_dict({"architectures": ["Glm5NextForConditionalGeneration"], "text_config": PUBLISHED})
    with torch.device("meta"):
        model = Glm5NextModel(cfg).to(torch.bfloat16)
    k, mib = args.block_size - 1, 2**20
    kda = cfg.layer_types.count("linear")
    state = 4 * cfg.linear_num_heads * cfg.linear_head_dim**2  # one float32 recurrent state
    window = 2 * 3 * cfg.linear_dim  # one conv input (bf16)
    block = args.block_size
    ours_fixed = model.state_bytes_per_slot(args.context, block) - model.state_bytes_per_slot(0, block)
    pending = model.state_bytes_per_slot(0, block) - model.state_bytes_per_slot(0, 0)  # the kept inputs
    ours_kda = model.state_bytes_per_slot(0, 0)
    vllm_kda = kda * ((1 + k) * state + (cfg.conv_kernel - 1 + k) * window)
    print(f"GLM-5.3-Flash, {kda} KDA layers, block {args.block_size} (K = {k}), context {args.context}")
    print(f"  positional caches (latent + indexer), both engines: {ours_fixed / mib:9.1f} MiB")
    print(f"  ours: KDA states, 2 per layer:                      {ours_kda / mib:9.1f} MiB")
    print(f"        + kept inputs of one block's tokens:          {pending / mib:9.1f} MiB")
    print(f"  vLLM: KDA states, 1 + K per layer:                  {vllm_kda / mib:9.1f} MiB")
    print(f"  KDA state per request, ours / vLLM: {(ours_kda + pending) / vllm_kda:.2f}")


if __name__ == "__main__":
    main()
