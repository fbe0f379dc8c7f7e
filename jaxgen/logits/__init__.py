"""The logits processor chain (Hugging Face order), the sampling warpers, token selection, and
watermarking."""
