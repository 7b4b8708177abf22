"""Continuous batching: many prompts, each with its own sampling parameters, served together.

    python examples/engine.py [MODEL_PATH_OR_HUB_ID]
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfaccel
from hfaccel.tools.assets import smollm2_path

name = sys.argv[1] if len(sys.argv) > 1 else str(smollm2_path())
device = "cuda" if torch.cuda.is_available() else "cpu"
tokenizer = AutoTokenizer.from_pretrained(name)
model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
engine = hfaccel.Engine(model.to(device), tokenizer, max_num_seqs=16, max_num_batched_tokens=1024)

chats = [[{"role": "user", "content": question}] for question in
         ["Name three rivers in Europe.", "What is 12 * 7?", "Write a haiku about the sea."]]
greedy = hfaccel.SamplingParams(max_tokens=48, temperature=0)
creative = hfaccel.SamplingParams(max_tokens=48, temperature=0.8, top_p=0.9, seed=0, n=2, stop=["\n\n"])
for out in engine.generate(chats, [greedy, greedy, creative]):
    for completion in out.outputs:
        print(f"[{completion.finish_reason}, ttft {out.metrics.ttft * 1e3:.0f} ms] {completion.text!r}")

print("streaming: ", end="")
for delta in engine.stream("The capital of France is", hfaccel.SamplingParams(max_tokens=24, temperature=0)):
    print(delta.outputs[0].text if delta.outputs else "", end="", flush=True)
print()
