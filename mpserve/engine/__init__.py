"""The compute core: the only package that imports llama_cpp, and it never imports zmq.

    interface   ``Engine`` (admit / step / cancel), ``Completion``, ``OnToken``
    batch       ``BatchEngine``: one llama.cpp context decoding ``parallel`` sequences per step
    sampling    each sequence's sampler chain and its text (stop strings, UTF-8 pieces)
    speculation speculative decoding: prompt-lookup drafts from a sequence's own tokens, sized, verified
                with its chain
    draft       a draft model's context: greedy drafts for the sequences that speculate (type draft)
    llama_batch a llama_batch over numpy arrays, for the model's decodes and the draft model's
    echo        ``EchoEngine``: answers with the prompt, no model (benchmarks of the serving path)
    embed       ``EmbeddingEngine``: a model served with embedding: true, one pooled vector per input
    model_info  what a loaded model reports about itself (its chat template)
    llama_log   llama.cpp's log as records of ``mpserve.llama``, the known-harmless lines left out
"""
