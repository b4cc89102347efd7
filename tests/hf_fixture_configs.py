"""The tiny config of each family that tests/make_hf_fixtures.py saves: small enough for CI,
and still exercising every feature alignpipe maps (needs transformers)."""

from __future__ import annotations

import transformers


def _with_vision(outer, text, vision, ids: dict, tied: bool) -> transformers.PretrainedConfig:
    """A Qwen multimodal config: ``text`` behind ``vision``, the image and video ids the eos
    (no image is ever given), the head tied as ``tied`` says."""
    specials = ("image", "video", "vision_start", "vision_end")
    return outer(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        tie_word_embeddings=tied,
        **{f"{name}_token_id": ids["eos_token_id"] for name in specials},
    )


def hf_config(family: str, vocab: int, ids: dict) -> transformers.PretrainedConfig:
    """A tiny config of the family that still exercises every feature alignpipe maps."""
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **ids,
    )
    if family == "llama":
        rope = dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,  # small, so the scaling bends real frequencies
        )
        return transformers.LlamaConfig(
            **common, rope_parameters=rope, tie_word_embeddings=False, rms_norm_eps=1e-5
        )
    if family == "qwen2":
        return transformers.Qwen2Config(
            **common,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
        )
    if family == "mixtral":  # Mixtral 8x7B's layers: 8 experts, 2 a token, renormalised
        return transformers.MixtralConfig(
            **{**common, "intermediate_size": 24},  # the experts' width (no other MLP)
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,  # as Mixtral's released configs
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
        )
    if family == "qwen2_moe":  # Qwen1.5-MoE-A2.7B's layers: a gated shared expert, top k as is
        return transformers.Qwen2MoeConfig(
            **common,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,  # as Qwen2 MoE's releases: the top k not renormalised
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        )
    if family == "qwen3_moe":  # Qwen3-30B-A3B's layers: 128 experts, 8 a token, renormalised
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,  # != intermediate_size, which only dense layers use
            norm_topk_prob=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        )
    if family in ("qwen3", "qwen3_untied"):
        return transformers.Qwen3Config(
            **common,
            head_dim=16,  # != hidden / heads, as Qwen3's (128 at hidden 1024, 16 heads)
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            tie_word_embeddings=family == "qwen3",
            rms_norm_eps=1e-6,
        )
    if family == "mistral":
        return transformers.MistralConfig(
            **common,
            head_dim=16,  # != hidden / heads, as Mistral Small 3's
            sliding_window=4,  # < SEQ_LEN: the window really masks (Mistral 7B v0.1's 4096)
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
        )
    if family.startswith("ministral3"):
        # Yarn over a 256-token original context (its ramp spans head dims 0-4 of 8) and the
        # query temperature past it, as Ministral 3's over 16384; compared at 512 tokens.
        text = transformers.Ministral3Config(
            **{**common, "max_position_embeddings": 1024},
            head_dim=16,
            sliding_window=None,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=1e4, factor=16.0,
                original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0,
                mscale=1.0, mscale_all_dim=0.5,  # unequal: a real attention_factor (1.12)
                llama_4_scaling_beta=0.1,
            ),
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
        )  # fmt: skip
        if family == "ministral3":
            return text
        vision = transformers.PixtralVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            head_dim=8, image_size=28, patch_size=14,
        )  # fmt: skip
        return transformers.Mistral3Config(
            text_config=text,
            vision_config=vision,
            image_token_index=ids["eos_token_id"],  # any id in the tiny vocabulary
            spatial_merge_size=2,
            tie_word_embeddings=False,  # Mistral3Config's default is true: stated, as saved
        )
    if family == "mistral4_mm":
        # Mistral Small 4's layers: latent attention (query and key-value latents, the rotary
        # part in interleaved pairs), experts with a shared one, yarn with mscale_all_dim
        # (which scales the softmax too) and the query temperature past a 256-token context.
        text = transformers.Mistral4Config(
            **{**common, "max_position_embeddings": 1024, "num_key_value_heads": 4},
            q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, moe_intermediate_size=12, n_routed_experts=6,
            num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.5,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=1e4, factor=16.0,
                original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0,
                mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1,
            ),
            tie_word_embeddings=False,
        )  # fmt: skip
        vision = transformers.PixtralVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            head_dim=8, image_size=28, patch_size=14,
        )  # fmt: skip
        return transformers.Mistral3Config(
            text_config=text, vision_config=vision, image_token_index=ids["eos_token_id"],
            spatial_merge_size=2, tie_word_embeddings=False,
        )  # fmt: skip
    if family.startswith("qwen3_5"):
        moe = family.startswith("qwen3_5_moe")
        text_class = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
        # Qwen3.5-35B-A3B's layers: experts (256, 8 a token) and a gated shared expert.
        experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40) if moe else {}  # fmt: skip
        text = text_class(
            **{**common, "num_hidden_layers": 8, "max_position_embeddings": 1024},
            **experts,
            head_dim=16,
            # Two periods of three Gated DeltaNet layers and a gated attention layer.
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,  # two value heads per key head, as the 9B's 16 and 32
            linear_key_head_dim=8,
            linear_value_head_dim=12,  # != the key width, so the two are not confused
            linear_conv_kernel_dim=4,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=1e7,
                partial_rotary_factor=0.25,
                mrope_section=[1, 1, 0],
                mrope_interleaved=True,
            ),
            tie_word_embeddings=family == "qwen3_5",
            rms_norm_eps=1e-6,
        )
        if family == "qwen3_5":
            return text
        vision = transformers.models.qwen3_5.Qwen3_5VisionConfig(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
            patch_size=14, num_position_embeddings=16,
        )  # fmt: skip
        outer = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
        return _with_vision(outer, text, vision, ids, tied=False)
    if family.startswith("qwen3_vl"):  # Qwen3-VL-2B's layout: a Qwen3 behind a vision tower
        experts = family == "qwen3_vl_moe"  # 30B-A3B's: 128 experts, 8 a token, stored [E, D, 2F]
        text_class = (
            transformers.Qwen3VLMoeTextConfig if experts else transformers.Qwen3VLTextConfig
        )
        text = text_class(
            **common,
            **(
                dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
                if experts
                else {}
            ),
            head_dim=16,
            rope_parameters=dict(
                rope_type="default", rope_theta=5e6, mrope_section=[4, 2, 2], mrope_interleaved=True
            ),
            rms_norm_eps=1e-6,
        )
        vision_class = transformers.models.qwen3_vl.Qwen3VLVisionConfig
        vision = vision_class(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
            patch_size=14, num_position_embeddings=16, deepstack_visual_indexes=[0],
        )  # fmt: skip
        outer = transformers.Qwen3VLMoeConfig if experts else transformers.Qwen3VLConfig
        return _with_vision(outer, text, vision, ids, tied=not experts)  # the 2B ties; MoEs not
    if family == "qwen3_next":  # Qwen3-Next-80B-A3B's layers: Qwen3.5 MoE's, fused projections
        return transformers.Qwen3NextConfig(
            **{**common, "num_hidden_layers": 4, "max_position_embeddings": 1024},
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            head_dim=16,
            full_attention_interval=2,  # the 80B's 4, in a shorter stack
            linear_num_key_heads=2,
            linear_num_value_heads=4,  # two value heads per key head, as the 80B's 16 and 32
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            partial_rotary_factor=0.25,
            rope_parameters=dict(rope_type="default", rope_theta=1e7),
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        )
    if family == "gemma4_moe":  # 26B-A4B's layers: experts beside each MLP, no per-layer inputs
        return transformers.Gemma4TextConfig(
            **{**common, "num_hidden_layers": 6, "max_position_embeddings": 1024},
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=24,  # != intermediate_size: the dense MLP runs beside
            final_logit_softcapping=3.0,
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
                "full_attention": dict(
                    rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1e6
                ),
            },
            rms_norm_eps=1e-6,
        )
    if family.startswith("gemma4"):
        text = transformers.Gemma4TextConfig(
            **{**common, "num_hidden_layers": 9, "max_position_embeddings": 1024},
            head_dim=16,
            global_head_dim=32,  # full layers' heads twice as wide, as the released 256 / 512
            num_global_key_value_heads=1,  # != num_key_value_heads, read with attention_k_eq_v
            attention_k_eq_v=True,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 3,
            num_kv_shared_layers=3,  # the last period reuses the second period's keys/values
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=vocab,
            final_logit_softcapping=3.0,  # small, so tanh bends the fixture's logits
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
                "full_attention": dict(
                    rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1e6
                ),
            },
            rms_norm_eps=1e-6,
        )
        if family == "gemma4":
            return text
        vision = transformers.Gemma4VisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64,
        )  # fmt: skip
        return transformers.Gemma4Config(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            audio_config=None,
            # Rows past the tokenizer: Gemma4Model treats these ids as image tokens (zero
            # per-layer inputs, bidirectional spans), so no text token may be one.
            image_token_id=vocab - 1,
            boi_token_id=vocab - 2,
            eoi_token_id=vocab - 3,
        )
    if family.startswith("gemma3"):
        text = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4},
            head_dim=16,
            query_pre_attn_scalar=24,  # != head_dim, so the scale is really read
            sliding_window=4,  # < SEQ_LEN, so the local layers differ from global ones
            # Both layer types, not in Gemma 2's alternation: the pattern is really read.
            layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
            rope_parameters={  # a base per layer type; the global one linearly scaled (4B+)
                "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
            },
            rms_norm_eps=1e-6,
        )
        if family == "gemma3":
            return text
        vision = transformers.SiglipVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        return transformers.Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=ids["eos_token_id"],  # any id in the tiny vocabulary
            boi_token_index=ids["bos_token_id"],
            eoi_token_index=ids["bos_token_id"],
        )
    return transformers.Gemma2Config(
        **common,
        head_dim=16,  # != hidden / heads, as Gemma 2 9B's
        query_pre_attn_scalar=24,  # != head_dim, so the scale is really read
        sliding_window=4,  # < SEQ_LEN, so the windowed layer differs from a global one
        attn_logit_softcapping=2.0,  # small caps so tanh bends the fixture's logits
        final_logit_softcapping=3.0,
        rms_norm_eps=1e-6,
    )
