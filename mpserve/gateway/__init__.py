"""The HTTP gateway process: an OpenAI-compatible API in front of a server. It talks to the server only
through ``mpserve.client`` and ``mpserve.wire.protocol`` (and reads the slot table), never imports llama_cpp.

    app      Starlette routes, API key, streaming, ``serve``
    limits   what a request body may be (413, 408, 400 naming the limit)
    guard    the connections: header timeout, bound on open connections and head size, uvicorn's httptools
             protocol, one write per turn of the event loop
    encode   answers onto the wire: JSON (msgspec) and server-sent events, the events of a step in one send
    access   API keys (also from a file), TLS files, no network port without a key unless --insecure
    schema   the OpenAPI document (``/openapi.json``)
    openai   OpenAI request and response shapes ↔ mpserve requests and results
    embeddings  ``/v1/embeddings`` shapes ↔ ``Client.embed``
    backend  the server as the gateway sees it: one AsyncClient, STATS, the slot table
    metrics  ``/metrics`` (Prometheus)
    monitor  ``/health`` and ``/backend/monitor``
    chat     chat templates rendered into prompts (sandboxed Jinja2, off the event loop, within budgets)
    console  the web console's state (``/console/state``); its page is in static/
    admin    the control API over HTTP (``/admin/``), behind its own key
"""
