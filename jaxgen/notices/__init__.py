"""Announcements a lower floor makes for a higher one to act on, standard library only (the
facade installs its listeners without loading jax): `model_loads` (a model is loading)."""
