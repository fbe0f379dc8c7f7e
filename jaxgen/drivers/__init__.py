"""Host drivers around the compiled programs: chunks for streamers and time limits, the growing
cache, the host prefix hook, and universal assisted decoding rounds."""
