"""The gateway's APIs: request bodies in, mpserve calls out, answers back in each API's shapes.

    body ──dialect.Pipeline──▶ Dialect.parse (openai, responses, messages) ──▶ openai.Call
        ──▶ chat (template), AsyncClient ──▶ openai.Reply ──▶ the dialect's answer
    body ──embeddings / rerank / tokens.parse──▶ AsyncClient ──▶ their answers (routed by ``app``)

The mappings (``openai``, ``responses``, ``messages``, ``embeddings``, ``rerank``, ``tokens``, ``tools``,
``logprobs``, ``best_of``, ``extensions``) do no I/O; ``dialect`` serves, ``chat`` renders templates in threads
of its own, ``schema`` documents it all.
"""
