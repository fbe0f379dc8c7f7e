"""`python -m jaxgen`: the `jaxgen` command (the console script's entry point,
jaxgen.cli.launch.main)."""
from jaxgen.cli.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
