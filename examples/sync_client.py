"""A synchronous client: one request, then one streamed request.

Start a server first:  mpserve start --instances 2
Then:                  python examples/sync_client.py
"""

from mpserve import Client

with Client(timeout=60) as client:
    result = client.generate("Once upon a time", max_tokens=32, temperature=0)
    print(repr(result.text))
    print(f"{result.usage.completion_tokens} tokens, finish reason {result.finish_reason!r}, served by {result.worker}")

    stream = client.stream("The quick brown fox", max_tokens=32, temperature=0.7, seed=1)
    for text in stream:
        print(text, end="", flush=True)
    print(f"\n[{stream.result.finish_reason}]")
