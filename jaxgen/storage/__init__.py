"""Files jaxgen keeps for the user between runs: private folders and files (`private`), the
user's key for checksums nobody else can forge (`keyed_hash`) and the host CPU that keys what
only this kind of CPU may load (`host_cpu`)."""
