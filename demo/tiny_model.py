"""Tiny random-weight models (Llama-style, Gemma3 sliding-window, Qwen3-Next recurrent) and a
WordLevel tokenizer, written at run time for the vLLM demo and tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# What every tiny model shares: the tokenizer's vocabulary and special tokens, and the widths.
# Head dim 64 (256 / 4 heads): the CPU attention backend's smallest supported size.
SHAPE: dict[str, Any] = {
    "vocab_size": 1003,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "bos_token_id": 1001,
    "eos_token_id": 1002,
}


def _write(out: Path, model_class: Any, config: Any, seed: int = 0) -> Path:
    """The tokenizer, then the model with weights drawn from ``seed``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(1000)} | {"<unk>": 1000, "<s>": 1001, "</s>": 1002}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
            }
        )
    )
    torch.manual_seed(seed)
    model_class(config).save_pretrained(out)
    return out


def build(out: Path, seed: int = 0) -> Path:
    """A two-layer Llama-style model; another ``seed`` gives other weights of the same shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _write(out, LlamaForCausalLM, LlamaConfig(**SHAPE, num_hidden_layers=2, torch_dtype="float32"), seed)


def build_sliding(out: Path) -> Path:
    """A tiny Gemma3-text model: sliding-window (64 tokens) and full-attention layers alternate, so
    vLLM's hybrid allocator keeps two KV cache groups."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **SHAPE,
        num_hidden_layers=4,
        head_dim=64,
        sliding_window=64,
        pad_token_id=1000,
        layer_types=["sliding_attention", "full_attention"] * 2,
        torch_dtype="float32",
    )
    return _write(out, Gemma3ForCausalLM, config)


def build_recurrent(out: Path) -> Path:
    """A tiny Qwen3-Next model: gated-delta-net (linear attention, a Mamba-style recurrent state)
    and full-attention layers alternate. vLLM's CPU backend runs its recurrent layers in bfloat16."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **SHAPE,
        num_hidden_layers=4,
        head_dim=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        full_attention_interval=2,
        # vLLM's Qwen3-Next needs its mixture-of-experts blocks: two small experts
        num_experts=2,
        num_experts_per_tok=1,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        pad_token_id=1000,
        torch_dtype="bfloat16",
    )
    return _write(out, Qwen3NextForCausalLM, config)


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
