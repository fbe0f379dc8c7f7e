"""Text in, text out: tokenization, chat templates and decoding around `generate_ids`.

Example (a tiny random model and byte-level tokenizer: the text is noise, its shape is not):
    >>> from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
    >>> tok = tiny_tokenizer()
    >>> model, params = tiny_llama(vocab_size=TINY_VOCAB)
    >>> answers = generate_text(model, params, tok, ["the stop", "a"], max_new_tokens=4)
    >>> len(answers), all(isinstance(a, str) for a in answers)
    (2, True)

With the embedded model (illustration: loads SmolLM2-135M-Instruct):
    >>> import jaxgen
    >>> model, params, tok = jaxgen.models.load("smollm2-135m-instruct")  # doctest: +SKIP
    >>> generate_text(model, params, tok, "What is the capital of France?", chat=True,
    ...               max_new_tokens=16)  # doctest: +SKIP
    ['The capital of France is Paris.']
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxgen import stopping
from jaxgen.api.generate import generate, outputs_to_lists, resolve_config
from jaxgen.config.generation import GenerationConfig
from jaxgen.constraints.compile import resolve_constraint
from jaxgen.core.state import init_state
from jaxgen.drivers.host_arguments import check_host_arguments
from jaxgen.loops.guidance_inputs import guidance_buffer_len


class InvalidLogitsError(RuntimeError):
    """The model produced NaN / inf logits for a prompt (stop reason INVALID_LOGITS).

    `prompts`: the 0-based indices of the prompts whose rows ended that way.
    """

    def __init__(self, message: str, prompts: Sequence[int] = ()):
        super().__init__(message)
        self.prompts = tuple(prompts)


def invalid_logits_prompts(stop_reason, num_prompts: int) -> list[int]:
    """0-based prompt indices whose output rows ended with stopping.INVALID_LOGITS.

    stop_reason: int [R] per output row; R is a multiple of num_prompts (rows of one prompt
    are adjacent, as with num_return_sequences).
    """
    reasons = np.asarray(stop_reason).reshape(-1)
    per_prompt = max(len(reasons) // max(num_prompts, 1), 1)
    bad = np.flatnonzero(reasons == stopping.INVALID_LOGITS) // per_prompt
    return sorted({int(b) for b in bad})


def check_logits_valid(stop_reason, num_prompts: int) -> None:
    """Raises InvalidLogitsError when a row ended with stop reason INVALID_LOGITS."""
    bad = invalid_logits_prompts(stop_reason, num_prompts)
    if bad:
        which = (f"prompt {bad[0]}" if len(bad) == 1 else
                 f"prompts {', '.join(str(b) for b in bad)}")
        raise InvalidLogitsError(
            f"the model produced NaN/inf logits for {which} (stop reason "
            f"{stopping.STOP_REASONS[stopping.INVALID_LOGITS]!r}); its output is garbage: check "
            f"the weights (and try dtype float32)", bad)


def encode_prompts(tokenizer, prompts: str | Sequence[str], *, chat: bool) -> list[list[int]]:
    """Token ids per prompt; with chat=True each prompt is a user turn in the chat template."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts must be a non-empty string or list of strings")
    rows = []
    for prompt in prompts:
        if chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            rows.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                           tokenize=True)))
        else:
            if not isinstance(prompt, str):
                raise ValueError(f"prompts must be strings, got {type(prompt).__name__}")
            rows.append(tokenizer.encode(prompt))
    return rows


