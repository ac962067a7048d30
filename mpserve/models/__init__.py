"""The project's own models: deterministic random-weight llama GGUFs (``mpserve make-model``, ``builtin:``).

    shapes    the built-in models' shapes (a leaf: no gguf, no numpy)
    builtin   where they live (finds one without importing gguf or numpy; imports maker only to write one)
    maker     writes them (same arguments, same bytes)
"""
