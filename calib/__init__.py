"""hetquant.calib."""
