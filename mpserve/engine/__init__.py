"""The compute core: the only package that imports llama_cpp, and it never imports zmq.

    interface    ``Engine`` (admit / step / cancel), ``Completion``, ``OnToken``, ``BatchStats``: what a worker drives
    batch        ``BatchEngine``: one llama.cpp context decoding ``parallel`` sequences per step; admit / step /
                 cancel, read as the step does: schedule, decode, sample, keep
    settings     ``EngineSettings``: what a ``BatchEngine`` is built with, checked before anything loads
    sequence     a request in its slot (``Sequence``, ``Phase``), prompt chunks, marks and checkpoints
    scheduler    which rows go into the next decodes: decoding sequences, prompt chunks within the budget
    cells        what each slot's KV cells hold: reuse in the slot, copies from another, catching up, twins
    copy_cost    whether a copy of another slot's cells beats computing what they hold: both costs measured
    kv_events    which blocks the slots' cells hold, told as vLLM's KV events since the last time asked
    adapters     LoRA adapters: loaded onto the model, chosen per sequence, applied per step (sets take turns)
    heap         what llama.cpp frees given back to the system once adapter sets change (glibc's mmap threshold)
    parking      a running sequence out of the batch whole, and back where it stopped (priority preemption)
    replay       a resumed request's carried tokens, taken in place of sampling (in runs with ``reuse: any``)
    keeping      when cells are saved to and restored from the host store ("where is a prefix restored")
    live         a generating sequence's cells saved now and then (``reuse: exact``), restored where it is resumed
    context      the llama.cpp context: model, KV memory, decode, state bytes, tokens and pieces
    media        images in a prompt: the projector (llama.cpp's mtmd), decoded images, their placeholder ids
    host_store   the host store: saved sequence states shared by the host's instances, RAM and disk tiers
    store_files  the host store's files: bounded reads, atomic private writes, last-used times
    store_tier   one tier of the host store: a folder of entries with a size, its lock and listing
    store_format the host store's entry layout: an entry's name, its header read and checked
    remote_store the host store's remote tier on Redis or Valkey: lookups checked like local hits, writes queued
    store_stats  the host store's figures and changes, as the worker and the broker hear of them
    slot_file    a slot's cells saved to a file and restored (the slot actions)
    sampling     each sequence's sampler chain and its text (stop strings, UTF-8 pieces)
    grammar      grammar samplers (GBNF, JSON schema), parsed once and cloned per sequence
    ambiguity    a grammar's parse stacks at one step, measured before it is parsed (refused past a bound)
    thinking     thinking, a phase of decoding: free under a token budget, its end tag forced, then the grammar
    logprobs     the log-probabilities a sequence records, packed for the wire
    speculation  speculative decoding: prompt-lookup drafts from a sequence's own tokens, sized, verified
                 with its chain
    draft        a draft model's context: greedy drafts for the sequences that speculate (type draft)
    llama_batch  a llama_batch over numpy arrays, for the model's decodes and the draft model's
    vocab        tokenize and detokenize, a token's bytes
    echo         ``EchoEngine``: answers with the prompt, no model (benchmarks of the serving path)
    embed        ``EmbeddingEngine``: a model served with embedding: true, one pooled vector per input
    model_info   what a loaded model reports about itself (its chat template), loading and freeing it
    repack_check the child side of the repack probe: do llama.cpp's repacked CPU kernels run on this host?
    llama_log    llama.cpp's log as records of ``mpserve.llama``, the known-harmless lines left out
"""
