"""Tiny random-weight models of each architecture the exactness tests cover, and prompt batches."""

from __future__ import annotations

import torch
import transformers

from hfaccel import compat
from tests.devices import DEVICE

# Small enough for the Triton interpreter, large enough to exercise GQA (4 query heads over 2 KV heads)
# and, with sliding_window=8, windows shorter than the prompts.
COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 24},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 4}),
}

# Models whose transformers code branches on data (longrope picks its factors from max(position_ids)) or loops over
# experts (MoE routing with nonzero): what torch.compile may not trace on every transformers release.
_HALF_ROTARY = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
DATA_DEPENDENT_ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "phi3-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "num_key_value_heads": 4,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "short_factor": [1.0] * _HALF_ROTARY,
                "long_factor": [2.0 + i / 8 for i in range(_HALF_ROTARY)],
            },
        },
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}

# Transformers' own path each architecture is compared with: sdpa, except where sdpa cannot run the
# model (Gemma2's attention logit softcapping is eager-only in transformers).
BASELINE_ATTENTION = {"gemma2": "eager"}


def generate_cache(cache) -> dict:
    """``generate()`` keyword arguments that pass ``cache``, under the name the installed transformers takes."""
    return {compat.generate_cache_argument(): cache}


def model_cache(model, cache) -> dict:
    """A forward's keyword arguments that pass ``cache``, under the name ``model``'s forward takes."""
    return {compat.cache_argument(model): cache}


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> transformers.PreTrainedModel:
    config_name, model_name, extra = {**ARCHITECTURES, **DATA_DEPENDENT_ARCHITECTURES}[arch]
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    _sharpen(model)
    model.set_attn_implementation(BASELINE_ATTENTION.get(arch, "sdpa"))
    return model.to(DEVICE)


