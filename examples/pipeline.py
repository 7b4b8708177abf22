"""transformers.pipeline() over an accelerated model.

    python examples/pipeline.py [MODEL_PATH_OR_HUB_ID]
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import hfaccel
from hfaccel.tools.assets import smollm2_path

name = sys.argv[1] if len(sys.argv) > 1 else str(smollm2_path())
device = "cuda" if torch.cuda.is_available() else "cpu"
tokenizer = AutoTokenizer.from_pretrained(name)
model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
model = hfaccel.accelerate(model.to(device))

generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
messages = [{"role": "user", "content": "Name three rivers in Europe."}]
print(generator(messages, max_new_tokens=40, do_sample=False)[0]["generated_text"][-1]["content"])
