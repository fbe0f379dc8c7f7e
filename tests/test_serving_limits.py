"""The server's limits and counts, checked without a running server: an Engine's max_len is
refused past the model's positions or memory before anything is allocated; a prompt's
character bound; chat roles; usage and log-probs count exactly the tokens of the answer."""
import asyncio
from types import SimpleNamespace

import pytest

import jaxgen
from jaxgen.serving import Engine, generate_batch
from jaxgen.serving.openai_schema import ApiError, parse_request
from jaxgen.serving.requests import Completion

WAIT = 300  # seconds: a bound so a broken engine fails the test instead of hanging it


@pytest.fixture(scope="module")
def short_model():
    from jaxgen.models import tiny_llama
    return tiny_llama(max_position_embeddings=64)


def test_max_len_past_the_models_positions_is_refused_naming_the_range(short_model):
    model, params = short_model
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match=r"`max_len`=65 is past the model's 64 positions "
                                         r".*allowed: 2\.\.64"):
        Engine(model, params, cfg, slots=1, max_len=65)
    with pytest.raises(ValueError, match=r"`max_len`=10000000 .* allowed: 2\.\.64"):
        Engine(model, params, cfg, slots=64, max_len=10**7)
    engine = Engine(model, params, cfg, slots=1, max_len=64)  # the whole context is fine
    engine.close(timeout=WAIT)


def test_slots_times_max_len_past_memory_is_refused_before_allocating():
    from jaxgen.models import tiny_llama

    model, params = tiny_llama(max_position_embeddings=2**31 - 1)
    with pytest.raises(ValueError, match=r"`slots`=1024 x `max_len`=1073741824 do not fit"):
        Engine(model, params, jaxgen.GenerationConfig(max_new_tokens=4), slots=1024,
               max_len=2**30)


def test_generate_batch_keeps_its_default_buffer_inside_the_positions(short_model):
    """Its default buffer (prompt bucket 16 + new-token bucket 64) would pass 64 positions."""
    model, params = short_model
    rows = generate_batch(model, params, [[1, 2, 3]], slots=1, max_new_tokens=4,
                          timeout=WAIT)
    assert len(rows[0]) == 7


def test_the_character_bound_of_byte_level_and_byte_fallback_tokenizers():
    import tokenizers
    from tokenizers import models, normalizers, pre_tokenizers

    from jaxgen.models import tiny_tokenizer
    from jaxgen.models.tokenizer import Tokenizer
    from jaxgen.serving.prompt_tokens import chars_per_token, encode

    tiny = tiny_tokenizer()
    assert chars_per_token(tiny) == len("</s>")  # its longest token
    text = "the stop, ünïcode \u1f82 and more"
    assert encode(tiny, text) == tiny.encode(text)
    assert len(tiny.encode(text)) * chars_per_token(tiny) >= len(text)
    # byte fallback behind a Llama-2 style normalizer: "<0x41>" is its longest token
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}, "▁": 257, "▁▁": 258,
             "▁▁▁▁": 259}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "▁"), ("▁▁", "▁▁")],
                                              unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    assert chars_per_token(Tokenizer(backend)) == 6
    backend.normalizer = normalizers.NFKC()  # composes up to 4 code points into one
    assert chars_per_token(Tokenizer(backend)) == 6 * 4
    # a normalizer that drops characters, or a model that may not cover them: no bound
    backend.normalizer = normalizers.StripAccents()
    assert chars_per_token(Tokenizer(backend)) is None
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces
    assert chars_per_token(Tokenizer(backend)) is None
    word_level = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    assert chars_per_token(Tokenizer(word_level)) is None
    # an added token that takes in the spaces around it stands for any number of characters
    absorbing = tiny_tokenizer().backend
    absorbing.add_special_tokens([tokenizers.AddedToken("<m>", lstrip=True)])
    spaced = " " * 5000 + "<m>"
    assert len(absorbing.encode(spaced).ids) == 1
    assert chars_per_token(Tokenizer(absorbing)) is None


@pytest.mark.parametrize("role,param,needle", [
    ("wizard", "messages[1].role", "must be one of ['system', 'user', 'assistant', "
                                   "'developer'], got 'wizard'"),
    ("tool", "messages[1].role", "tool calling"),
    (None, "messages[1]", "string `role`"),
])
def test_an_unknown_chat_role_is_a_400_naming_the_field_and_the_roles(role, param, needle):
    with pytest.raises(ApiError) as refused:
        parse_request("chat", {"messages": [{"role": "user", "content": "hi"},
                                            {"role": role, "content": "abracadabra"}]})
    assert refused.value.status == 400 and refused.value.param == param
    assert needle in refused.value.message


def test_a_developer_message_is_given_to_the_template_as_system():
    parsed = parse_request("chat", {"messages": [{"role": "developer", "content": "be terse"},
                                                 {"role": "user", "content": "hi"}]})
    assert [m["role"] for m in parsed.prompts[0]] == ["system", "user"]


class _Handle:
    """A finished request as the engine hands it out: `streamed` reach the server before it
    sees the stop; the engine had produced `produced` (to its chunk's end) by then."""

    def __init__(self, streamed, produced):
        self.streamed, self.produced = list(streamed), list(produced)
        self.token_logprobs = [-0.5] * len(produced)
        self.top_logprobs = [[(t, -0.5)] for t in produced]
        self.cancelled = False

    def tokens(self):
        return iter(self.streamed)

    def cancel(self):
        self.cancelled = True

    def result(self, timeout=None):
        return Completion([1], self.produced, "cancelled" if self.cancelled else "finished",
                          None if self.cancelled else "eos")


def _choice(body, handle):
    """(usage count, text, logprob entries, finish reason) of one choice run by the server."""
    from jaxgen.models import tiny_tokenizer
    from jaxgen.serving.http_app import _Server

    tokenizer = tiny_tokenizer()
    pool = SimpleNamespace(model=None, cfg=SimpleNamespace(eos_token_id=256))
    server = _Server(pool, tokenizer, "tiny", None, 64, 3, 1024)
    parsed = parse_request("completion", {"prompt": "x", **body})
    pieces, entries, reasons = [], [], []

    async def emit(index, piece, new_entries, reason):
        pieces.append(piece)
        entries.extend(new_entries)
        reasons.append(reason)

    count = asyncio.run(server.run_choice(parsed, handle, 0, emit))
    return count, "".join(pieces), entries, reasons[-1]


def test_usage_counts_up_to_the_token_that_completed_the_stop():
    from jaxgen.models import tiny_tokenizer

    ids = tiny_tokenizer().encode("abcXYdefgh")
    assert len(ids) == 10  # one token a character
    # the engine ran on to its chunk's end (all 10) before the server saw "XY" and cancelled
    count, text, entries, reason = _choice({"stop": "XY", "logprobs": 1}, _Handle(ids, ids))
    assert (text, reason) == ("abc", "stop")
    assert count == 5 == len(entries)  # "abc", "X", and "Y" that completed the stop
    assert "".join(e["token"] for e in entries) == "abcXY"


def test_special_tokens_have_log_prob_entries_as_usage_counts_them():
    from jaxgen.models import tiny_tokenizer

    ids = tiny_tokenizer().encode("hi") + [256]  # then EOS "</s>"
    count, text, entries, reason = _choice({"logprobs": 2}, _Handle(ids, ids))
    assert (text, reason) == ("hi", "stop")
    assert count == 3 == len(entries)
    assert [e["token"] for e in entries] == ["h", "i", "</s>"]
    assert [e["offset"] for e in entries] == [0, 1, 2]
