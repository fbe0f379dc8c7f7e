"""`jaxgen --speculative METHOD`: lossless (the plain answer), with the acceptance in the summary.

Run in-process on tiny random models saved as Hugging Face folders (with --no-cache, so the
test session's JAX settings stay untouched)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from jaxgen.cli.assisted import METHODS, check_flags, config_fields
from jaxgen.cli.main import main
from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
from jaxgen.models.hf_export import save_hf_checkpoint

PROMPT = "the stop the stop the stop the"


def save_tiny(folder, seed: int, num_layers: int = 2) -> str:
    """A random Llama over tiny_tokenizer's vocabulary, as a HF folder with its tokenizer."""
    model, params = tiny_llama(seed=seed, num_layers=num_layers, vocab_size=TINY_VOCAB)
    save_hf_checkpoint(model, params, str(folder))
    tiny_tokenizer().backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    return save_tiny(root / "target", seed=1), save_tiny(root / "draft", seed=2, num_layers=1)


def run(capsys, *args):
    code = main(["--no-cache", "--no-chat-template", "--max-new-tokens", "12", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def plain_answer(tiny_models):
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--no-cache", "--no-chat-template", "--max-new-tokens", "12", "--model",
                     tiny_models[0], PROMPT])
    assert code == 0, err.getvalue()
    assert "drafts accepted" not in err.getvalue()
    return out.getvalue()


@pytest.mark.parametrize("method_args", [
    ["--speculative", "lookup", "--draft-tokens", "3"],
    ["--speculative", "early-exit", "--exit-layer", "1"],
    pytest.param(["--speculative", "draft"], marks=pytest.mark.slow),  # --assistant below
])
def test_every_method_gives_the_plain_answer_and_reports_acceptance(tiny_models, plain_answer,
                                                                     capsys, method_args):
    target, draft = tiny_models
    extra = ["--assistant", draft] if method_args[-1] == "draft" else []
    code, out, err = run(capsys, "--model", target, *method_args, *extra, PROMPT)
    assert code == 0, err
    assert out == plain_answer
    summary = err.strip().splitlines()[-1]
    assert "drafts accepted/round" in summary, summary
    accepted = float(summary.split("drafts accepted/round")[0].rsplit(",", 1)[1])
    assert 0.0 <= accepted <= 12


def test_mtp_runs_the_models_own_mtp_layers_and_gives_the_plain_answer(tmp_path, capsys):
    import jax

    from jaxgen.models.mtp import with_mtp
    from jaxgen.models.mtp_checkpoint import save_mtp_checkpoint

    model, params = with_mtp(*tiny_llama(seed=1, num_layers=2, vocab_size=TINY_VOCAB),
                             jax.random.key(3), depths=1)
    folder = save_mtp_checkpoint(model, params, str(tmp_path / "mtp"))
    tiny_tokenizer().backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    code, plain, err = run(capsys, "--model", folder, PROMPT)
    assert code == 0, err
    code, out, err = run(capsys, "--model", folder, "--speculative", "mtp", "--draft-tokens", "2",
                         PROMPT)
    assert code == 0, err
    assert out == plain
    assert "drafts accepted/round" in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("args,needle", [
    (["--speculative", "medusa"], "choose from 'draft', 'early-exit', 'lookup', 'mtp'"),
    (["--speculative", "mtp"], "use_mtp"),  # the tiny target has no MTP layers
    (["--speculative", "mtp-drafter"], "needs --assistant"),
    (["--speculative", "mtp", "--assistant", "x"], "drop --assistant"),
    (["--exit-layer", "1"], "--exit-layer needs --speculative early-exit"),
    (["--speculative", "lookup", "--exit-layer", "1"], "--exit-layer is for"),
    (["--speculative", "lookup", "--assistant", "x"], "drop --assistant"),
    (["--draft-tokens", "3"], "--draft-tokens needs --speculative"),
    (["--speculative", "draft"], "needs --assistant"),
])
def test_bad_combinations_are_usage_errors_naming_the_flag(tiny_models, capsys, args, needle):
    target, _ = tiny_models
    code, out, err = run(capsys, "--model", target, *args, PROMPT)
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_the_table_configures_each_method():
    assert set(METHODS) == {"lookup", "draft", "early-exit", "mtp", "mtp-drafter"}
    model = SimpleNamespace(config=SimpleNamespace(num_layers=4, exit_adapter_layers=()))
    trained = SimpleNamespace(config=SimpleNamespace(num_layers=4, exit_adapter_layers=(3,)))
    assert config_fields("early-exit", draft_tokens=2, exit_layer=None, model=trained)[
        "assistant_early_exit"] == 3
    assert config_fields("early-exit", draft_tokens=None, exit_layer=None, model=model) == {
        "num_assistant_tokens": 4, "assistant_early_exit": 2}
    assert config_fields("draft", draft_tokens=7, exit_layer=None, model=model) == {
        "num_assistant_tokens": 7}
    check_flags("draft", assistant="some/draft", exit_layer=None)  # allowed
    with_mtp = tiny_llama(num_mtp_layers=1)[0]
    assert config_fields("mtp", draft_tokens=2, exit_layer=None, model=with_mtp) == {
        "use_mtp": True, "num_assistant_tokens": 2}
    assert config_fields("mtp-drafter", draft_tokens=None, exit_layer=None, model=model) == {
        "num_assistant_tokens": 3}
