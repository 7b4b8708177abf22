"""Talk to `hfaccel serve` with the official openai client (unchanged).

    hfaccel serve MODEL_FOLDER --port 8000 --served-model-name my-model &
    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1] [--model my-model]
"""

import argparse

from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--model", default="my-model")
parser.add_argument("--api-key", default="none", help="what the server's --api-key is, if it has one")
args = parser.parse_args()

client = OpenAI(base_url=args.base_url, api_key=args.api_key)
print([model.id for model in client.models.list().data])

reply = client.chat.completions.create(model=args.model, max_tokens=64, temperature=0,
                                       messages=[{"role": "user", "content": "Name three rivers in Europe."}])
print(reply.choices[0].message.content, reply.usage)

stream = client.completions.create(model=args.model, prompt="Once upon a time", max_tokens=48, temperature=0.8,
                                   top_p=0.9, seed=0, stream=True, stop=["\n\n"])
for chunk in stream:
    print(chunk.choices[0].text, end="", flush=True)
print()
