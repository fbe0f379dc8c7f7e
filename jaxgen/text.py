"""Text in, text out: tokenization, chat templates and decoding around `generate_ids`.

Example:
    >>> model, params, tok = jaxgen.models.load("smollm2-135m-instruct")
    >>> generate_text(model, params, tok, "What is the capital of France?", chat=True,
    ...               max_new_tokens=16)
    ['The capital of France is Paris.']
"""
from __future__ import annotations

from typing import Any, Sequence

from jaxgen.config import GenerationConfig
from jaxgen.generate import default_config, generate, outputs_to_lists
from jaxgen.state import init_state


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
                  custom_generate=None, assistant_model=None, streamer=None, stop_event=None,
                  timings=None, **overrides: Any) -> list[str]:
    """Generates a continuation per prompt and returns only the new text of each row.

    assistant_model: `(model, params)` of a draft model: assisted decoding (jaxgen.generate).
    streamer: a jaxgen.streaming streamer (one prompt) or one per prompt; it receives the
    prompt ids first (use skip_prompt=True to hide them), then the new tokens as they come.

    The tokenizer also builds the stop-string tables when cfg.stop_strings is set.
    """
    cfg = default_config(model, cfg, **overrides)
    rows = encode_prompts(tokenizer, prompts, chat=chat)
    out = generate(params, init_state(model, rows, cfg, key, tokenizer=tokenizer), cfg,
                   logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                   custom_generate=custom_generate, assistant_model=assistant_model,
                   streamer=streamer, stop_event=stop_event, timings=timings)
    texts = []
    for prompt, full in zip(rows, outputs_to_lists(out)):
        texts.append(tokenizer.decode(full[len(prompt):], skip_special_tokens=skip_special_tokens))
    return texts
