"""A self-distillation corpus the default model writes itself: prompts of many kinds, then
its own answers to them (greedy and sampled), appended in chunks so a run resumes where it
stopped.

Stage "prompts": first every templated request (TEMPLATES: a few phrasings of each kind for
each topic); then, for slot i, a (topic, kind) pair from the seed lists below is drawn by a
seeded shuffle; the model is asked, in a chat turn, to write one user request of that kind
on that topic (sampled, T = 0.6, top-p 0.9). A reply is kept when it ended (EOS within 80 tokens) and, cleaned to its first paragraph, it is
12-400 characters, new (case-insensitive) and not one of the held-out prompts
(`data/prompts_heldout.jsonl`, never trained on). prompts.jsonl gets
{"slot": i, "topic", "kind", "prompt"} per kept reply.

Stage "answers": every kept prompt is answered with the chat template, once greedily and
once at T = 0.7; answers.jsonl gets {"slot", "greedy": ids, "sampled": ids} (prompt + answer
token ids, EOS kept). `jaxgen.train.distill_data` turns them into hidden states.

Both files are appended a chunk at a time (flushed and fsynced); a run counts what is there
and goes on, so killing it loses at most one chunk:

    nice -n 19 python -m jaxgen.train.self_corpus --out data/self_corpus --prompts 20000

Example (the seed lists; a tiny run needs the default model, so it is not shown):
    >>> len(TOPICS) * len(KINDS) >= 2000, slot_seed(0, 5) == slot_seed(0, 5)
    (True, True)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

from jaxgen.train.distill_data import PROMPTS_DIR, read_prompts

TOPICS = (
    "the water cycle", "volcanoes", "black holes", "photosynthesis", "the Roman Empire",
    "the French Revolution", "world war one", "ancient Egypt", "the printing press",
    "the internet", "electric cars", "solar panels", "wind energy", "climate change",
    "recycling", "coral reefs", "rainforests", "deserts", "honeybees", "whales", "octopuses",
    "dogs", "cats", "houseplants", "gardening", "composting", "bread baking", "coffee", "tea",
    "chocolate", "pasta", "vegetarian cooking", "meal planning", "running", "swimming",
    "yoga", "sleep", "stress", "meditation", "friendship", "job interviews", "resumes",
    "public speaking", "time management", "budgeting", "saving money", "credit cards",
    "renting an apartment", "moving to a new city", "learning a language", "reading habits",
    "libraries", "poetry", "jazz", "the guitar", "the piano", "photography", "painting",
    "chess", "board games", "video games", "football", "basketball", "the Olympics",
    "mountain hiking", "camping", "road trips", "train travel", "airports", "Japan", "Italy",
    "Brazil", "Kenya", "Canada", "the Moon", "Mars", "the Sun", "comets", "telescopes",
    "microscopes", "vaccines", "the immune system", "the heart", "the brain", "vitamins",
    "dinosaurs", "evolution", "DNA", "atoms", "electricity", "magnets", "gravity",
    "light and colour", "sound waves", "weather forecasts", "earthquakes", "tides",
    "Python programming", "JavaScript", "SQL databases", "sorting algorithms", "recursion",
    "unit testing", "git", "linked lists", "hash tables", "regular expressions", "web servers",
    "machine learning", "spreadsheets", "passwords and security", "email etiquette",
    "fractions", "percentages", "probability", "prime numbers", "geometry", "statistics",
    "compound interest", "unit conversion", "a birthday party", "a school science fair",
    "a small bakery", "a bicycle repair", "a lost umbrella", "a rainy afternoon",
    "a city park", "a neighbourhood festival", "a team project", "a customer complaint",
)

# kind -> how the model is asked to write a request of that kind about {topic}
KINDS = {
    "question": "a short factual question someone might ask about {topic}",
    "explain": "a request asking for a simple explanation of {topic} for a beginner",
    "how-to": "a request asking how to do something practical related to {topic}",
    "list": "a request asking for a list of ideas or facts about {topic}",
    "compare": "a question asking to compare two things related to {topic}",
    "advice": "a message asking for personal advice about {topic}",
    "story": "a request for a very short story involving {topic}",
    "poem": "a request for a short poem about {topic}",
    "email": "a request to draft a short email about {topic}",
    "rewrite": "a request to rewrite one given sentence about {topic} more formally (include "
               "the sentence)",
    "summarise": "a short paragraph about {topic} followed by a request to summarise it in one "
                 "sentence",
    "code": "a request to write a small Python function related to {topic}",
    "math": "a short math word problem involving {topic}",
    "define": "a question asking what a term related to {topic} means",
    "pros-cons": "a request for the pros and cons of something related to {topic}",
    "plan": "a request to make a simple plan or schedule involving {topic}",
    "opinion": "a question asking for a balanced opinion on something about {topic}",
    "chat": "a friendly casual chat message mentioning {topic}",
    "classify": "a request to sort a few given items related to {topic} into groups "
                "(include the items)",
    "fix": "a short piece of text about {topic} with a mistake, and a request to correct it",
}


# kind -> phrasings of a request of that kind about {topic}, used as they are
TEMPLATES = {
    "question": ("What is the most important thing to know about {topic}?",
                 "Can you tell me an interesting fact about {topic}?",
                 "Why does {topic} matter?", "Where can I learn more about {topic}?"),
    "explain": ("Explain {topic} to a beginner.", "How would you explain {topic} to a child?",
                "Give me a simple explanation of {topic}.",
                "What is {topic}, in plain words?"),
    "how-to": ("How do I get started with {topic}?", "What are the first steps to learn about "
               "{topic}?", "How can I get better at {topic}?",
               "Give me step-by-step instructions for a beginner project about {topic}."),
    "list": ("List five facts about {topic}.", "Give me three ideas related to {topic}.",
             "What are some common mistakes people make with {topic}?",
             "Name four words associated with {topic}."),
    "compare": ("Compare {topic} today with {topic} fifty years ago.",
                "How is {topic} different in cities and in the countryside?",
                "What do experts and beginners see differently about {topic}?",
                "Compare two popular views about {topic}."),
    "advice": ("I'm nervous about {topic}. Any advice?",
               "My friend wants to get into {topic}. What should I tell them?",
               "What advice would you give someone new to {topic}?",
               "How do I stay motivated with {topic}?"),
    "story": ("Write a four-sentence story about {topic}.",
              "Tell me a short bedtime story that involves {topic}.",
              "Write a funny short story about {topic}.",
              "Write a story about {topic} that ends with a surprise."),
    "poem": ("Write a short poem about {topic}.", "Write a haiku about {topic}.",
             "Write a limerick about {topic}.", "Write a four-line rhyming poem about {topic}."),
    "email": ("Write a short email to a friend about {topic}.",
              "Draft a polite email asking a colleague for help with {topic}.",
              "Write an email inviting my team to a talk about {topic}.",
              "Write a thank-you note that mentions {topic}."),
    "rewrite": ("Rewrite this sentence more formally: I think {topic} is kind of cool.",
                "Make this sentence shorter: There are many different things that people "
                "should know when they start learning about {topic}.",
                "Rewrite this in a friendly tone: Information about {topic} is attached.",
                "Fix the grammar: {topic} are something what many people enjoys."),
    "summarise": ("Summarise in one sentence why people care about {topic}.",
                  "Give me a two-sentence summary of {topic}.",
                  "Summarise the history of {topic} briefly.",
                  "What are the key points about {topic}, in a short summary?"),
    "code": ("Write a Python function that stores notes about {topic} in a list.",
             "Write a Python class that represents {topic} with two attributes.",
             "Write a Python function that counts words in a text about {topic}.",
             "Write a short Python script that prints three facts about {topic}."),
    "math": ("Make up a simple math word problem about {topic} and solve it.",
             "If 12 people each spend 3 hours on {topic} a week, how many hours is that in "
             "total?", "A class of 30 students votes on {topic}; 40% say yes. How many say yes?",
             "Give me a percentage problem about {topic} with its answer."),
    "define": ("Define {topic} in one sentence.", "What does the word '{topic}' mean?",
               "What are the key terms I should know about {topic}?",
               "Give me a dictionary-style definition of {topic}."),
    "pros-cons": ("What are the pros and cons of {topic}?",
                  "Give me two advantages and two disadvantages of {topic}.",
                  "Is {topic} worth the effort? Give both sides.",
                  "What are the benefits and risks of {topic}?"),
    "plan": ("Make a one-week plan to learn about {topic}.",
             "Plan a short afternoon around {topic}.",
             "Create a simple checklist for {topic}.",
             "Suggest a schedule for a study group on {topic}."),
    "opinion": ("What do you think about {topic}?", "Is {topic} overrated?",
                "What is the best thing about {topic}?",
                "Would you recommend {topic} to a friend? Why?"),
    "chat": ("Hi! I've been reading about {topic} lately.", "Hey, do you like {topic}?",
             "Good morning! Tell me something about {topic}.",
             "I just had a great day thanks to {topic}!"),
    "classify": ("Is {topic} more about science, art or daily life?",
                 "Sort these into two groups: {topic}, apples, rivers, jazz, laptops.",
                 "Which category does {topic} belong to?",
                 "Classify {topic} as hobby, science, place or event."),
    "fix": ("Correct this sentence: {topic} have been invent in 1990 by nobody.",
            "What is wrong with this claim: {topic} never changes at all?",
            "Proofread: I realy like lerning about {topic}.",
            "Fix the spelling: {topic} is verry intresting."),
}


def templated_prompts() -> list[dict]:
    """Every (topic, kind, phrasing) request, in a fixed shuffled order (so any prefix mixes
    the kinds): the corpus's first prompts, with negative slots."""
    triples = [(t, k, p) for k in TEMPLATES for p in TEMPLATES[k] for t in TOPICS]
    random.Random(20261204).shuffle(triples)
    return [{"slot": -1 - i, "topic": topic, "kind": kind, "prompt": phrasing.format(topic=topic)}
            for i, (topic, kind, phrasing) in enumerate(triples)]


