"""What a worker reports about the model it loaded: its chat template and the token texts templates use.

    llama.cpp model --read_chat_template--> ChatTemplate --READY--> broker --STATS--> gateway (renders it)
"""

from __future__ import annotations

from typing import Any

from mpserve.protocol import ChatTemplate


def read_chat_template(lib: Any, model: Any) -> ChatTemplate:
    """The chat template of a loaded llama.cpp model (``lib`` is the llama_cpp module)."""
    source = lib.llama_model_chat_template(model, None)
    vocab = lib.llama_model_get_vocab(model)

    def text(token: int) -> str:
        return lib.llama_vocab_get_text(vocab, token).decode("utf-8", errors="replace") if token >= 0 else ""

    return ChatTemplate(source.decode("utf-8", errors="replace") if source else "",
                        text(lib.llama_vocab_bos(vocab)), text(lib.llama_vocab_eos(vocab)))
