"""What a server is told (where a running one is found is ``mpserve.runtime``'s).

    settings      every setting declared once (name, types, range, default, flag, environment, help)
    loader        the configuration built from a YAML file, environment variables and flags
    sizes         memory sizes as settings write them ("24GiB") read into bytes
    kv_types      llama.cpp's KV cache types: names, ggml ids, bytes per element
    speculative   a model's speculative decoding setting
    reasoning     a model's thinking setting: budgets per effort, the close message
    tenants       the tenants section: each tenant's weight, priority ceiling and limits
    remote_tier   the host store's remote tier (cache_remote): a Redis or Valkey address and its password, checked
"""
