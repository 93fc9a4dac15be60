"""How serving engines read a recipe's root part: the model card's text (``Recipe.serving``).

Each text is a tuple of Markdown lines; ``{repo}`` stands for the Hub repository id.
"""

from __future__ import annotations

__all__ = ["AWQ", "COMPRESSED_TENSORS", "PLAIN", "VLLM_ASCEND"]

VLLM_ASCEND = (
    "On Ascend NPUs with [vllm-ascend](https://github.com/vllm-project/vllm-ascend), which "
    "reads `quant_model_description.json` (set `--tensor-parallel-size` to your card count):",
    "",
    "```bash",
    "vllm serve {repo} --quantization ascend --tensor-parallel-size 8 --trust-remote-code",
    "```",
    "",
)
PLAIN = (
    "A plain BF16 checkpoint: vLLM (vllm-ascend on Ascend NPUs) and SGLang load it without "
    "a quantization flag (set the parallel size to your card count):",
    "",
    "```bash",
    "vllm serve {repo} --tensor-parallel-size 8 --trust-remote-code",
    "python -m sglang.launch_server --model-path {repo} --tp 8 --trust-remote-code",
    "```",
    "",
)
AWQ = (
    "AutoAWQ GEMM format; vLLM serves DeepSeek AWQ checkpoints through its MoE kernel, "
    "SGLang (also on Ascend NPUs) through its AWQ methods:",
    "",
    "```bash",
    "vllm serve {repo} --quantization moe_wna16 --tensor-parallel-size 8 --trust-remote-code",
    "python -m sglang.launch_server --model-path {repo} --tp 8 --trust-remote-code",
    "```",
    "",
)
COMPRESSED_TENSORS = (
    "compressed-tensors pack-quantized W4A16 experts; vLLM and, on Ascend NPUs, vllm-ascend "
    "(its W4A16 MoE method) detect the format from `config.json`, no edits needed:",
    "",
    "```bash",
    "vllm serve {repo} --tensor-parallel-size 8 --trust-remote-code",
    "```",
    "",
)
