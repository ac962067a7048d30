"""How mpserve's processes talk: the messages, their transport, and what they share in memory.

    protocol   the wire as callers import it: messages and framing in one name (clients ⇄ broker ⇄ workers)
    messages   every body a frozen msgspec Struct: fields with their limits, the rules across them (``check``);
               ``GenerateParams`` is where each sampling parameter is declared
    framing    ``[VERSION, TYPE, BODY]`` frames, STEP/CHUNKS/ASSIGNS batches, decoding each body once
    refusals   msgspec's verdict on a bad body as a BadRequest or ProtocolError naming field, value and range
    zmqio      multipart messages through pyzmq's backend calls (broker, workers, clients)
    media      images as they travel: data URLs, their headers checked against the limits, the media marker
    audio      audio clips as they travel among the images: told by their first bytes, their seconds from the header
    prefix     common prefixes, and the block hashes of text prefixes that travel from worker to broker
    salt       a request's cache key, one path in three hops: the gateway's fallback salt, the broker's salt of
               tenant, cache_salt and adapter set, the engine's key with the adapters' loads (tenants kept apart)
    adapters   a request's LoRA adapters: BASE:NAME, llama-server's lora ids, one sorted set, the 404 naming those
    slots      the slot table: a shared-memory file of one row per slot (workers write, anyone reads)
    figures    the figures STATS carries per model and per tenant (dataclasses: a newer server's extra fields dropped)
    kv_events  KV-cache events in vLLM's format (stored, removed, cleared blocks), their block size and hash
"""
