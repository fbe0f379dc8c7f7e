"""XLA:CPU: native few-row kernels, weight layouts split per layer, kernel matrices, the cache
split per layer, and the constants tuned on CPU hosts. Reached through `prepare` in
`jaxgen.backends.cpu.prepare`, which `jaxgen.runtime.backend` calls."""
