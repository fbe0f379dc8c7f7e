"""Training drafters for assisted decoding (optax + orbax): self-distillation data, the
train loop with exact resume, and one module per drafter kind. Not imported by jaxgen itself."""
