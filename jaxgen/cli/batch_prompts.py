"""The batch CLI's prompts as token ids: built (chat template or raw text), checked against
the vocabulary and the model's context, truncated from the left when asked.

A record whose prompt plus --max-new-tokens does not fit the model's positions
(jaxgen.core.context) is refused with its file:line in the checking pass, before anything
compiles; with `--truncation left` its prompt keeps its last tokens instead (as
transformers' pipelines do with `truncation_side="left"`).

Example:
    >>> from jaxgen.cli.batch_input import Record
    >>> class Chars:  # a tokenizer: one id per character
    ...     chat_template = None
    ...     def encode(self, text, add_special_tokens=True): return [ord(c) % 50 for c in text]
    >>> rules = PromptRules(use_template=False, no_template_flag=False, vocab_size=50,
    ...                     max_positions=8, max_new_tokens=3, truncation=None)
    >>> record = Record(line=4, index=0, key=("line", 4), data={}, prompt="abcdefg")
    >>> encode_record(Chars(), record, rules)
    (None, 'the prompt (7 tokens) plus --max-new-tokens 3 needs 10 positions; the model has 8 (max_position_embeddings); shorten the prompt, lower --max-new-tokens, or pass --truncation left')
    >>> encode_record(Chars(), record, dataclasses.replace(rules, truncation="left"))
    ([49, 0, 1, 2, 3], None)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxgen.cli.batch_input import Problems, Record
from jaxgen.cli.errors import EXIT_INPUT, EXIT_USAGE, CliError
from jaxgen.core.context import ContextTooLong, check_context, truncate_left

TRUNCATION_CHOICES = ("none", "left")  # --truncation


@dataclasses.dataclass(frozen=True)
class PromptRules:
    """How a record becomes token ids, and what it must satisfy."""

    use_template: bool  # through the tokenizer's chat template
    no_template_flag: bool  # --no-chat-template was given (for the message)
    vocab_size: int
    max_positions: int | None  # the model's max_position_embeddings (None: no limit)
    max_new_tokens: int
    truncation: str | None  # None or "left"


def check_room(rules: PromptRules) -> None:
    """A usage error (exit 2) when --max-new-tokens alone leaves no room for a prompt."""
    if rules.max_positions is not None and rules.max_new_tokens >= rules.max_positions:
        raise CliError(f"--max-new-tokens {rules.max_new_tokens} leaves no room for a prompt in "
                       f"the model's {rules.max_positions} positions (max_position_embeddings); "
                       f"allowed: at most {rules.max_positions - 1}", EXIT_USAGE)


ENCODE_AT_ONCE = 64  # records tokenized per call of the tokenizer's batch encoder


def _texts(tokenizer, records: list[Record], rules: PromptRules):
    """Per record: (the text to tokenize, None) or (None, what is wrong)."""
    found = []
    for record in records:
        if isinstance(record.prompt, list) and not rules.use_template:
            why = "--no-chat-template is set" if rules.no_template_flag else "the model has none"
            found.append((None, (f"'messages' needs the chat template and {why}; give a "
                                 f"'prompt' instead")))
            continue
        if not rules.use_template:
            found.append((record.prompt, None))
            continue
        messages = (record.prompt if isinstance(record.prompt, list)
                    else [{"role": "user", "content": record.prompt}])
        try:
            found.append((tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=False), None))
        except Exception as error:  # a template's raise_exception
            found.append((None, f"cannot build the prompt: {error}"))
    return found


def _encode(tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    """Token ids of many texts: the tokenizer's batch encoder when it has one (what
    tokenizer.encode gives, text by text: with special tokens for a raw prompt, without for
    a rendered chat template)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        return [encoding.ids for encoding in backend.encode_batch(texts,
                                                                  add_special_tokens=special)]
    if special:
        return [list(tokenizer.encode(text)) for text in texts]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def prompt_ids_many(tokenizer, records: list[Record], rules: PromptRules):
    """Per record: (token ids, None) or (None, what is wrong): the whole prompt, checked
    against the vocabulary (not yet against the context)."""
    found = _texts(tokenizer, records, rules)
    todo = [i for i, (text, _) in enumerate(found) if text is not None]
    try:
        rows = _encode(tokenizer, [found[i][0] for i in todo], special=not rules.use_template)
    except Exception:  # one text the tokenizer refuses: find it, one at a time
        rows = []
        for i in todo:
            try:
                rows.extend(_encode(tokenizer, [found[i][0]], special=not rules.use_template))
            except Exception as error:
                rows.append(error)
    answers = [(None, problem) for _, problem in found]
    for i, row in zip(todo, rows):
        if isinstance(row, Exception):
            answers[i] = (None, f"cannot build the prompt: {row}")
        elif not row:
            answers[i] = (None, "the prompt encodes to no tokens")
        elif min(row) < 0 or max(row) >= rules.vocab_size:
            outside = next(t for t in row if not 0 <= t < rules.vocab_size)
            answers[i] = (None, (f"the prompt holds token id {outside}, outside the model's "
                                 f"vocabulary (0..{rules.vocab_size - 1})"))
        else:
            answers[i] = (list(row), None)
    return answers


