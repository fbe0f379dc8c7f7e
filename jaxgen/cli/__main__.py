"""`python -m jaxgen.cli`: the `jaxgen` command."""
from jaxgen.cli.launch import main

raise SystemExit(main())
