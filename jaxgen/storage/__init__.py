"""Files jaxgen keeps for the user between runs: private folders and files (`private`) and
the user's key for checksums nobody else can forge (`keyed_hash`)."""
