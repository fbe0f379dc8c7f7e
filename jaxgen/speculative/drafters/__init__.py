"""Drafters, one module per kind; each honours `jaxgen.core.contracts.Drafter`."""
