"""The HTTP gateway process: an OpenAI-compatible API in front of a server. It talks to the server only
through ``mpserve.client`` and ``mpserve.wire.protocol`` (and reads the slot table), never imports llama_cpp.
Three layers under the composition root, each importing only those below it:

    app ──▶ api (what a request means) ──▶ ops (what the operator sees) ──▶ backend ──▶ http (the connection)

    app                Starlette routes, API key, ``serve``: the layers put together
    fleet              several gateway processes on one port (--http-workers), each started again when it dies
    run                ``mpserve gateway``: one gateway in this process, or a fleet of them; the port's stored
                       responses removed at their clean end
    backend            the server as the gateway sees it: one AsyncClient, STATS, the slot table
    http/              connections and bodies, before any API reads them
      errors           HttpError: an error as an HTTP answer (status, OpenAI's error object, Retry-After)
      guard            the connections: header timeout, bound on open connections and head size, uvicorn's
                       httptools protocol, one write per turn of the event loop
      limits           what a request body may be (413, 408, 400 naming the limit)
      access           API keys (also from a file), TLS files, no network port without a key unless --insecure
      browser          what a web page may make a browser send (Host, Origin, CORS)
      request_ids      each request's ``X-Request-Id``
      encode           answers onto the wire: JSON (msgspec) and server-sent events, the events of a step in one send
      watch            a client that leaves before its answer starts
    api/               the APIs: requests in, answers out
      dialect          the generation pipeline; OpenAI's completions and chat its plain dialect
      openai           OpenAI request and response shapes ↔ mpserve requests and results (``_SAMPLING``: the
                       sampling fields taken)
      responses        OpenAI's Responses API, a dialect, and its stored responses
      response_store   the stored responses: one SQLite file that the gateway processes of a port share
      journal          resumable streams and background responses: their events in that file, read on by id
      messages         Anthropic's Messages API, a dialect
      extensions       llama-server's request fields, mapped or ignored
      tools            tool calls: the tools prompt, forced-call schemas, parsers
      chat             chat templates rendered into prompts (sandboxed Jinja2, off the event loop, within budgets)
      logprobs         log-probabilities in OpenAI's shapes
      best_of          ranking choices for ``best_of``
      embeddings       ``/v1/embeddings`` shapes ↔ ``Client.embed``
      rerank           ``/v1/rerank`` shapes ↔ ``Client.rerank``
      tokens           ``/tokenize`` and ``/detokenize`` shapes
      schema           the OpenAPI document (``/openapi.json``)
    ops/               what the operator sees and does
      metrics          ``/metrics`` (Prometheus)
      picker_metrics   the inference gateway's model-server protocol metrics, for its endpoint picker
      monitor          ``/health`` and ``/backend/monitor``
      console          the web console's state (``/console/state``); its page is in ops/static/
      admin            the control API over HTTP (``/admin/``), behind its own key
      slots            llama-server's ``/slots/ID`` shapes: a slot's KV cells to or from a file
"""
