"""What the gateway's operator sees and does: ``/metrics`` (``metrics``, with the inference
gateway's model-server protocol in ``picker_metrics``), ``/health`` and
``/backend/monitor`` (``monitor``), the web console (``console``, its page in ``static/``), the control API
(``admin``) and llama-server's slot actions (``slots``).

    the slot table, STATS, /proc, NVML ──monitor──▶ health, instances ──▶ metrics, console
    an operator's call ──admin / slots──▶ the server's admin socket (``backend``)
"""
