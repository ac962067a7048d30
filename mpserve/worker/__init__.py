"""The worker process: one engine on one device, driven by the broker over a DEALER socket.

    spec    what a worker is started with, its entry ``run``, the fork server's ``preload``: all the server imports
    main    the process entry: environment, sockets, slot-table rows, permits, engine
    zygote  a model's zygote: loads the model's weights once, forks the model's instances (``main`` in each)
    loop    ``Worker``: broker messages in, one engine step per turn, answers out
    link    ``BrokerLink``: heartbeats, registering again, the server watched, an orphan's wait for the next start
    stream  ``ChunkStream``: a streamed request's text gathered into CHUNK messages
    outbox  ``Outbox``: what a turn gathered for the broker, sent as one message (one STEP for several)
    offers  what an instance whose server died offers the next one: its parked requests, its answers sent last
    embed   the answer to EMBED: an embedding engine's vectors
    tokens  the answer to TOKENIZE: the loaded model's vocabulary, between two steps
    slot_files  SLOT_ACTION: an idle slot's KV cells saved to a KV file, restored from one, or erased
    adapter_actions  ADAPTER_ACTION: a LoRA adapter loaded or unloaded, kept across model loads
    spans   with tracing on (``mpserve.tracing``): the prefill and decode spans of each request it ran
    kv_publisher  ``--kv-events``: the instance's KV events on a ZeroMQ PUB socket, and replayed to who missed them
"""
