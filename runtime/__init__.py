"""hetquant.runtime."""
