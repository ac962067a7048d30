"""What a server is told, and where it is found.

    settings      every setting declared once (name, types, range, default, flag, environment, help)
    loader        the configuration built from a YAML file, environment variables and flags
    kv_types      llama.cpp's KV cache types: names, ggml ids, bytes per element
    speculative   a model's speculative decoding setting
    runtime       where a running server keeps its sockets and description, and how others find it
    private       this user's folders and files in shared places: made 0700/0600, checked, never through a link
"""
