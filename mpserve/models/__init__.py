"""The project's own models: deterministic random-weight llama GGUFs (``mpserve make-model``, ``builtin:``).

    maker   writes them (same arguments, same bytes) and finds the built-in ones in the cache
"""
