"""tiny_config(model_type): a tiny random-weight-sized config for any model type transformers knows.

Generic rules shrink the usual size fields of the config (and, recursively, of its sub-configs); per-layer
lists (``layer_types``, ``mlp_layer_types``, ...) are cut to a few layers that still hold every kind of layer
the full model has; ``OVERRIDES`` adds per-type fixes. Usage::

    from tiny import tiny_config
    cfg = tiny_config("qwen3_next")
    model = AutoModelForCausalLM.from_config(cfg)

Token ids: pad 0, bos 1, eos 2; every other special token id found (image/audio/... tokens) is moved to the top
of the vocabulary (>= SPECIAL_BASE), so prompts drawn from [3, SPECIAL_BASE) never contain one.
"""

from __future__ import annotations

import copy
import warnings

VOCAB = 256
SPECIAL_BASE = 200  # special token ids other than pad/bos/eos are placed at SPECIAL_BASE...VOCAB-1
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTER = 64
LAYERS = 2
MAX_LAYERS_KEEP = 8  # a per-layer pattern's shortest prefix with every layer kind is kept up to this length
EXPERTS = 4
TOPK = 2
WINDOW = 8  # sliding windows shorter than prompt + new tokens (<= 13), so the window matters

# field name -> tiny value; applied wherever the field exists in the config (or a sub-config) and is not None
GENERIC = {
    # widths
    **dict.fromkeys(
        [
            "hidden_size",
            "d_model",
            "n_embd",
            "n_embed",
            "dim",
            "emb_dim",
            "embedding_dim",
            "word_embed_proj_dim",
            "attention_hidden_size",
            "lru_width",
            "input_embedding_size",
            "output_embedding_size",
            "backbone_hidden_size",
            "router_hidden_size",
        ],
        HIDDEN,
    ),
    "embedding_size": HIDDEN,
    # heads
    **dict.fromkeys(
        [
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "attention_heads",
            "decoder_attention_heads",
            "encoder_attention_heads",
            "num_encoder_attention_heads",
            "num_decoder_attention_heads",
            "swa_num_attention_heads",
        ],
        HEADS,
    ),
    **dict.fromkeys(
        ["num_key_value_heads", "num_kv_heads", "multi_query_group_num", "swa_num_key_value_heads"], KV_HEADS
    ),
    **dict.fromkeys(
        ["head_dim", "kv_channels", "attention_head_dim", "dim_head", "d_head", "attention_head_size", "swa_head_dim"],
        HEAD_DIM,
    ),
    # depth
    **dict.fromkeys(
        [
            "num_hidden_layers",
            "n_layer",
            "n_layers",
            "num_layers",
            "decoder_layers",
            "encoder_layers",
            "num_encoder_layers",
            "num_decoder_layers",
            "num_blocks",
        ],
        LAYERS,
    ),
    # MLP widths
    **dict.fromkeys(
        [
            "intermediate_size",
            "ffn_dim",
            "n_inner",
            "decoder_ffn_dim",
            "encoder_ffn_dim",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "ffn_hidden_size",
            "dim_ff",
            "dff",
            "d_inner",
            "feed_forward_size",
            "intermediate_size_mlp",
            "expert_ffn_hidden_size",
            "dense_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "shared_experts_intermediate_size",
            "prompt_mid_dim",
        ],
        INTER,
    ),
    # vocabulary / positions
    "vocab_size": VOCAB,
    "unpadded_vocab_size": VOCAB,
    "decoder_vocab_size": VOCAB,
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx", "max_target_positions"], 512),
    # MoE
    **dict.fromkeys(["num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"], EXPERTS),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token"], TOPK),
    **dict.fromkeys(["n_group", "num_expert_group", "topk_group"], 1),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "moe_num_shared_experts"], 1),
    "zero_expert_num": 2,
    # MLA / sparse indexers
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "o_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    # state-space / linear attention
    **dict.fromkeys(["mamba_d_state", "state_size", "ssm_state_size"], 16),
    **dict.fromkeys(["mamba_n_heads", "mamba_num_heads", "n_mamba_heads"], 8),
    **dict.fromkeys(["mamba_d_head", "mamba_head_dim", "mamba_headdim"], 16),
    **dict.fromkeys(["time_step_rank", "mamba_dt_rank"], 8),
    **dict.fromkeys(["mamba_chunk_size"], 16),
    **dict.fromkeys(["n_groups", "mamba_n_groups", "mamba_ngroups"], 1),
    "mamba_d_ssm": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    # windows
    **dict.fromkeys(
        [
            "sliding_window",
            "attention_window_size",
            "sliding_window_size",
            "attention_chunk_size",
            "window_size",
            "local_attention",
        ],
        WINDOW,
    ),
    # misc low-rank / aux widths
    "laurel_rank": 8,
    "adapter_rank": 16,
    "gated_norm_rank": 8,
    "loop_gate_rank": 8,
    "hc_lowrank": 16,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB,
    "ple_embed_dim": 32,
}