# This year's families (issue 47), tiny: transformers' default config of each shrunk (tests/hf/tiny_configs.py),
# the feature that matters switched on. Name -> (model type, config overrides).
FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3_next": ("qwen3_next", {}),  # gated delta-net layers (conv + recurrent state) beside full attention
    "qwen3_5_moe": ("qwen3_5_moe_text", {}),
    "falcon_h1": ("falcon_h1", {}),  # Mamba-2 beside attention in every layer
    "granite_h": ("granitemoehybrid", {}),
    "jamba": ("jamba", {}),  # Mamba-1
    "mamba2": ("mamba2", {}),  # Mamba-2 layers only (Codestral Mamba): no K/V, each sequence's state in a slot
    "lfm2": ("lfm2", {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention"] * 2}),  # short convolutions
    "minimax": ("minimax", {}),  # lightning (linear) attention, its state kept in MiniMax's own cache class
    # ZAYA1's compressed convolutional attention: each attention layer's q/k convolution and delayed value are state
    "zaya": ("zaya", {}),
    "gpt_oss": ("gpt_oss", {}),  # attention sinks, alternating sliding and full layers
    "gemma4": ("gemma4_text", {}),  # per-layer head sizes and KV heads, layers sharing K/V (gemma4_config)
    "deepseek_v3": ("deepseek_v3", {}),  # multi-head latent attention: latents cached, K/V expanded after the cache
    "kimi_linear": ("kimi_linear", {}),  # MLA layers beside Kimi delta attention (conv + recurrent state)
    # DeepSeek Sparse Attention: MLA whose indexer picks each query's 4 keys (fewer than the prompts hold); 16 indexer
    # heads, so that no two keys tie on a score of 0 (all heads' ReLU at 0), which torch.topk breaks by layout
    "deepseek_v32": ("deepseek_v32", {"index_topk": 4, "index_n_heads": 16}),
    # layers 1 and 3 reuse the choice of the layer before them
    "glm_moe_dsa": ("glm_moe_dsa", {"index_topk": 4, "index_n_heads": 16, "indexer_types": ["full", "shared"] * 2}),
    # two sparse-attention layers and an MLA layer within a sliding window of 8 (its latents expanded, as transformers)
    "dots3_note": ("dots3_note_text", {"index_topk": 4, "index_n_heads": 16}),
    # chunked attention (chunks of 8, shorter than prompt + new tokens) on the RoPE layers, full attention with the
    # attention temperature on the no-RoPE ones
    "llama4": (
        "llama4_text",
        {
            "attention_chunk_size": 8,
            "num_hidden_layers": 4,
            "no_rope_layers": [1, 0, 1, 0],
            "layer_types": ["chunked_attention", "full_attention"] * 2,
        },
    ),
}
HYBRID_FAMILIES = (
    *("qwen3_next", "qwen3_5_moe", "falcon_h1", "granite_h", "jamba", "lfm2", "minimax", "kimi_linear", "zaya"),
    "mamba2",
)
RECURRENT_ONLY_FAMILIES = ("mamba2",)  # no attention at all: hfaccel serves the loop, the state slots and the engine
LATENT_FAMILIES = ("deepseek_v3", "kimi_linear")  # multi-head latent attention, read in the latent space
SPARSE_FAMILIES = (
    "deepseek_v32",
    "glm_moe_dsa",
    "dots3_note",
)  # the keys their indexer picks, by exact torch attention


# the transformers release from which hfaccel serves a family (earlier ones lack it, or cache DeepSeek-V3.2's K/V
# expanded beside its indexer's keys, which hfaccel declines, as the model walk checks)
SERVED_SINCE = {"deepseek_v32": "5.24", "glm_moe_dsa": "5.24", "dots3_note": "5.24"}


def family_served(name: str) -> bool:
    """Whether the installed transformers has the family in the form hfaccel serves (:data:`SERVED_SINCE`)."""
    from packaging.version import Version

    return Version(transformers.__version__) >= Version(SERVED_SINCE.get(name, "0"))


def require_family(name: str) -> None:
    """Skip the calling test where the installed transformers has not the family as hfaccel serves it."""
    import pytest

    if not family_served(name):
        pytest.skip(
            f"hfaccel serves {name} from transformers {SERVED_SINCE[name]} (installed: {transformers.__version__})"
        )


def family_model(name: str, vocab_size: int = 96, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random-weight model of one of :data:`FAMILIES` (fp32, eval, on DEVICE); the test skipped where the
    installed transformers has not the family as hfaccel serves it."""
    from tests.hf.tiny_configs import tiny_config

    require_family(name)
    model_type, overrides = FAMILIES[name]
    config = (
        gemma4_config(vocab_size) if name == "gemma4" else tiny_config(model_type, vocab_size=vocab_size, **overrides)
    )
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # eager attention only (gpt-oss)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if name in SPARSE_FAMILIES:  # token 0's embedding (the pad token's) is zero: a query of it ties every indexer score
        with torch.no_grad():
            model.get_input_embeddings().weight[0].normal_()
    if name == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks that matter (they start at zero)
    return model.eval().to(DEVICE)


def gemma4_config(vocab_size: int = 96) -> transformers.PretrainedConfig:
    """Gemma 4's text model, tiny: sliding layers of 2 KV heads x 16 and global layers of 1 KV head x 32 (its
    ``attention_k_eq_v``: values are the keys), the last two layers reading the K/V of earlier ones."""
    return transformers.Gemma4TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        layer_types=["sliding_attention", "full_attention"] * 3,
        sliding_window=8,
        num_kv_shared_layers=2,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=vocab_size,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def wide_head_model() -> transformers.PreTrainedModel:
    """A tiny Llama whose heads are 640 wide: wider than hfaccel's kernels take (512), so hfaccel cannot serve it."""
    config = transformers.LlamaConfig(**{**COMMON, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 640})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().to(DEVICE)


def _sharpen(model: transformers.PreTrainedModel) -> None:
    """Scale weights up so attention is far from uniform and logits rarely tie (random init is very flat)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                param.mul_(4.0)
            if name.endswith("embed_tokens.weight"):
                param.mul_(8.0)


def padded_batch(lengths=(11, 7, 4), vocab_size: int = 96, seed: int = 1) -> dict[str, torch.Tensor]:
    """Left-padded prompts of the given lengths: input_ids and attention_mask ``[B, max(lengths)]``."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, vocab_size, (length,), generator=gen)
        attention_mask[row, width - length :] = 1
    return {"input_ids": input_ids.to(DEVICE), "attention_mask": attention_mask.to(DEVICE)}


CHARS = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()[]{}<>/\\|@#$%^&*+=_~`\n"


def char_tokenizer(vocab_size: int = 96) -> transformers.PreTrainedTokenizerFast:
    """A tokenizer for the tiny models: ids 0-2 are <pad>, <s>, </s>; every other id is one character, so
    multi-character stop strings always span several tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + list(CHARS[: vocab_size - len(specials)]))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
