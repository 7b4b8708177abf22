"""Models and inputs for the ``hfaccel`` command: a device and dtype from flags, a model from a folder or hub id,
random-weight models of named public configs (for benchmarks), and prompts as a left-padded batch."""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console

from hfaccel.tools.assets import smollm2_path

# DeepSeek-V3's shapes, which V3.2 shares
_DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    head_dim=64,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    first_k_dense_replace=3,
    n_group=8,
    topk_group=4,
    vocab_size=129280,
    max_position_embeddings=163840,
)

# Shapes of public checkpoints (their config.json values), for random-weight models of the real size.
NAMED_CONFIGS: dict[str, dict] = {
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "gemma-2-2b": dict(
        model_type="gemma2",
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=256000,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=256,
        max_position_embeddings=8192,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=8192,
    ),
    # transformers' Qwen3_5TextConfig defaults (~9B): 3 gated delta-net layers to 1 full-attention layer
    "qwen3.5-9b": dict(
        model_type="qwen3_5_text",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=248320,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=32768,
    ),
    # transformers' Qwen3_5MoeTextConfig defaults (35B, 3B active): 256 experts, 8 per token, one shared expert
    "qwen3.5-35b-a3b": dict(
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        vocab_size=248320,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=32768,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=201088,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=131072,
    ),
    # DeepSeek-V2-Lite (16B, 2.4B active): multi-head latent attention (512-wide latent, 64-wide rotary key), 64
    # routed experts (6 per token) and 2 shared ones after one dense layer
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2",
        hidden_size=2048,
        intermediate_size=10944,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        head_dim=64,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        vocab_size=102400,
        max_position_embeddings=32768,
    ),
    # DeepSeek-V3 / R1 (671B, 37B active): MLA with 128 query heads (decode over its latents is compute-bound, as
    # vLLM's MLA figures show), 256 routed experts (8 per token) after three dense layers: `--layers 2` keeps those
    "deepseek-v3": _DEEPSEEK_V3,
    # DeepSeek-V3.2 (671B): V3 with DeepSeek Sparse Attention, an indexer of 64 heads 128 wide picking 2048 keys per
    # query (a prompt past 2048 tokens reads the chosen latents only)
    "deepseek-v32": dict(
        _DEEPSEEK_V3, model_type="deepseek_v32", index_n_heads=64, index_head_dim=128, index_topk=2048
    ),
    # Codestral Mamba (7B): Mamba-2 layers only, no attention (each sequence's whole context is its state)
    "codestral-mamba-7b": dict(
        model_type="mamba2",
        hidden_size=4096,
        num_hidden_layers=64,
        num_heads=128,
        head_dim=64,
        n_groups=8,
        state_size=128,
        expand=2,
        conv_kernel=4,
        vocab_size=32768,
        tie_word_embeddings=False,
    ),
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1024,
        max_position_embeddings=2048,
    ),
}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def load(model_name: str | None, device: torch.device, dtype: torch.dtype, console: Console):
    """Model and tokenizer: ``model_name`` (a local folder or hub id), else the cached SmolLM2-135M."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_name or str(smollm2_path(console))
    with console.status(f"loading {path} ({dtype}, {device})"):
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def encode(tokenizer, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """Left-padded batch; chat-formatted when the tokenizer has a chat template."""
    if tokenizer.chat_template:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    return tokenizer(prompts, return_tensors="pt", padding=True).to(device)


def build_model(spec: str, device: torch.device, dtype: torch.dtype, layers: int | None = None):
    """A random-weight model of a named config's shapes (``layers``: cut to that many layers, the layer pattern
    kept), or the model in a local folder / hub id. SDPA attention where transformers runs the model so, else
    eager (gpt-oss's sinks)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec in NAMED_CONFIGS:
        fields = dict(NAMED_CONFIGS[spec])
        if layers is not None:
            fields["num_hidden_layers"] = layers
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device(device):
            try:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
            except ValueError:  # transformers runs this model in eager attention only
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    elif Path(spec).exists() or "/" in spec:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa").to(device)
    else:
        raise ValueError(f"model must be one of {sorted(NAMED_CONFIGS)} or a model folder / hub id; got {spec!r}")
    return model.eval()
