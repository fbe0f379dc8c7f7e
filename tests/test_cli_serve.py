"""`jaxgen serve`'s flags: a bad value is one line naming the flag and its range, exit 2,
before the model loads (a missing model would exit 3); settings the loaded model or the
memory cannot take are one line and exit 2 too, never a traceback."""
import pytest

from jaxgen.cli.serve import main

pytest.importorskip("uvicorn")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("argv,needle", [
    (["--port", "99999"], "--port: must be in 1..65535, got 99999"),
    (["--port", "0"], "--port: must be in 1..65535, got 0"),
    (["--port", "-1"], "--port: must be in 1..65535, got -1"),
    (["--max-len", "1"], "--max-len: must be at least 2, got 1"),
    (["--grace", "nan"], "--grace: must be a finite number >= 0, got 'nan'"),
    (["--grace", "inf"], "--grace: must be a finite number >= 0, got 'inf'"),
    (["--grace", "-5"], "--grace: must be a finite number >= 0, got '-5'"),
    (["--grace", "soon"], "--grace: expected a number of seconds, got 'soon'"),
    (["--max-body-bytes", "0"], "--max-body-bytes: must be at least 1, got 0"),
    (["--slots", "0"], "--slots: must be at least 1, got 0"),
])
def test_bad_flags_are_usage_errors_before_the_model_loads(capsys, tmp_path, argv, needle):
    code = main(["--model", str(tmp_path / "no-such-model"), *argv])
    assert code == 2 and needle in _one_line(capsys)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from test_cli_batch import write_tiny_model  # 512 positions
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny_serve_model")))


def test_a_max_len_past_the_models_positions_is_a_usage_error(capsys, tiny_model):
    code = main(["--model", tiny_model, "--max-len", "513"])
    assert code == 2
    assert "--max-len: must be in 2..512 (the model's max_position_embeddings), got 513" \
        in _one_line(capsys)


def test_slots_past_the_memory_are_a_usage_error(capsys, tiny_model):
    code = main(["--model", tiny_model, "--slots", str(10**9), "--max-len", "512"])
    line = _one_line(capsys)
    assert code == 2 and "`slots`=1000000000 x `max_len`=512 do not fit" in line
