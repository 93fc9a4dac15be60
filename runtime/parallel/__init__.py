"""Parallel layouts: ``ParallelLayout`` (a rank's TP / PP / EP coordinates, redundant experts,
attention-DP), ``placement`` (which bytes of which stored tensor the rank keeps; the one module
where a layout meets a model) and ``pieces`` (how a split follows each format's stored tensors)."""
