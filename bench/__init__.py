"""mpserve's benchmarks: every figure measured side by side with a baseline in the same run."""
