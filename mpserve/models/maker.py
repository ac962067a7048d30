"""Deterministic random-weight llama models, written as GGUF files.

No model can be downloaded where mpserve is tested, so it writes its own: a plain llama architecture
with random weights and a small SentencePiece-style vocabulary. The text it generates is gibberish,
but it exercises llama.cpp exactly as a real model does, and it costs what a model of its shape costs.

Two properties matter to the serving tests and benchmarks:

- Same arguments, same bytes. Weights come from ``numpy.random.RandomState(seed)`` drawn in a fixed
  order, and the GGUF writer adds nothing time- or host-dependent.
- Clean output. The model never emits ``<unk>``, ``<s>``, ``</s>`` or a byte token, so a request always
  runs to ``max_tokens`` and every token is one visible piece of printable ASCII. How: residual
  dimension 0 is a constant. Every token embedding holds ``_RESIDUAL_CONSTANT`` there, no block writes to
  it (row 0 of ``attn_output`` and ``ffn_down`` is zero) and no block reads it (its norm weights are
  zero). After the final RMS norm it is therefore always positive, so column 0 of ``output.weight``
  acts as a per-token logit bias: ``_SUPPRESSED_LOGIT_WEIGHT`` for every non-printable token, 0 for the
  rest.

A reranker (``tiny-rerank``) is Qwen 3's architecture, the one whose rank head (``cls.output``) llama.cpp
reads beside its BERT family: per-head query and key norms, and the head mapping the last token's state to
the logits of two labels.

A draft model for speculative decoding (``tiny-draft``) is the tiny model cut to its first block: the same
vocabulary, embeddings and output layer, so its greedy choices often, not always, agree with the tiny model's.

Shapes follow numpy order, which is ggml's ``ne`` reversed: a matrix mapping n_in to n_out features is
``(n_out, n_in)`` here and ``ne = [n_in, n_out]`` in llama.cpp.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .shapes import ModelShape, shape_for

_RMS_EPS = 1e-5
_RESIDUAL_CONSTANT = 1.0
_SUPPRESSED_LOGIT_WEIGHT = -1.0e4


@dataclass(frozen=True)
class Token:
    """One vocabulary entry as the GGUF tokenizer metadata lists it."""

    piece: str
    score: float
    kind: gguf.TokenType


RANK_LABELS = ("yes", "no")
"""A reranker's labels (Qwen 3's): llama.cpp's rank pooling softmaxes their logits; the score is the first's."""

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2

# Common English pieces. Each is added together with its prefixes, because the SentencePiece tokenizer in
# llama.cpp only reaches a piece by merging two adjacent pieces that are both in the vocabulary.
_COMMON_PIECES = """
    ▁the ▁and ▁of ▁to ▁in ▁is ▁it ▁that ▁for ▁on ▁with ▁as ▁was ▁he ▁be ▁at ▁by ▁this ▁you ▁not ▁are
    ▁or ▁we ▁his ▁from ▁but ▁have ▁an ▁they ▁which ▁one ▁all ▁a ▁I
    in er on re an en at es ed or ing ion th he ll st nd ly ent ter ation al ar ou is it
""".split()


def vocabulary() -> list[Token]:
    """The token list: ``<unk>``, ``<s>``, ``</s>``, 256 byte tokens, then the printable pieces.

    Longer pieces score higher, so the tokenizer prefers them.
    """
    tokens = [
        Token("<unk>", 0.0, gguf.TokenType.UNKNOWN),
        Token("<s>", 0.0, gguf.TokenType.CONTROL),
        Token("</s>", 0.0, gguf.TokenType.CONTROL),
    ]
    tokens += [Token(f"<0x{byte:02X}>", 0.0, gguf.TokenType.BYTE) for byte in range(256)]
    pieces = [chr(code).replace(" ", "▁") for code in range(0x20, 0x7F)]
    for piece in _COMMON_PIECES:
        pieces += [piece[:end] for end in range(2, len(piece) + 1)]
    pieces = list(dict.fromkeys(pieces))  # drop repeats, keep the first position
    tokens += [Token(piece, float(len(piece)), gguf.TokenType.NORMAL) for piece in pieces]
    return tokens


def write_model(path: str | os.PathLike[str], size: str = "tiny", chat_template: str | None = None) -> Path:
    """Write the ``size`` model to ``path`` atomically and return the path. ``chat_template``: a Jinja2
    chat template to store as ``tokenizer.chat_template`` (the built-in models have none).

    The file appears complete or not at all: it is written to a temporary file in the same directory
    and moved into place with ``os.replace``. Two processes writing the same model race harmlessly,
    since both write the same bytes.
    """
    shape = shape_for(size)
    return write_atomically(Path(path), lambda tmp: write_shape(tmp, f"mpserve-{size}", shape, chat_template))


def write_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """``write`` a file to a temporary path beside ``target``, then move it into place: ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        tmp.chmod(0o644)  # mkstemp creates 0600; a model file is not a secret
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def write_shape(path: Path, name: str, shape: ModelShape, chat_template: str | None = None) -> None:
    """A model of any ``shape`` written to ``path`` as it is (``write_model`` writes the built-in sizes atomically)."""
    tokens = vocabulary()
    writer = gguf.GGUFWriter(path, "qwen3" if shape.pooling == "rank" else "llama")
    writer.add_name(name)
    writer.add_file_type(
        gguf.LlamaFileType.MOSTLY_F16 if shape.dtype == "f16" else gguf.LlamaFileType.ALL_F32
    )
    writer.add_vocab_size(len(tokens))
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.written_layers)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
    writer.add_layer_norm_rms_eps(_RMS_EPS)
    if shape.pooling == "mean":
        writer.add_pooling_type(gguf.PoolingType.MEAN)
    elif shape.pooling == "rank":
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_classifier_output_labels(list(RANK_LABELS))

    writer.add_tokenizer_model("llama")
    writer.add_token_list([token.piece for token in tokens])
    writer.add_token_scores([token.score for token in tokens])
    writer.add_token_types([token.kind for token in tokens])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    printable = np.array([token.kind == gguf.TokenType.NORMAL for token in tokens])
    for tensor_name, tensor in _weights(shape, printable):
        writer.add_tensor(tensor_name, tensor)
    finish(writer)


