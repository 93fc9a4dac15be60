"""hetquant.calib: calibration data, AWQ search, streaming calibration, accuracy evaluation.

- ``data``: text → token blocks [N, L] with the checkpoint's tokenizer (deterministic rule).
- ``awq``: the AWQ math as pure functions (scale and clip search, folds, AutoAWQ's RTN).
- ``quantizer``: ``Q`` of the objective, per linear: its target format's quantize → dequantize
  (the seam a new format plugs into with nothing but its ``quantize`` / ``dequantize``).
- ``calibrate``: ``calibrate(source, tokens) -> CalibrationResult``, one decoder layer at a time
  (``layer``: one layer's capture and mappings, ``layer_search``: its scale, clip and GPTQ
  searches; ``transforms``: the options and the per-tensor transforms; ``result``: the saved
  result).
- ``eval``: ``evaluate(artifact_forward, reference_forward, tokens)`` and the forwards for it.
- ``forward``: the layer-streamed DeepSeek-V3 forward both use.
"""

from .calibrate import AwqOptions, CalibrationResult, Transform, calibrate, is_quantized_linear
from .data import (
    CALIB_SAMPLES,
    CALIB_SEQ_LEN,
    EVAL_SAMPLES,
    EVAL_SEQ_LEN,
    load_tokenizer,
    token_blocks,
)
from .eval import (
    evaluate,
    forward_from_artifact_dequantized,
    forward_from_calibration,
    reference_forward_from_source,
)
from .quantizer import Quantizer, quantizer_for

__all__ = [
    "CALIB_SAMPLES",
    "CALIB_SEQ_LEN",
    "EVAL_SAMPLES",
    "EVAL_SEQ_LEN",
    "AwqOptions",
    "CalibrationResult",
    "Quantizer",
    "Transform",
    "calibrate",
    "evaluate",
    "forward_from_artifact_dequantized",
    "forward_from_calibration",
    "is_quantized_linear",
    "load_tokenizer",
    "quantizer_for",
    "reference_forward_from_source",
    "token_blocks",
]
