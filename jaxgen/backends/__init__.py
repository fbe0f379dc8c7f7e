"""Hardware backends. Only `jaxgen.runtime.backend` imports them; the path a GPU or TPU runs
needs none."""
