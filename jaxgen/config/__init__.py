"""Generation settings: `GenerationConfig` (Hugging Face field names, eager validation), the
field checks every setting shares, and the watermarking settings."""