def slot_seed(seed: int, slot: int) -> int:
    """The seed of slot `slot`'s sampled request (independent of chunking)."""
    return seed * 1_000_003 + slot


def slot_pair(seed: int, slot: int) -> tuple[str, str]:
    """(topic, kind) of slot `slot`: every pair once per round of len(TOPICS) * len(KINDS)
    slots, in a seeded order."""
    pairs = [(t, k) for t in TOPICS for k in KINDS]
    rounds, index = divmod(slot, len(pairs))
    random.Random(seed * 7919 + rounds).shuffle(pairs)
    return pairs[index]


def clean(reply: str) -> str | None:
    """A written request cut to its first paragraph (two for "summarise"), quotes and labels
    stripped; None when too short or too long."""
    text = reply.strip().strip('"').strip()
    for label in ("Request:", "User:", "Question:", "Message:"):
        if text.lower().startswith(label.lower()):
            text = text[len(label):].strip().strip('"').strip()
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    text = "\n\n".join(paragraphs[:2]) if paragraphs else ""
    return text if 12 <= len(text) <= 400 else None


def _count_lines(path: str) -> tuple[int, dict | None]:
    """(lines, the last record) of a jsonl file (0, None when missing); a torn last line (a
    killed write) is cut off."""
    if not os.path.exists(path):
        return 0, None
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        data = data[:data.rfind(b"\n") + 1]
        with open(path, "wb") as f:
            f.write(data)
    lines = [line for line in data.split(b"\n") if line.strip()]
    return len(lines), (json.loads(lines[-1]) if lines else None)


