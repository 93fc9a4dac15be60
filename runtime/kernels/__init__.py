"""Quantized linear ops: ``QuantLinear`` and the (format, backend) kernel registry, the cpu / cuda / npu
backends, the CPU emulation of torch_npu's op contracts, and the native INT4 GEMV."""
