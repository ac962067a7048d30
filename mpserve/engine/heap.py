"""Large blocks of host memory in mappings of their own, so that what llama.cpp frees goes back to the system.

    Adapters.apply, the first change of LoRA adapters ──keep_large_blocks_mapped()──▶ mallopt(M_MMAP_THRESHOLD,
                                                                                     MMAP_THRESHOLD)

glibc's malloc gives a block of at least M_MMAP_THRESHOLD bytes a mapping of its own, unmapped when freed; but when
such a block is freed it raises the threshold to that block's size (up to 32 MiB), and from then on blocks of that
size come from the heap, whose freed space the process keeps. llama.cpp frees and allocates its graph, scheduler and
compute buffers each time it reserves them, which it does on every change of LoRA adapters
(``llama_set_adapters_lora``): with the threshold moving, an instance's heap grew with each adapter set it ran, in
private pages. Setting the threshold fixes it (glibc stops adjusting it) at the value glibc starts with; a process
that never changes adapters keeps glibc's adjusting (which spares it a mapping per large block it allocates again and
again). Elsewhere than glibc (no ``mallopt``) this does nothing.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold


def keep_large_blocks_mapped() -> bool:
    """Whether the C library took the fixed threshold."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
