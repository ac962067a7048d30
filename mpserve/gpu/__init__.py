"""GPUs on this host, shared by every process that imports it (no llama_cpp, no sockets).

    devices    discovery: NVML, then nvidia-smi, or simulated devices; memory sizes
    placement  which instance goes on which device, and refusal of what does not fit
    permits    host-wide, crash-safe permits per GPU (open-file-description byte-range locks)
    memory     live GPU memory from NVML: per device and per process; the estimate checked against it
"""
