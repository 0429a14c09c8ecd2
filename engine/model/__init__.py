"""The network: the decoder, its projections, RoPE, experts, the hot ops, the loader."""