def _append(path: str, records: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_prompts(model, params, tokenizer, out: str, target: int, batch: int, seed: int):
    """Stage "prompts" until prompts.jsonl holds `target` records."""
    import jax

    from jaxgen.api.generate import generate_ids
    from jaxgen.api.text import encode_prompts

    path = os.path.join(out, "prompts.jsonl")
    have, last = _count_lines(path)
    seen = {text.lower() for text in read_prompts(os.path.join(PROMPTS_DIR, "prompts_heldout.jsonl"))}
    held_out = set(seen)
    if have:
        seen |= {text.lower() for text in read_prompts(path)}
    if have == 0:  # the templated requests first (no model needed)
        seeded = [r for r in templated_prompts() if r["prompt"].lower() not in held_out]
        seeded = seeded[:target]
        _append(path, seeded)
        seen |= {r["prompt"].lower() for r in seeded}
        have, last = len(seeded), None
    slot = 0 if last is None or last["slot"] < 0 else last["slot"] + 1
    eos = set(model.config.eos_token_id if isinstance(model.config.eos_token_id, (list, tuple))
              else [model.config.eos_token_id])
    while have < target:
        started = time.time()
        slots = list(range(slot, slot + batch))
        pairs = [slot_pair(seed, s) for s in slots]
        asks = [f"Write {KINDS[kind].format(topic=topic)}. Reply with that text only, in one "
                f"or two sentences, as a user would type it to an assistant."
                for topic, kind in pairs]
        rows = encode_prompts(tokenizer, asks, chat=True)
        keys = jax.numpy.stack([jax.random.key(slot_seed(seed, s)) for s in slots])
        outs = generate_ids(model, params, rows, key=keys, max_new_tokens=80, do_sample=True,
                            temperature=0.6, top_p=0.9, top_k=0)
        kept = []
        for s, (topic, kind), row, full in zip(slots, pairs, rows, outs):
            if full[-1] not in eos:  # cut off at the budget: not a whole request
                continue
            text = clean(tokenizer.decode(full[len(row):], skip_special_tokens=True))
            if text is None or text.lower() in seen or text.lower() in held_out:
                continue
            seen.add(text.lower())
            kept.append({"slot": s, "topic": topic, "kind": kind, "prompt": text})
        kept = kept[:target - have]
        _append(path, kept)
        have += len(kept)
        slot += batch
        print(f"prompts {have}/{target} (slot {slot}, {time.time() - started:.1f} s a chunk)",
              flush=True)


def write_answers(model, params, tokenizer, out: str, batch: int, new_tokens: int, seed: int):
    """Stage "answers": every prompt of prompts.jsonl answered greedily and at T = 0.7."""
    import jax

    from jaxgen.api.generate import generate_ids
    from jaxgen.api.text import encode_prompts

    with open(os.path.join(out, "prompts.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    path = os.path.join(out, "answers.jsonl")
    done, _ = _count_lines(path)
    for start in range(done, len(records), batch):
        started = time.time()
        chunk = records[start:start + batch]
        rows = encode_prompts(tokenizer, [r["prompt"] for r in chunk], chat=True)
        greedy = generate_ids(model, params, rows, max_new_tokens=new_tokens, do_sample=False)
        keys = jax.numpy.stack([jax.random.key(slot_seed(seed + 1, r["slot"])) for r in chunk])
        sampled = generate_ids(model, params, rows, key=keys, max_new_tokens=new_tokens,
                               do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
        _append(path, [{"slot": r["slot"], "greedy": g, "sampled": s}
                       for r, g, s in zip(chunk, greedy, sampled)])
        print(f"answers {start + len(chunk)}/{len(records)} "
              f"({time.time() - started:.1f} s a chunk)", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (kept between runs)")
    parser.add_argument("--prompts", type=int, default=20000, help="prompts to write")
    parser.add_argument("--stage", choices=("prompts", "answers", "both"), default="both")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from jaxgen.models import DEFAULT_MODEL, load, unstack_layers

    model, params, tokenizer = load(DEFAULT_MODEL)
    params = unstack_layers(model, params)
    os.makedirs(args.out, exist_ok=True)
    if args.stage in ("prompts", "both"):
        write_prompts(model, params, tokenizer, args.out, args.prompts, args.batch, args.seed)
    if args.stage in ("answers", "both"):
        write_answers(model, params, tokenizer, args.out, args.batch, args.new_tokens,
                      args.seed)


if __name__ == "__main__":
    main()
