"""What every loop shares: the model and drafter contracts, the decode state, the output,
user extension hooks, and the step pieces (prefill, choose, write, stop flags)."""
