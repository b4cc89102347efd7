"""The projections an adapter can wrap, by Hugging Face's names (PEFT's target_modules), in
the order of a decoder layer; Qwen3.5's Gated DeltaNet projections on its linear layers and
Mistral 4's latent attention projections.
Free of JAX: the stage configs (components/core/config.py) check their lora_targets with it.
"""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DELTA_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# Latent attention's (Mistral 4), in place of q/k/v_proj (q_proj stays without a query latent).
LATENT_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
ADAPTER_TARGETS = LORA_TARGETS + DELTA_TARGETS + LATENT_TARGETS
