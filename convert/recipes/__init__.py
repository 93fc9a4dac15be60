"""hetquant.convert.recipes."""
