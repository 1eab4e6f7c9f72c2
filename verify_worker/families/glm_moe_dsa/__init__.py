"""GLM-5.2 (glm_moe_dsa): MLA + DSA sparse attention + MoE, bf16 and FP8 block-quantized checkpoints."""
