"""The project's own models: deterministic random-weight llama GGUFs (``mpserve make-model``, ``builtin:``).

    builtin   what the built-in models are and where they live (finds one without importing gguf or numpy)
    maker     writes them (same arguments, same bytes)
"""
