"""The official OpenAI Python client against mpserve's HTTP gateway: a completion, a streamed chat, and a
refusal in OpenAI's error shape.

Start a server with its gateway:  mpserve start --instances 2 --http 127.0.0.1:8000
(or, beside a running server:    mpserve gateway --http 127.0.0.1:8000)
Then:                             pip install openai && python examples/openai_client.py

With --api-key (or MPSERVE_API_KEY) on the gateway, pass the same key as api_key below.
"""

import os

import openai

client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=os.environ.get("MPSERVE_API_KEY", "none"))

model = client.models.list().data[0].id
completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=32, temperature=0)
print(repr(completion.choices[0].text))
print(f"{completion.usage.completion_tokens} tokens, finish reason {completion.choices[0].finish_reason!r}")

stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=32, temperature=0.7, seed=1,
    stream=True, stream_options={"include_usage": True})
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} generated tokens]")

try:
    client.completions.create(model=model, prompt="hi", n=2)
except openai.BadRequestError as err:
    print(f"refused ({err.status_code}, {err.code}): {err.message}")
