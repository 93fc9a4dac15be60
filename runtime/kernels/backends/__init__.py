"""Device backends of ``runtime.ops``: importing this package registers every kernel.

``cpu`` holds the portable kernels (and the helpers ``cuda`` reuses on CUDA tensors); ``npu`` calls
torch_npu operators the way vllm-ascend, sglang and chitu do.
"""

from . import cpu, cuda, npu  # noqa: F401  (registration)
