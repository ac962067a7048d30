"""The gateway's HTTP layer: connections (``guard``), bodies (``limits``), who may call (``access``,
``browser``), request ids, the one key a request carries and its tenant (``keys``), errors as HTTP answers
(``errors``), the encoding of answers (``encode``) and a client that leaves (``watch``). It knows no API: the
layers above (``api``, ``ops``, ``app``) use it.

    socket ──guard──▶ uvicorn ──▶ request_ids ──▶ keys (one key header) ──▶ browser ──▶ (app's key check) ──▶ route
    keys   the one key header a request carries (400 otherwise), its tenant, ids under the tenant's tag
    trace  with tracing on (``mpserve.tracing``): the span of each HTTP exchange, under the caller's traceparent
    a route ──limits.read_json──▶ a body, or Refused(HttpError) ──▶ encode ──▶ socket
"""
