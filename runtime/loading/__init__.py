"""Loading artifacts: ``open_artifact`` (manifest, index and headers only) and ``Artifact.load`` — one
rank's byte ranges, read through private memory maps (CPU) or pinned staging lanes (CUDA)."""
