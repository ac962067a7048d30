"""The child side of the repack probe: do llama.cpp's repacked CPU kernels run on this host?

    mpserve.repack (parent) ──python -m mpserve.engine.repack_check DIR──▶ this process
        write a small f32 llama model into DIR (mpserve.models.maker)
        for each weight type llama.cpp repacks for some CPU:
            print "try TYPE"   (flushed, so the parent knows what was running if this process dies)
            quantize the model to TYPE, load it with repacking on, decode one batch of BATCH tokens
            print "ok TYPE"
        exit 0: every type ran

Repacked kernels that the CPU advertises but cannot run (an AMX that the VM does not grant) kill the process
with SIGSEGV or SIGILL at the first decode of more than one token; a single-token decode takes another path and
passes, so a warm-up of one token proves nothing, and the batch here is several tokens. Nothing of the host's
own models is read: the verdict depends on the CPU and the llama.cpp build only.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import llama_cpp

from mpserve.models.maker import write_shape
from mpserve.models.shapes import ModelShape

# The weight types llama.cpp's CPU backend repacks (x86 AMX and AVX2/AVX-512, ARM NEON and SVE layouts);
# Q4_K_M and Q5_K_M also hold Q6_K tensors.
WEIGHT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "IQ4_NL", "Q4_K_M", "Q5_K_M")
BATCH = 16
# Row lengths a multiple of 256, as the K-quants need; one block keeps each load quick.
SHAPE = ModelShape(n_embd=256, n_layer=1, n_head=4, n_head_kv=4, n_ff=512, n_ctx_train=256, seed=7, dtype="f32")


def check(directory: Path) -> None:
    source = directory / "probe-f32.gguf"
    write_shape(source, "mpserve-repack-probe", SHAPE)
    for name in WEIGHT_TYPES:
        print(f"try {name}", flush=True)
        target = directory / f"probe-{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
        params.nthread = 1
        if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not quantize the probe model to {name}")
        # Llama keeps llama.cpp's default of repacking (use_extra_bufts) on; all layers on the CPU
        llm = llama_cpp.Llama(str(target), n_ctx=64, n_threads=1, n_threads_batch=1, n_gpu_layers=0, verbose=False)
        llm.eval(list(range(10, 10 + BATCH)))
        llm.close()
        print(f"ok {name}", flush=True)


if __name__ == "__main__":
    check(Path(sys.argv[1]))