def prompt_ids(tokenizer, record: Record, rules: PromptRules):
    """(token ids, None) or (None, what is wrong) for one record (see prompt_ids_many)."""
    [answer] = prompt_ids_many(tokenizer, [record], rules)
    return answer


def fit_context(row: list[int], rules: PromptRules):
    """(token ids, None) when the prompt plus --max-new-tokens fits the model's positions
    (with --truncation left: its last tokens that fit), else (None, what is wrong)."""
    if rules.truncation == "left":
        return truncate_left(row, rules.max_positions, rules.max_new_tokens), None
    try:
        check_context(rules.max_positions, [len(row)], rules.max_new_tokens)
    except ContextTooLong:
        needed = len(row) + rules.max_new_tokens
        return None, (f"the prompt ({len(row)} tokens) plus --max-new-tokens "
                      f"{rules.max_new_tokens} needs {needed} positions; the model has "
                      f"{rules.max_positions} (max_position_embeddings); shorten the prompt, "
                      f"lower --max-new-tokens, or pass --truncation left")
    return row, None


def encode_record(tokenizer, record: Record, rules: PromptRules):
    """(token ids, None) or (None, what is wrong) for one record: prompt_ids, fit_context."""
    row, problem = prompt_ids(tokenizer, record, rules)
    return (None, problem) if problem else fit_context(row, rules)


@dataclasses.dataclass
class PromptCheck:
    """What the checking pass found: records checked, prompts truncated (and the first), the
    longest prompt (tokens, after truncation: what sizes the engine's slots)."""

    checked: int = 0
    longest: int = 0
    truncated: int = 0
    first_truncated: int | None = None  # its line


def _groups(records: Iterable[Record], size: int):
    group = []
    for record in records:
        group.append(record)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def check_prompts(tokenizer, records: Iterable[Record], rules: PromptRules,
                  path: str) -> PromptCheck:
    """Every record's prompt built and checked, a few at a time (nothing is kept); CliError
    (exit 4) names file:line of the first bad one and counts the others."""
    check_room(rules)
    problems, found = Problems(), PromptCheck()
    for group in _groups(records, ENCODE_AT_ONCE):
        for record, (row, problem) in zip(group, prompt_ids_many(tokenizer, group, rules)):
            found.checked += 1
            fitted = None
            if not problem:
                fitted, problem = fit_context(row, rules)
            if problem:
                problems.add(record.line, problem)
                continue
            found.longest = max(found.longest, len(fitted))
            if len(fitted) < len(row):
                found.truncated += 1
                if found.first_truncated is None:
                    found.first_truncated = record.line
    problems.raise_if_any(path, EXIT_INPUT)
    return found


def encode_batch(tokenizer, records: list[Record], rules: PromptRules,
                 path: str) -> list[list[int]]:
    """The token ids of a batch (its records were checked by check_prompts)."""
    rows = []
    for record, (row, problem) in zip(records, prompt_ids_many(tokenizer, records, rules)):
        if not problem:
            row, problem = fit_context(row, rules)
        if problem:  # the tokenizer answered otherwise than in the checking pass
            raise CliError(f"{path}:{record.line}: {problem}", EXIT_INPUT)
        rows.append(row)
    return rows


__all__ = [
    "TRUNCATION_CHOICES",
    "PromptCheck",
    "PromptRules",
    "check_prompts",
    "check_room",
    "encode_batch",
    "encode_record",
    "fit_context",
    "prompt_ids",
    "prompt_ids_many",
]
