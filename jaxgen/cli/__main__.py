"""`python -m jaxgen.cli`: the `jaxgen` command."""
from jaxgen.cli.main import main

raise SystemExit(main())
