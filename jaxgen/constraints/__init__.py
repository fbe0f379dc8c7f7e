"""Constrained decoding: a regex / JSON schema compiled to a token automaton of arrays."""
