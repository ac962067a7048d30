"""An asyncio client sending 16 concurrent requests over one connection.

Start a server first:  mpserve start --instances 4
Then:                  python examples/async_client.py
"""

import asyncio
import time

from mpserve import AsyncClient


async def main() -> None:
    async with AsyncClient(timeout=120) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(client.generate(f"Request number {i}:", max_tokens=64, seed=i)
                                         for i in range(16)))
        elapsed = time.perf_counter() - started
    tokens = sum(r.usage.completion_tokens for r in results)
    workers = sorted({r.worker for r in results})
    print(f"16 requests, {tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.0f} tokens/s) on workers {workers}")


asyncio.run(main())
