"""The compiled programs (one `jax.jit` per entry), the on-disk executable cache, and the one
seam to hardware backends (`runtime.backend`)."""
