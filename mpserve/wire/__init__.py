"""How mpserve's processes talk: the messages, their transport, and what they share in memory.

    protocol   the wire: ``[VERSION, TYPE, BODY]`` frames, msgpack bodies decoded into frozen classes with
               size limits (clients ⇄ broker ⇄ workers)
    zmqio      multipart messages through pyzmq's backend calls (broker, workers, clients)
    prefix     common prefixes, and the block hashes of text prefixes that travel from worker to broker
    slots      the slot table: a shared-memory file of one row per slot (workers write, anyone reads)
"""
