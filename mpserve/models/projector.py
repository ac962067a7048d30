"""A model's projector (``mmproj``: of images, of audio or both) checked against the model at start, from both files'
headers:

    mmproj.gguf ──read_header──▶ general.architecture "clip", a vision or an audio encoder, clip.{vision,audio}.
                                 projection_dim
    model.gguf  ──read_header──▶ {architecture}.embedding_length
                ──▶ ConfigError, one line naming the setting and what does not match, or nothing

llama.cpp checks the same when an instance loads the pair (the projector's output width against the model's
embedding width), but there the error ends an instance in its log; here it stops the start with one line.
"""

from __future__ import annotations

from mpserve.errors import ConfigError


def check(projector: str, model: str, where: str) -> None:
    """ConfigError naming ``where`` unless the GGUF at ``projector`` is an image or audio projector whose embeddings
    are as wide as the model's at ``model``. Imported here: reading a GGUF takes numpy and gguf, which the server's
    and the gateway's processes never load."""
    from .gguf_header import read_header

    try:
        own = read_header(projector, lambda key: key.startswith(("general.architecture", "clip."))).metadata
        base = read_header(model, lambda key: key == "general.architecture" or key.endswith(".embedding_length"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot read {projector!r} as a GGUF projector: {exc}") from None
    if own.get("general.architecture") != "clip" or not (own.get("clip.has_vision_encoder")
                                                          or own.get("clip.has_audio_encoder")):
        raise ConfigError(f"{where}: {projector!r} is not an image or audio projector (a clip GGUF with a vision or "
                          "an audio encoder, as llama.cpp's mmproj files are)")
    width = own.get("clip.vision.projection_dim", own.get("clip.audio.projection_dim"))
    n_embd = base.metadata.get(f"{base.metadata.get('general.architecture')}.embedding_length")
    if width is not None and n_embd is not None and width != n_embd:
        raise ConfigError(f"{where}: the projector {projector!r} makes embeddings of {width} values and the model's "
                          f"are {n_embd}: it belongs to another model")
