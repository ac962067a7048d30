"""The gateway's APIs: request bodies in, mpserve calls out, answers back in each API's shapes.

    body ──dialect.Pipeline──▶ Dialect.parse (openai, responses, messages) ──▶ openai.Call
        ──▶ chat (template), AsyncClient ──▶ openai.Reply ──▶ the dialect's answer
    body ──embeddings / rerank / tokens.parse──▶ AsyncClient ──▶ their answers (routed by ``app``)

The mappings do no I/O; ``dialect`` serves, ``chat`` renders templates in threads of its own, ``schema`` documents
it all:

    dialect         the generation pipeline every generating endpoint is a dialect of; resumable streams
    openai          OpenAI's completions and chat completions: bodies in, GenerateParams out, replies back
    responses       OpenAI's Responses API, a translation of chat completions
    response_store  the Responses API's stored responses
    journal         the events of streams that outlive their connection
    messages        Anthropic's Messages API, a translation of chat completions
    chat            chat templates rendered within a budget, off the event loop
    reasoning       thinking: how a request asks for it, how its prompt opens it, the reply's text split
    tools           tools and tool calls
    images          a message's image parts: data URLs read and checked, media markers in its text
    extensions      llama-server's request fields, mapped or dropped
    logprobs        log-probabilities in OpenAI's shapes
    best_of         best_of on completions
    embeddings      /v1/embeddings
    rerank          /v1/rerank
    tokens          /tokenize and /detokenize
    schema          the OpenAPI document
    schema_fields   the fields the document lists beyond each route's own
"""
