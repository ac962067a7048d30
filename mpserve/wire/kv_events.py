"""KV-cache events as vLLM publishes them (``vllm/distributed/kv_events.py``), which llm-d's KV indexer and Dynamo's
KV router read: which blocks of tokens an instance's KV cache holds, as they come and go.

    engine (``mpserve.engine.kv_events``) ──BlockStored / BlockRemoved / AllBlocksCleared──▶ worker
    worker (``mpserve.worker.kv_publisher``) ──KVEventBatch, msgpack──▶ PUB [topic, seq, payload]; ROUTER replay
    subscriber ──decode_batch──▶ the events ──block_hashes(tokens, key)──▶ the same hashes, computed alone

The format: each event a msgspec Struct encoded as a msgpack array whose first item is its tag (the class name),
then its fields in order (``array_like``, ``tag``), as vLLM's; a batch is ``[ts, events, data_parallel_rank]``,
the rank being the instance's index in its server.

A block is ``BLOCK_SIZE`` consecutive tokens of a slot's cells, from position 0; only whole blocks are told. Its
hash chains over the blocks before it, keyed with the cells' reuse key (``mpserve.wire.salt``), so the same tokens
give the same hash in every instance and host, and tokens computed for another tenant or under adapters give
another. ``block_hash`` is the whole recipe (docs/concepts/kv-events.md gives it for other languages).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

BLOCK_SIZE = 16  # tokens per block
HASH_VERSION = b"mpserve-kv/1\0"
MEDIUM_GPU = "GPU"  # the instance's own KV cells (on the CPU for a model without GPU layers: vLLM's name)
MEDIUM_CPU = "CPU"  # the host store's RAM tier


def block_hash(parent: int | None, tokens: Sequence[int], key: bytes = b"") -> int:
    """The unsigned 64-bit hash of the block ``tokens`` that follows the block hashed ``parent`` (None: the first
    block), under the reuse key ``key``: the first 8 bytes, big-endian, of
    sha256(HASH_VERSION ‖ parent as 8 bytes big-endian (0 for none) ‖ len(key) as 1 byte ‖ key ‖ each token as 4
    bytes big-endian)."""
    data = b"".join((HASH_VERSION, (parent or 0).to_bytes(8, "big"), len(key).to_bytes(1, "big"), key,
                     b"".join(token.to_bytes(4, "big") for token in tokens)))
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def block_hashes(tokens: Sequence[int], key: bytes = b"", start: int = 0, parent: int | None = None) -> list[int]:
    """The hashes of the whole blocks of ``tokens`` from block ``start`` on (``parent``: the hash of block
    ``start - 1``; None when ``start`` is 0)."""
    hashes = []
    for at in range(start * BLOCK_SIZE, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = block_hash(parent, tokens[at:at + BLOCK_SIZE], key)
        hashes.append(parent)
    return hashes


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Any of the three events (a tagged union: the tag is the class name)."""


class BlockStored(KVCacheEvent):
    """Blocks now held, in order: each the child of the one before, the first of ``parent_block_hash`` (None: the
    first block of a sequence); ``token_ids``: all their tokens; ``lora_id``: always None (adapters have no id that
    all instances share; ``lora_name`` names them)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # the adapters' names, joined by "+"; None: the base model


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The instance holds no block (it started, or unloaded its model)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its payload (msgspec.DecodeError for one that is not)."""
    return _DECODER.decode(payload)


def topic(host: str, model: str) -> bytes:
    """llm-d's topic for a pod's events: ``kv@POD@MODEL``."""
    return f"kv@{host}@{model}".encode()
