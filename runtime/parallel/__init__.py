"""Parallel layouts: ``ParallelLayout`` (TP / PP / EP with redundant experts, attention-DP) and the shard
rules that map a tensor's role and format to the slice a rank keeps."""
