"""Device backends of ``runtime.ops``: importing this package registers every kernel.

``cpu`` holds the portable kernels (and the helpers ``cuda`` reuses on CUDA tensors); ``npu`` calls
torch_npu operators the way vllm-ascend, sglang and chitu do.
"""

from . import cpu, cuda, npu, w4a8  # noqa: F401  (registration)
