"""Watermarking as logits processors (green-list and SynthID) and their detectors."""
