"""Running an artifact: the rank forward over a ``ParallelLayout``, the pipeline between stages, the
collective backends (gloo / nccl / hccl) and ``run_artifact`` behind ``hetquant run``."""
