"""What reporting token ids with every CHUNK (so a stream can be handed over mid-way) costs per CHUNK, at
one token per CHUNK (``--stream-interval 0``, the worst case):

    worker   the ids noted since the last CHUNK, packed as a TOKENS frame (``protocol.token_frame``)
    wire     the fifth frame: a worker->broker CHUNK over ipc, DEALER to ROUTER, with and without it
    broker   the frame appended to the request's ids

The baseline is the same CHUNK without the frame. The two wire figures are measured in alternating
rounds and the fastest round of each is kept, so that a busy machine disturbs both alike. Run::

    python -m bench.token_report [n]
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from mpserve.wire import protocol as wire

ROUNDS = 5


def _per_call_us(fn: Callable[[], object], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def measure(n: int = 100_000) -> dict[str, float]:
    """Microseconds per CHUNK."""
    generated = list(range(1000))
    frame = wire.token_frame(generated[500:501])
    ids = bytearray()

    def append() -> None:
        ids.extend(frame)

    figures = {"pack_us": _per_call_us(lambda: wire.token_frame(generated[500:501]), n),
               "append_us": _per_call_us(append, n)}
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{Path(tmp) / 'chunks.sock'}"
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        router.bind(address)
        dealer.connect(address)
        chunk = wire.encode_from_worker(wire.Chunk("1a2b.3", " word"), "1f")
        with_tokens = [*chunk, frame]

        def round_trip(frames: list[bytes]) -> Callable[[], object]:
            return lambda: (dealer.send_multipart(frames), router.recv_multipart())

        round_trip(chunk)()  # connected
        rounds = n // ROUNDS
        without: list[float] = []
        with_frame: list[float] = []
        for _ in range(ROUNDS):
            without.append(_per_call_us(round_trip(chunk), rounds))
            with_frame.append(_per_call_us(round_trip(with_tokens), rounds))
        figures |= {"ipc_chunk_us": min(without), "ipc_chunk_with_tokens_us": min(with_frame)}
        router.close(0)
        dealer.close(0)
    ctx.term()
    return figures


def main() -> None:
    f = measure(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
    print(f"per CHUNK of one token: pack {f['pack_us']:.2f} us (worker), append {f['append_us']:.2f} us (broker); "
          f"ipc send+receive {f['ipc_chunk_us']:.2f} us without the TOKENS frame, "
          f"{f['ipc_chunk_with_tokens_us']:.2f} us with it")


if __name__ == "__main__":
    main()
