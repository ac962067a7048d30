"""Models: the project's own (deterministic random-weight llama GGUFs, ``mpserve make-model``, ``builtin:``),
those named on the Hugging Face Hub or in Ollama's store, and the chat template each is served with.

    shapes     the built-in models' shapes (a leaf: no gguf, no numpy)
    builtin    where they live (finds one without importing gguf or numpy; imports maker only to write one)
    maker      writes them (same arguments, same bytes)
    mmproj_maker random image projectors for the built-in models (``make-model --mmproj``; same arguments, same bytes)
    audio_maker random audio projectors (Whisper-style encoders) for them (``make-model --mmproj --audio``)
    projector  a model's image projector checked against the model from the two headers (refused with one line)
    lora_maker random LoRA adapters for a given base GGUF (``make-model --lora-for``; same arguments, same bytes)
    lora_file  a LoRA adapter GGUF checked against its model from the two headers (refused with one line)
    adapters   a model's declared adapters (models[].adapters, --lora): parsed in order, checked by lora_file
    sources    a model path that names the Hub or Ollama: checked, pulled, found on this host
    hub        the Hub: names as llama-server's -hf, the choice of file, the cache, a host-wide lock per file
    download   one file over HTTP: resumed, checked against its sha256, moved into place when right
    progress   a download's bar on a terminal, a log line per tenth elsewhere
    ollama     Ollama's store: a manifest's GGUF blob and template
    folder     a models directory (``models_dir``): its GGUF files served by file stem
    templates  the chat template a model is served with: the setting, the GGUF's, its family's
    tool_families  the chat templates of the families whose tool calls have a format of their own (gpt-oss, …)
    gguf_header  a GGUF file's metadata and tensor table, read without the tensor data
"""
