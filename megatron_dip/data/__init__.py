"""Multimodal samples, batch metadata, synthetic generators, packing and readers (no torch)."""
