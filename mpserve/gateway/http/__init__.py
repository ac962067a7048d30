"""The gateway's HTTP layer: connections (``guard``), bodies (``limits``), who may call (``access``,
``browser``), request ids, errors as HTTP answers (``errors``), the encoding of answers (``encode``) and a
client that leaves (``watch``). It knows no API: the layers above (``api``, ``ops``, ``app``) use it.

    socket ──guard──▶ uvicorn ──▶ request_ids ──▶ browser ──▶ (app's key check) ──▶ a route
    a route ──limits.read_json──▶ a body, or Refused(HttpError) ──▶ encode ──▶ socket
"""
