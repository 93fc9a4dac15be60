"""calib/awq.py, the face of the AWQ functions: every name it exported before the split still
imports from it, as the part's own object. The functions are tested beside their parts
(test_awq_quant.py, test_awq_stats.py, test_awq_scale.py, test_awq_clip.py, test_awq_fold.py)."""

from __future__ import annotations

from hetquant.calib import awq, awq_clip, awq_fold, awq_quant, awq_scale, awq_stats


def test_reexports_are_the_parts_own():
    for part in (awq_clip, awq_fold, awq_quant, awq_scale, awq_stats):
        for name in set(part.__all__) & set(awq.__all__):
            assert getattr(awq, name) is getattr(part, name), name
    exported = {"search_scale", "search_clip", "scale_candidates", "activation_mean"}
    exported |= {"weight_mean", "fold_into_norm", "apply_clip", "clip_bounds", "ScaleSearch"}
    assert exported | {"SCALE_EPS", "SCALE_BITS", "TIE_RTOL", "CLIP_BATCH_BYTES"} <= set(
        awq.__all__
    )
