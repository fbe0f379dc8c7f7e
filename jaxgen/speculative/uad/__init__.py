"""Universal assisted decoding: a drafter with another tokenizer, bridged through text."""
