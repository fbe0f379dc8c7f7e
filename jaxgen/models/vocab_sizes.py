"""The model's vocabulary against its tokenizer's, checked once when a model is loaded.

A model whose vocabulary (the rows of its embedding / head) is larger than its tokenizer's
can generate ids the tokenizer has no token for. We decode those as transformers does:
`tokenizers` skips an id it cannot map, so such an id decodes to nothing (and
`convert_ids_to_tokens` gives None for it); the generated ids keep it. Padded vocabularies
are common (a multiple of 64 or 128 rows), and a trained model rarely picks a padding row,
so this is a warning, not an error - one line, once per (model, sizes), naming both sizes
and what happens to the extra ids.

Example:
    >>> import warnings
    >>> from jaxgen.models import tiny_tokenizer
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     message = warn_if_model_vocab_larger(300, tiny_tokenizer(), "tiny")
    ...     again = warn_if_model_vocab_larger(300, tiny_tokenizer(), "tiny")
    >>> len(caught), message == str(caught[0].message), again == message
    (1, True, True)
    >>> print(message)
    jaxgen: model 'tiny' has a vocabulary of 300 ids but its tokenizer only 261: ids 261..299 decode to nothing (as in transformers; the generated ids keep them)
"""
from __future__ import annotations

import threading
import warnings

_WARNED: set[tuple] = set()
_LOCK = threading.Lock()


def warn_if_model_vocab_larger(model_vocab: int, tokenizer, name: str) -> str | None:
    """Warns (RuntimeWarning, once per name and sizes) when the model has more ids than the
    tokenizer (len(tokenizer): its vocabulary with the added tokens); returns the message,
    or None when the tokenizer covers the model's vocabulary."""
    size = len(tokenizer)
    if int(model_vocab) <= size:
        return None
    message = (f"jaxgen: model {name!r} has a vocabulary of {int(model_vocab)} ids but its "
               f"tokenizer only {size}: ids {size}..{int(model_vocab) - 1} decode to nothing "
               f"(as in transformers; the generated ids keep them)")
    with _LOCK:
        first = (name, int(model_vocab), size) not in _WARNED
        _WARNED.add((name, int(model_vocab), size))
    if first:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return message


__all__ = ["warn_if_model_vocab_larger"]
