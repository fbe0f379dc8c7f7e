"""The `jaxgen` command: one prompt, a resumable batch over JSONL files, the executable cache."""
