"""The compiled decoding loops: plain (greedy / sampling), beam search, classifier-free guidance.
The assisted loop lives in `jaxgen.speculative`."""
