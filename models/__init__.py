"""Model families and checkpoint loaders, imported as `jaxgen.models`."""
