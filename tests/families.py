"""Tiny randomly initialised models of every architecture family ptq is tested on, built offline from their
transformers configs: dense families and mixture-of-experts families (fused experts); and the text and byte-level
BPE tokenizer they are run with (no environment settings here: the tests' conftest and the checks in benchmarks/
import this)."""

from __future__ import annotations

import torch

# A few lines of Hamlet: the tokenizer is trained on them and the tests evaluate on them
TEXT = (
    "Who's there? Nay, answer me: stand, and unfold yourself. Long live the king! "
    "You come most carefully upon your hour. 'Tis now struck twelve; get thee to bed. "
    "For this relief much thanks: 'tis bitter cold, and I am sick at heart. "
) * 20


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (config class name, config keyword arguments)
DENSE = {
    "llama": ("LlamaConfig", COMMON),
    "mistral": ("MistralConfig", COMMON),
    "qwen2": ("Qwen2Config", COMMON),
    "qwen3": ("Qwen3Config", COMMON | dict(head_dim=16)),
    "gemma2": ("Gemma2Config", COMMON | dict(head_dim=16)),
    "gemma3": ("Gemma3TextConfig", COMMON | dict(head_dim=16)),
    "phi3": ("Phi3Config", COMMON),
    "gpt2": ("GPT2Config", dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
        ),
    ),
    "opt": (
        "OPTConfig",
        dict(
            vocab_size=300,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
        ),
    ),
    "falcon": (
        "FalconConfig",
        dict(
            vocab_size=300,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
        ),
    ),
}
MOE_FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        COMMON | dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        COMMON | MOE | dict(num_experts=4, shared_expert_intermediate_size=48),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", COMMON | MOE | dict(num_experts=4, head_dim=16)),
    "olmoe": (
        "OlmoeConfig",
        COMMON | dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        COMMON
        | MOE
        | dict(
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            num_key_value_heads=4,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        COMMON
        | dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            head_dim=16,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=32,
        ),
    ),
    "phimoe": (
        "PhimoeConfig",
        COMMON | dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        COMMON
        | MOE
        | dict(
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            head_dim=16,
        ),
    ),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        COMMON
        | MOE
        | dict(moe_num_experts=4, moe_k=2, moe_layer_start_index=0, moe_num_shared_experts=0),
    ),
}
FAMILIES = DENSE | MOE_FAMILIES


# Not a supported family: a model whose attention computes softmax(QK^T)V in its own code, not through transformers'
# attention interface (Bloom's, in every transformers version ptq supports; Falcon's did before transformers 5.25),
# so that ptq cannot quantize its attention inputs or KV cache and must say so.
OWN_ATTENTION = {
    "bloom": ("BloomConfig", dict(vocab_size=300, hidden_size=64, n_layer=2, n_head=4)),
}


def build(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random model of `family` (transformers' own initialisation, seeded) in eval mode, float32.
    overrides: config values instead of the family's (wider layers, for schemes that need whole 128-wide blocks)."""
    import transformers

    config_class, kwargs = (FAMILIES | OWN_ATTENTION)[family]
    config = getattr(transformers, config_class)(
        **(kwargs | overrides), pad_token_id=None, bos_token_id=None, eos_token_id=None
    )
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval().requires_grad_(False)