# sub-configs whose fields are only shrunk for speed (a vision / audio tower): fewer, smaller layers
TOWER = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "depth": 1,
    "num_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "out_hidden_size": 64,
    "projection_dim": 32,
    "embed_dim": 32,
    "width": 32,
}
TOWER_NAMES = ("vision", "audio", "vq", "patcher", "encoder")

# lists with one entry per layer (cut with the layer selection)
PER_LAYER = (
    "layer_types",
    "mlp_layer_types",
    "layers_block_type",
    "block_types",
    "attention_layers",
    "indexer_types",
    "no_rope_layers",
    "layer_rope_theta",
    "num_attention_heads_per_layer",
    "activation_sparsity_pattern",
    "attn_layers",
    "layers_block_types",
    "sliding_window_layers",
    "moe_layer_types",
    "attn_type_list",
    "hybrid_override_pattern",
)
# lists of layer indices (remapped to the kept layers)
INDEX_LISTS = (
    "mlp_only_layers",
    "full_attn_idxs",
    "moe_layers",
    "hybrid_layer_ids",
    "ple_layer_ids",
    "attn_layer_indices",
    "swa_layers",
    "dense_layers",
    "linear_attn_layers",
)
DEPTH_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_blocks")

# GENERIC keys whose None means "this feature is off": left None
NONE_MEANS_OFF = {
    "sliding_window",
    "attention_window_size",
    "sliding_window_size",
    "attention_chunk_size",
    "window_size",
    "local_attention",
    "q_lora_rank",
    "o_lora_rank",
    "zero_expert_num",
    "n_shared_experts",
    "num_shared_experts",
    "moe_num_shared_experts",
    "n_group",
    "num_expert_group",
    "topk_group",
    "shared_expert_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "shared_experts_intermediate_size",
    "index_head_dim",
    "index_n_heads",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "qk_head_dim",
}

