"""The CPU expert pool: routed experts of ``cpu_experts/`` memory-mapped, split into subpools of
threads, each expert run by the INT4 GEMV."""
