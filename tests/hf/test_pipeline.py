"""hfaccel.pipeline: a transformers text-generation pipeline whose prompt lists run on the engine, with
transformers' own pipeline's texts for greedy decoding."""

import pytest
import torch
import transformers

import hfaccel
from hfaccel.hf.pipeline import EngineTextGenerationPipeline
from tests.assets import smollm2_or_skip
from tests.models import char_tokenizer, tiny_model

PROMPTS = ["the cat sat", "hello", "a much longer prompt about nothing at all", "x"]
CHATS = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "what is up?"}]]
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture
def tiny():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tiny_model("llama"), tokenizer


def test_prompt_list_matches_transformers_pipeline(tiny):
    model, tokenizer = tiny
    expected = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)(
        PROMPTS, max_new_tokens=12, do_sample=False
    )
    expected_chat = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)(
        CHATS, max_new_tokens=12, do_sample=False
    )
    pipe = hfaccel.pipeline(
        "text-generation",
        model=model,
        tokenizer=tokenizer,
        attention="torch",
        engine_kwargs={"max_num_seqs": 4, "num_blocks": 64, "block_size": 4},
    )
    assert isinstance(pipe, transformers.TextGenerationPipeline) and model.hfaccel.active
    assert pipe(PROMPTS, max_new_tokens=12, do_sample=False) == expected
    assert pipe(CHATS, max_new_tokens=12, do_sample=False) == expected_chat
    assert pipe(PROMPTS[0], max_new_tokens=12, do_sample=False) == expected[0]
    assert (
        pipe(PROMPTS[:2], max_new_tokens=12, do_sample=False, return_full_text=False)[1][0]["generated_text"]
        == expected[1][0]["generated_text"][len(PROMPTS[1]) :]
    )
    assert pipe.engine.stats()["blocks_used"] == 0


def test_options_the_engine_lacks_use_generate(tiny, monkeypatch):
    model, tokenizer = tiny
    expected = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)(
        PROMPTS[:2], max_new_tokens=6, num_beams=2, do_sample=False
    )
    pipe = hfaccel.pipeline(model=model, tokenizer=tokenizer, attention="torch")
    monkeypatch.setattr(EngineTextGenerationPipeline, "engine", property(lambda self: pytest.fail("engine used")))
    assert pipe(PROMPTS[:2], max_new_tokens=6, num_beams=2, do_sample=False) == expected


def test_sampling_with_several_return_sequences(tiny):
    model, tokenizer = tiny
    pipe = hfaccel.pipeline(model=model, tokenizer=tokenizer, attention="torch")
    out = pipe(PROMPTS[:2], max_new_tokens=5, do_sample=True, top_k=10, num_return_sequences=3)
    assert [len(o) for o in out] == [3, 3]
    assert all(o["generated_text"].startswith(p) for p, outs in zip(PROMPTS, out) for o in outs)


def test_bad_task_and_missing_model():
    with pytest.raises(ValueError, match="serves the 'text-generation' task"):
        hfaccel.pipeline("summarization", model=tiny_model("llama"))
    with pytest.raises(ValueError, match="needs a model"):
        hfaccel.pipeline("text-generation")


@pytest.mark.slow
def test_smollm2_texts_equal_transformers_pipeline():
    path = smollm2_or_skip()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
    chats = [[{"role": "user", "content": "Name a river in Europe."}]]
    reference = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = reference(prompts, max_new_tokens=24, do_sample=False)
    expected_chat = reference(chats, max_new_tokens=24, do_sample=False)
    pipe = hfaccel.pipeline(
        model=model,
        tokenizer=tokenizer,
        attention="torch",  # the CUDA defaults' scheduling
        engine_kwargs={"max_num_seqs": 4, "num_blocks": 128, "async_scheduling": True},
    )
    assert pipe(prompts, max_new_tokens=24, do_sample=False) == expected
    assert pipe(chats, max_new_tokens=24, do_sample=False) == expected_chat