# per-type overrides (applied last, on the top-level config's keyword arguments; a dict value for a sub-config
# name updates that sub-config's keyword arguments)
_QWEN4_INDEXER = {
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 2,
}
OVERRIDES: dict[str, dict] = {
    # transformers' default config has no attention layer at all (all Mamba): give it one
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # attention every attn_layer_period layers (default 8, offset 4): every 2nd, MoE every 2nd
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    # block_types is a cycle of 3 (recurrent, recurrent, attention), not one entry per layer
    "recurrent_gemma": {"num_hidden_layers": 3},
    # Mamba2's heads: hidden_size * expand == num_heads * head_dim
    "mamba2": {"num_heads": 8},
    # tied to the embeddings, a tiny Mamba's greedy token is the one it was given (that token's own row scores
    # highest), so every step repeats it: untied, the walk's tokens vary
    "mamba": {"tie_word_embeddings": False},
    "falcon_mamba": {"tie_word_embeddings": False},
    # the sliding layers' qk_nope_head_dim (192 of a 256 head_dim) must keep head_dim == nope + rope
    "dots3_note_text": {
        "head_dim": 16,
        "per_layer_config": lambda plc: {k: {**v, "qk_nope_head_dim": 8} for k, v in plc.items()},
    },
    "dots3_note": {
        "text_config": {
            "head_dim": 16,
            "per_layer_config": lambda plc: {k: {**v, "qk_nope_head_dim": 8} for k, v in plc.items()},
        }
    },
    # n_shared_experts defaults to None, which the modeling code multiplies
    "dots1": {"n_shared_experts": 1},
    # widths and depths under names the generic shrinking does not know (a 410M text model; a 600M audio tower; 96M
    # of hashed byte-group embeddings)
    "kosmos-2": {"text_config": {"embed_dim": 64, "layers": 2}},
    "kosmos-2.5": {
        "latent_query_num": 8,
        "text_config": {"embed_dim": 64, "layers": 2},
        "vision_config": {"patch_embed_hidden_size": 48, "max_num_patches": 64},
    },
    "blt": {"encoder_hash_byte_group_vocab": 1024},
    **dict.fromkeys(
        ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"],
        {"audio_config": {"d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 4, "encoder_ffn_dim": 64}},
    ),
    # all layers reuse the target's KV: num_kv_shared_layers == num_hidden_layers; transformers 5.17's default config
    # has no text config (the model would build a full-size one: 3B parameters)
    "gemma4_unified_assistant": {
        "__init__": {"text_config": {"model_type": "gemma4_unified_text"}},
        "text_config": {"__layers__": 6, "num_kv_shared_layers": 6},
    },
    # its vision encoder's widths grow from the patch's elements (40 x 40 x 2 x 3: a 614k-wide first layer)
    "inkling_mm_model": {"vision_config": {"patch_size": 4}},
    # M-RoPE's sections split a tiny head's 8 rotary frequencies
    "qwen2_vl": {"text_config": {"rope_parameters": lambda rope: {**(rope or {}), "mrope_section": [2, 3, 3]}}},
    "qwen2_5_vl": {"text_config": {"rope_parameters": lambda rope: {**(rope or {}), "mrope_section": [2, 3, 3]}}},
    # multi_query: one KV head (num_key_value_heads is derived from it)
    "gpt_bigcode": {"num_key_value_heads": 1},
    # ZAYA supports one expert per token only
    "zaya": {"num_experts_per_tok": 1},
    # the assistant validates hidden_size_per_layer_input == 0 (its default, 256, does not pass)
    # and more: its default config does not validate at all
    "gemma4_assistant": {
        "__init__": {
            "text_config": {
                "hidden_size_per_layer_input": 0,
                "vocab_size_per_layer_input": 0,
                "enable_moe_block": False,
                "use_double_wide_mlp": False,
                "num_kv_shared_layers": 30,
            }
        },
        "text_config": {"__layers__": 6, "num_kv_shared_layers": 6},
    },
    # input + recurrent + output layers == num_hidden_layers, all given in the serialized (attention, mlp) block
    # count that __post_init__ halves: 4 decoder layers (3 sliding, 1 full), 1 input + 2 recurrent (looped) + 1 output
    "dory": {"__layers__": 8, "n_input_layers": 2, "n_recurrent_layers": 4, "n_output_layers": 2},
    # ReformerModelWithLMHead needs is_decoder; axial position dims must add up to hidden_size
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "max_position_embeddings": 4096},
    # the default rope_parameters is empty: one entry per layer type is needed
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # layer_types defaults to None (the modeling code indexes it)
    "lfm2_moe": {
        "num_hidden_layers": 4,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "num_dense_layers": 1,
    },
    # the indexer's sizes default to None
    "qwen4_exp_text": dict(_QWEN4_INDEXER),
    "qwen4_exp": {"text_config": dict(_QWEN4_INDEXER)},
    # num_layers_per_stack is derived from num_hidden_layers (and rewrites it): let it be derived again
    "hrm_text": {
        "num_layers_per_stack": None,
        "num_hidden_layers": 2,
        "H_cycles": 1,
        "L_cycles": 1,
        "L_bp_cycles": [1],
    },
    # the shared transformer block is tied across its hybrid layers: keep two hybrid layers
    # the shared transformer reads [hidden, embeddings] concatenated: attention_hidden_size = 2 * hidden_size
    "zamba": {"__layers__": 8, "attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS},
    "zamba2": {
        "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
        "num_hidden_layers": 4,
        "hybrid_layer_ids": [1, 3],
        "num_key_value_heads": 4,
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": 2 * HIDDEN // HEADS,
    },
    # the recurrent step's state is made [.., head, head] (qk_dim_factor 0.5 gives a qk head half the v head)
    "xlstm": {"qk_dim_factor": 1.0},
}


def _depth(d: dict) -> tuple[str | None, int | None]:
    for key in DEPTH_KEYS:
        if isinstance(d.get(key), int):
            return key, d[key]
    return None, None


def _layer_selection(d: dict, depth: int, force: int | None = None) -> list[int]:
    """Indices of the layers kept: the shortest prefix holding every kind of every per-layer list (at least
    LAYERS); past MAX_LAYERS_KEEP, the first layer of each kind instead. ``force``: the first ``force`` layers."""
    if force is not None:
        return list(range(min(force, depth)))
    lists = [d[k] for k in PER_LAYER if isinstance(d.get(k), (list, str)) and len(d[k]) == depth]
    plc = d.get("per_layer_config")
    if isinstance(plc, dict) and plc:  # heterogeneous layers: each distinct override is a kind of layer
        lists.append([repr(sorted(plc.get(f"{i:02d}", plc.get(str(i), {})).items())) for i in range(depth)])
    if not lists:
        return list(range(min(LAYERS, depth)))
    need = max(LAYERS, max(max(lst.index(v) for v in set(lst)) + 1 for lst in lists))
    need = min(need, depth)
    if need <= MAX_LAYERS_KEEP:
        return list(range(need))
    keep = sorted({lst.index(v) for lst in lists for v in set(lst)} | set(range(LAYERS)))
    return keep


def _cut_per_layer_config(d: dict, plc: dict, keep: list[int], chosen: dict) -> dict:
    """transformers' heterogeneous per-layer overrides ({"05": {"head_dim": 512}, ...}) for the kept layers, their
    sizes shrunk in proportion to the global ones (a per-layer head_dim twice the global stays twice the tiny)."""
    out = {}
    for key, overrides in plc.items():
        index = int(key)
        if index not in keep:
            continue
        new = {}
        for name, value in overrides.items():
            if name in GENERIC and isinstance(value, int) and not isinstance(value, bool):
                base = d.get(name)
                tiny = chosen.get(name, GENERIC[name])
                new[name] = max(1, tiny * value // base) if isinstance(base, int) and base > 0 else tiny
            else:
                new[name] = value
        out[f"{keep.index(index):02d}" if len(key) == 2 else str(keep.index(index))] = new
    return out


def _special_ids(d: dict, overrides: dict) -> None:
    nxt = SPECIAL_BASE
    for key, value in sorted(d.items()):
        if key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id"):
            continue
        if (
            (key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_index") and "token" in key)
            and isinstance(value, int)
            and value >= SPECIAL_BASE
        ):
            overrides[key] = nxt
            nxt = min(nxt + 1, VOCAB - 1)
    for key, value in (
        ("pad_token_id", 0),
        ("bos_token_id", 1),
        ("eos_token_id", 2),
        ("decoder_start_token_id", 1),
        ("forced_eos_token_id", 2),
        ("sep_token_id", 3),
        ("cls_token_id", 4),
        ("eod_token_id", 2),
    ):
        if key in d and d[key] is not None:
            overrides[key] = value


def shrink_dict(d: dict, tower: bool = False, force: int | None = None, text_width: int | None = None) -> dict:
    """Keyword arguments that shrink the config whose ``to_dict()`` (no sub-configs) is ``d``."""
    out: dict = {}
    depth_key, depth = _depth(d)
    for key, value in GENERIC.items():
        if key not in d or isinstance(d[key], (bool, dict, str)):
            continue
        if isinstance(d[key], list):  # one value per layer (gemma3n's intermediate_size)
            if depth is not None and len(d[key]) == depth and all(isinstance(v, int) for v in d[key]):
                out[key] = [value] * depth  # cut with the layers below
            continue
        if d[key] is None and (key in NONE_MEANS_OFF or tower):
            continue
        if d[key] == 0:  # 0 means "off" (gemma4's hidden_size_per_layer_input...)
            continue
        out[key] = value
    if d.get("qk_rope_head_dim"):  # MLA: the rotary part is head_dim; every query head has its own K/V
        if "head_dim" in d:  # head_dim is either the rotary part (DeepSeek) or nope + rope (dots3)
            whole = d["head_dim"] == (d.get("qk_nope_head_dim") or 0) + d["qk_rope_head_dim"]
            out["head_dim"] = GENERIC["qk_head_dim"] if whole else GENERIC["qk_rope_head_dim"]
        if "num_key_value_heads" in d:
            out["num_key_value_heads"] = HEADS
    if isinstance(d.get("rotary_dim"), int):
        out["rotary_dim"] = HEAD_DIM // 2
    if isinstance(d.get("per_layer_config"), dict) and depth is not None:
        out["per_layer_config"] = d["per_layer_config"]
    if tower:
        out.clear()
        for key, value in TOWER.items():
            if key in d and isinstance(d[key], int) and not isinstance(d[key], bool):
                out[key] = value
        # widths tied to the tower's or the text model's hidden size by value (adapters, projections)
        width = d.get("hidden_size")
        for key, value in d.items():
            if key in out or not isinstance(value, int) or isinstance(value, bool):
                continue
            if ("dim" in key or "size" in key) and value == width and "hidden_size" in out:
                out[key] = out["hidden_size"]
            elif ("out" in key or "text" in key) and text_width and value == text_width:
                out[key] = HIDDEN
        for key in ("vocab_size", "max_position_embeddings"):
            out.pop(key, None)
        out.pop("sliding_window", None)
        if isinstance(d.get("per_layer_config"), dict):
            n = next((out[k] for k in DEPTH_KEYS + ("depth",) if k in out), 1)
            out["per_layer_config"] = _cut_per_layer_config(d, d["per_layer_config"], list(range(n)), out)
        return out
    # things that must stay consistent with the new sizes
    if "shared_intermediate_size" in d and d["shared_intermediate_size"]:
        out["shared_intermediate_size"] = INTER
    if d.get("head_dim") is None and "head_dim" in d:
        pass  # derived from hidden_size / heads
    if depth is not None:
        keep = _layer_selection(d, depth, force)
        n = len(keep)
        out[depth_key] = n
        for key in DEPTH_KEYS + ("encoder_layers", "num_encoder_layers", "num_decoder_layers"):
            if key in out and key != depth_key and key in d:
                out[key] = n if key in DEPTH_KEYS else out[key]
        for key in PER_LAYER:
            value = d.get(key)
            if isinstance(value, list) and len(value) == depth:
                out[key] = [value[i] for i in keep]
            elif isinstance(value, str) and len(value) == depth:
                out[key] = "".join(value[i] for i in keep)
        for key, value in list(out.items()):
            if key in GENERIC and isinstance(value, list) and len(value) == depth:
                out[key] = [value[i] for i in keep]
        if isinstance(out.get("per_layer_config"), dict):
            out["per_layer_config"] = _cut_per_layer_config(d, out["per_layer_config"], keep, out)
        for key in INDEX_LISTS:
            value = d.get(key)
            if isinstance(value, list) and all(isinstance(i, int) for i in value):
                out[key] = [keep.index(i) for i in value if i in keep]
        # layer-count coupled scalars
        for key in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
            if isinstance(d.get(key), int) and d[key] > 0:
                out[key] = 1
        if isinstance(d.get("moe_layer_end_index"), int):
            out["moe_layer_end_index"] = n - 1
        if isinstance(d.get("max_window_layers"), int):
            out["max_window_layers"] = 1
        if isinstance(d.get("num_kv_shared_layers"), int) and d["num_kv_shared_layers"] > 0:
            out["num_kv_shared_layers"] = 1
    _special_ids(d, out)
    return out


def _sub_config_names(cfg) -> list[str]:
    return [name for name in (getattr(cfg, "sub_configs", None) or {}) if getattr(cfg, name, None) is not None]


def _shrink_config(cfg, tower: bool = False, extra: dict | None = None, text_width: int | None = None):
    """A new config of ``type(cfg)`` with tiny sizes (sub-configs shrunk first and passed in)."""
    d = {k: v for k, v in cfg.to_dict().items() if not isinstance(v, dict) or k == "per_layer_config"}
    extra = dict(extra or {})
    kwargs = shrink_dict(d, tower=tower, force=extra.pop("__layers__", None), text_width=text_width)
    text = getattr(cfg, "text_config", None)
    text_width = getattr(text, "hidden_size", None) if text is not None and not tower else d.get("hidden_size")
    for name in _sub_config_names(cfg):
        sub = getattr(cfg, name)
        if not hasattr(sub, "to_dict"):
            continue
        is_tower = tower or any(t in name for t in TOWER_NAMES)
        sub_extra = extra.pop(name, None)
        kwargs[name] = _shrink_config(sub, tower=is_tower, extra=sub_extra, text_width=text_width)
        if not is_tower and hasattr(kwargs[name], "vocab_size"):
            # a top-level vocab must match its text sub-config's
            if "vocab_size" in d and d["vocab_size"] is not None:
                kwargs["vocab_size"] = kwargs[name].vocab_size
    for key, value in extra.items():  # a callable override maps the computed value
        kwargs[key] = value(kwargs.get(key)) if callable(value) else value
    full = {k: v for k, v in cfg.to_dict().items() if k not in ("transformers_version", "_name_or_path")}
    for name in _sub_config_names(cfg):
        full.pop(name, None)
    full.pop("model_type", None)
    full.pop("architectures", None)
    full.update(kwargs)
    # ``rope_parameters`` / ``rope_scaling`` may carry sizes derived from the old dims: keep them (they are dicts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return type(cfg)(**full)
        except TypeError:
            # some configs do not take every to_dict() field back: pass only the shrunk ones
            return type(cfg)(**kwargs)


def tiny_config(model_type: str, **overrides):
    """A tiny config of ``model_type`` (raises what transformers raises when it cannot be made); ``overrides``: more
    keyword arguments of the config (after :data:`OVERRIDES`)."""
    from transformers import AutoConfig

    extra = {**copy.deepcopy(OVERRIDES.get(model_type, {})), **overrides}
    pre = extra.pop("__init__", None)  # keyword arguments needed to make even the default config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(model_type, **(pre or {}))
    fix = extra.pop("__post__", None)
    tiny = _shrink_config(cfg, extra=extra)
    if fix is not None:
        fix(tiny)
    return tiny
