"""hetquant.convert."""
