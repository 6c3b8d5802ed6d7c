"""The published configs (text part) of the models the benchmarks and the planner
know by name; only what the engine reads. No torch: `duckctl plan` reads these."""
from __future__ import annotations

# config.json of each model (text part), as published; only what the engine reads
SHAPES: dict[str, dict] = {
    "deepseek-v32": {
        "model_type": "deepseek_v32", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128, "num_nextn_predict_layers": 1,
        "bos_token_id": 0, "eos_token_id": 1,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "eos_token_id": 151645,
    },
    "qwen3.5-35b-a3b": {
        "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
            "full_attention_interval": 4, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
            "tie_word_embeddings": False, "eos_token_id": 248046,
        },
    },
}

# DeepSeek-V3 (and R1): V3.2's widths without its lightning indexer (dense MLA at any length)
SHAPES["deepseek-v3"] = {k: v for k, v in SHAPES["deepseek-v32"].items() if not k.startswith("index_")}
SHAPES["deepseek-v3"]["model_type"] = "deepseek_v3"

# Qwen3-235B-A22B: the Qwen3-MoE family at its published widths (the planner's, e.g. docs/plan.md)
SHAPES["qwen3-235b-a22b"] = {**SHAPES["qwen3-30b-a3b"], "hidden_size": 4096, "intermediate_size": 12288,
                             "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64}
