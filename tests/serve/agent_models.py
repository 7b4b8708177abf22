"""Served models for the agent tests: a tiny random Llama over SmolLM2's real tokenizer, with SmolLM2's own chat
template (no tools, no reasoning: calls must come from the constraint alone) or a Qwen3-style one (tools shown in
the system turn, calls as ``<tool_call>`` JSON, tool results as ``<tool_response>``, ``<think>`` blocks; with
``<think>`` and ``</think>`` single tokens, as Qwen3's and DeepSeek-R1's are)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.assets import smollm2_or_skip

# Qwen3's structure; its generation prompt opens a <think> block with enable_thinking (DeepSeek-R1's way) and closes
# an empty one without (Qwen3's way), so both places an answer can start from are served
QWEN_STYLE_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% else %}<think>

</think>

{% endif %}{% endif %}""".strip()


def smollm2_tokenizer(qwen_style: bool = False):
    """SmolLM2's tokenizer, with its own chat template or (``qwen_style``) the Qwen3-style one and ``<think>``,
    ``</think>`` added as single tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_or_skip())
    if qwen_style:
        tokenizer.add_tokens(["<think>", "</think>"])
        tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    return tokenizer


def tiny_model_over(tokenizer, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random Llama whose vocabulary is the tokenizer's."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def save_served(path: Path, qwen_style: bool = False) -> Path:
    """A model folder ``hfaccel serve`` takes: the tiny model and SmolLM2's tokenizer."""
    tokenizer = smollm2_tokenizer(qwen_style)
    tiny_model_over(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
