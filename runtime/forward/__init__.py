"""Reference forwards built on loaded shards: the decoder layers, MoE routing and RoPE of each supported
model family."""