def finish(writer: gguf.GGUFWriter) -> None:
    """Write out what ``writer`` was given: header, metadata, tensors; then close it."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _weights(shape: ModelShape, printable: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """All tensors in file order, drawn from one RandomState in that same order.

    Matrices are scaled by 1/sqrt(fan_in) so activations stay near unit size; the projections that add
    into the residual stream are scaled down further by 1/sqrt(2 * n_layer), as in GPT-2, so the stream
    does not grow with depth. The final hidden state is RMS-normed, so logits come out with a standard
    deviation near 1 and sampling temperatures mean what they usually do.
    """
    rng = np.random.RandomState(shape.seed)
    matrix_type = np.float16 if shape.dtype == "f16" else np.float32
    n_embd, n_ff = shape.n_embd, shape.n_ff
    n_embd_kv = n_embd // shape.n_head * shape.n_head_kv
    residual_scale = 1.0 / np.sqrt(2 * shape.n_layer)

    def matrix(n_out: int, n_in: int, *, writes_residual: bool = False) -> np.ndarray:
        weight = rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)
        if writes_residual:
            weight *= residual_scale
            weight[0, :] = 0.0  # nothing writes residual dimension 0
        result: np.ndarray = weight.astype(matrix_type)
        return result

    def norm() -> np.ndarray:
        weight = np.ones(n_embd, dtype=np.float32)
        weight[0] = 0.0  # blocks do not read residual dimension 0 either
        return weight

    embedding = rng.standard_normal((len(printable), n_embd))
    embedding[:, 0] = _RESIDUAL_CONSTANT
    yield "token_embd.weight", embedding.astype(matrix_type)

    for layer in range(shape.n_layer):  # every block drawn, so a draft's output layer is its full model's
        block = f"blk.{layer}"
        tensors = [
            (f"{block}.attn_norm.weight", norm()),
            (f"{block}.attn_q.weight", matrix(n_embd, n_embd)),
            (f"{block}.attn_k.weight", matrix(n_embd_kv, n_embd)),
            (f"{block}.attn_v.weight", matrix(n_embd_kv, n_embd)),
            (f"{block}.attn_output.weight", matrix(n_embd, n_embd, writes_residual=True)),
            (f"{block}.ffn_norm.weight", norm()),
            (f"{block}.ffn_gate.weight", matrix(n_ff, n_embd)),
            (f"{block}.ffn_up.weight", matrix(n_ff, n_embd)),
            (f"{block}.ffn_down.weight", matrix(n_embd, n_ff, writes_residual=True)),
        ]
        if shape.pooling == "rank":  # Qwen 3 norms each head's queries and keys
            head = n_embd // shape.n_head
            tensors += [(f"{block}.attn_q_norm.weight", np.ones(head, np.float32)),
                        (f"{block}.attn_k_norm.weight", np.ones(head, np.float32))]
        if layer < shape.written_layers:
            yield from tensors

    yield "output_norm.weight", np.ones(n_embd, dtype=np.float32)
    output = matrix(len(printable), n_embd)
    output[:, 0] = np.where(printable, 0.0, _SUPPRESSED_LOGIT_WEIGHT)  # exact in f16 too
    yield "output.weight", output
    if shape.pooling == "rank":  # the rank head: the last token's state to one logit per label
        yield "cls.output.weight", matrix(len(RANK_LABELS), n_embd)
