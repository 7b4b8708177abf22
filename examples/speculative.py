"""Speculative decoding with a draft model: the target's own greedy tokens, fewer target forwards.

    python examples/speculative.py [TARGET_PATH [DRAFT_PATH]]

Without arguments: SmolLM2-135M-Instruct (from PyPI, see hfaccel.tools.assets) as the target, and an int4 copy of
it as the draft. With a real pair (e.g. a 7B target and a 0.5B draft of the same family) the speed-up is
where the draft is much cheaper than the target and agrees with it often (see `hfaccel bench speculative`).
"""

import copy
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfaccel
from hfaccel.tools.assets import smollm2_path

target_path = sys.argv[1] if len(sys.argv) > 1 else str(smollm2_path())
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32

tokenizer = AutoTokenizer.from_pretrained(target_path, padding_side="left")
model = hfaccel.accelerate(AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(device))
if len(sys.argv) > 2:
    draft = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=dtype).to(device)
else:
    draft = hfaccel.quantize(copy.deepcopy(model), "rtn", group_size=64)

prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
out, stats = hfaccel.speculative_generate(model, draft, **inputs, num_draft_tokens=4, max_new_tokens=48,
                                          pad_token_id=tokenizer.pad_token_id, return_stats=True)
assert torch.equal(out, model.generate(**inputs, max_new_tokens=48, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id))  # lossless
print(stats)
for text in tokenizer.batch_decode(out, skip_special_tokens=True):
    print(repr(text))

# the same through generate(), any batch size:
out = model.generate(**inputs, assistant_model=draft, max_new_tokens=48, pad_token_id=tokenizer.pad_token_id)
