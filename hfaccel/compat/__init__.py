"""Every place hfaccel depends on a detail of another library that may move between releases, one module per
library: :mod:`~hfaccel.compat.transformers`, :mod:`~hfaccel.compat.torch`, :mod:`~hfaccel.compat.peft` (Triton's
are in ``hfaccel.kernels.runtime``, which imports nothing of hfaccel). Nothing outside them imports a private name of
those libraries or branches on a version; callers use the names re-exported here (``compat.tp_size``)."""

from hfaccel.compat.peft import (
    AdapterLayerState, adapter_layer_state, from_peft, has_forward_pre_hooks, is_lora_layer, is_peft_model,
    lora_adapters, lora_layers, lora_linear_parts, lora_variant, lora_weights_key, peft_active_adapters,
    peft_adapter_types, peft_adapters_disabled, peft_base_model, peft_layer_modules, peft_layers, peft_loaded,
    peft_wrapped_names,
)
from hfaccel.compat.torch import (
    SPLIT_SCAN_FAILS, compile_errors, cumsum, inductor_backend, local_tensor, marked_sizes_only, opaque_cumsum,
)
from hfaccel.compat.transformers import (
    CACHE_ARGUMENTS, MIN_TRANSFORMERS, TRANSFORMERS_VERSION, MaskPattern, active_generation_options,
    attention_function, attn_implementation, cache_argument, can_set_attn_implementation, check_transformers_version,
    compile_config_on_every_device, continuous_batching_config, custom_generate_kwargs, dense_bool_mask,
    describe_mask_function, device_map_devices, encode_media, encoded_rows, generate_cache_argument,
    generation_options, generation_pad_tensor, given_cache, output_cache, padding_mask, pipeline_generation_config,
    register_attention, sdpa_attention, sdpa_mask, slice_encoded_media, takes_encoded_media, tp_group, tp_plan,
    tp_size, tp_splits_kv_heads, tp_style, transformers_prefill, transformers_sample, without_cache,
)

__all__ = [
    "AdapterLayerState", "CACHE_ARGUMENTS", "MIN_TRANSFORMERS", "MaskPattern", "SPLIT_SCAN_FAILS",
    "TRANSFORMERS_VERSION", "active_generation_options", "adapter_layer_state", "attention_function",
    "attn_implementation", "cache_argument", "can_set_attn_implementation", "check_transformers_version",
    "compile_config_on_every_device", "compile_errors", "continuous_batching_config", "cumsum",
    "custom_generate_kwargs", "dense_bool_mask", "describe_mask_function", "device_map_devices", "encode_media",
    "encoded_rows", "from_peft", "generate_cache_argument", "generation_options", "generation_pad_tensor",
    "given_cache", "has_forward_pre_hooks", "inductor_backend", "is_lora_layer", "is_peft_model", "local_tensor",
    "lora_adapters", "lora_layers", "lora_linear_parts", "lora_variant", "lora_weights_key", "marked_sizes_only",
    "opaque_cumsum", "output_cache", "padding_mask", "peft_active_adapters", "peft_adapter_types",
    "peft_adapters_disabled", "peft_base_model", "peft_layer_modules", "peft_layers", "peft_loaded",
    "peft_wrapped_names", "pipeline_generation_config", "register_attention", "sdpa_attention", "sdpa_mask",
    "slice_encoded_media", "takes_encoded_media", "tp_group", "tp_plan", "tp_size", "tp_splits_kv_heads", "tp_style",
    "transformers_prefill", "transformers_sample", "without_cache",
]