def generate_text(model, params, tokenizer, prompts: str | Sequence[str],
                  cfg: GenerationConfig | None = None, *, chat: bool = False, key=None,
                  skip_special_tokens: bool = True, logits_processor=(), stopping_criteria=(),
                  custom_generate=None, assistant_model=None, assistant_tokenizer=None,
                  streamer=None, stop_event=None, timings=None, mesh=None,
                  negative_prompt: str | Sequence[str] | None = None, regex=None,
                  json_schema=None, choices=None, constraint=None,
                  prefix_allowed_tokens_fn=None, layout="auto", truncation: str | None = None,
                  generation_config=None, **overrides: Any) -> list[str]:
    """Generates a continuation per prompt and returns only the new text of each row.

    cfg / generation_config: the config (one of them; `generation_config=` is HF's name): a
    jaxgen.GenerationConfig or a transformers.GenerationConfig (its set fields over the
    model's generation_config.json, as HF resolves it); `overrides` apply on top.
    logits_processor / stopping_criteria: jaxgen's traceable hooks, or transformers'
    LogitsProcessor / StoppingCriteria objects (host calls, once per step; see jaxgen.generate).

    assistant_model: `(model, params)` of a draft model: assisted decoding (jaxgen.generate).
    assistant_tokenizer: the assistant's tokenizer when it differs from `tokenizer`
    (universal assisted decoding).
    mesh: a ("data", "model") jax.sharding.Mesh for the rows and KV cache (see generate_ids).
    streamer: a jaxgen.drivers.streamers streamer (one prompt) or one per prompt; it receives the
    prompt ids first (use skip_prompt=True to hide them), then the new tokens as they come.

    The tokenizer also builds the stop-string tables when cfg.stop_strings is set.

    negative_prompt: classifier-free guidance's unconditional prompt (with guidance_scale
    != 1): one text for every prompt or one per prompt, encoded like the prompts (as a
    user turn when chat=True). Without it the unconditional rows are each prompt's last
    token, as in Hugging Face.

    regex / json_schema / choices: every row's new text matches the regex / is one of the
    choices / is JSON valid against the schema (one of them), with EOS allowed exactly where
    the pattern may end; compiled once per (tokenizer, pattern) into a token automaton
    (jaxgen.constraints.compile) that greedy, sampling, beam search and assisted decoding
    apply inside the compiled loop. constraint: a prebuilt TokenAutomaton;
    prefix_allowed_tokens_fn: Hugging Face's host function (see jaxgen.generate).
    layout: the programs' weight layout (see jaxgen.generate).
    truncation: None (a prompt that does not fit the model's max_position_embeddings with
    max_new_tokens raises jaxgen.core.context.ContextTooLong, naming the prompt, before
    anything is allocated) or "left" (it keeps its last tokens, as transformers' pipelines
    truncate; see jaxgen.init_state).

    Streamers are always ended: `end()`, or `fail(exc)` when generation raised (a consumer
    on another thread then raises instead of waiting).
    Raises InvalidLogitsError (naming the prompt) when the model produced NaN / inf logits
    for a row, rather than returning its garbage text.
    """
    try:
        check_host_arguments(streamer, stop_event)
        cfg = resolve_config(model, cfg, generation_config, **overrides)
        rows = encode_prompts(tokenizer, prompts, chat=chat)
        negative = (None if negative_prompt is None else
                    encode_prompts(tokenizer, negative_prompt, chat=chat))
        constraint = resolve_constraint(model, tokenizer, regex=regex, json_schema=json_schema,
                                        choices=choices, constraint=constraint,
                                        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        state = init_state(model, rows, cfg, key, tokenizer=tokenizer, mesh=mesh,
                           constraint=constraint, truncation=truncation)
        wider = guidance_buffer_len(state, cfg, negative)
        if wider is not None:  # the negative prompts need a longer buffer than the prompts
            state = init_state(model, rows, cfg, key, tokenizer=tokenizer, mesh=mesh,
                               buffer_len=wider, constraint=constraint, truncation=truncation)
    except BaseException as error:  # generate() never ran: end the streamers here
        from jaxgen.drivers.chunked import end_streamers

        end_streamers(streamer, error)
        raise
    out = generate(params, state, cfg,
                   logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                   custom_generate=custom_generate, assistant_model=assistant_model,
                   streamer=streamer, stop_event=stop_event, timings=timings,
                   tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer,
                   negative_prompt_ids=negative,
                   prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, layout=layout)
    check_logits_valid(out.stop_reason, len(rows))
    outputs = outputs_to_lists(out)
    starts = np.asarray(out.prompt_lengths)  # [R] each row's prompt (truncated or not)
    return [tokenizer.decode(full[int(start):], skip_special_tokens=skip_special_tokens)
            for full, start in zip(outputs, starts)]
