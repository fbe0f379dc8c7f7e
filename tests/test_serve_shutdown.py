"""`jaxgen serve` and SIGTERM: a real server process (a tiny random llama written to a
Hugging Face folder), one streaming request in flight when the signal comes. The stream
ends cleanly (its last choice has a finish_reason, then `data: [DONE]`), the listening
socket closes at once (new connections are refused while the stream still runs), and the
process exits with serve's documented code within the grace period."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_cli_batch import write_tiny_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

CLI = [sys.executable, "-m", "jaxgen.cli.main", "serve"]
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
START = 300  # seconds: a bound so a broken server fails the test instead of hanging it
GRACE = 120  # --grace: ample for the tiny model's one answer on a loaded machine
BUDGET = 400  # tokens asked for (the tiny model's context is 512)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _refuses(port: int) -> bool:
    """Whether a new TCP connection to the port is refused."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except (ConnectionRefusedError, OSError):
        return True
    return False


def _started(process, url: str) -> None:
    deadline = time.monotonic() + START
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=5).json()["status"] == "ok":
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail("jaxgen serve did not start")


def _events(lines):
    """The stream's `data:` payloads, in order, up to and with [DONE]."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: "):]


@pytest.mark.slow
def test_sigterm_mid_stream_ends_the_stream_cleanly_and_exits(tmp_path):
    folder = write_tiny_model(str(tmp_path / "tiny"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(CLI + ["--model", folder, "--port", str(port), "--slots", "2",
                                      "--chunk-size", "1", "--grace", str(GRACE)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=ENV)
    try:
        _started(process, url)
        with httpx.Client(timeout=START) as http:
            with http.stream("POST", url + "/v1/completions", json={
                    "prompt": "Once upon a time", "max_tokens": BUDGET, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}) as response:
                assert response.status_code == 200
                events = _events(response.iter_lines())
                payloads = [next(events)]  # the first piece of text: the request runs
                process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + START
                while not _refuses(port):  # the listener closes before the stream ends
                    assert time.monotonic() < deadline, "the server still takes connections"
                    time.sleep(0.05)
                payloads += list(events)
        code = process.wait(timeout=GRACE + 60)
        log = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert payloads[-1] == "[DONE]", payloads[-3:]
    chunks = [json.loads(p) for p in payloads[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "length" and reasons[:-1] == [None] * (len(reasons) - 1)
    # the request in flight finished whole within the grace period, not cut short
    assert chunks[-1]["usage"]["completion_tokens"] == BUDGET
    assert code == 0, log[-2000:]
    assert "Waiting for connections to close" in log  # the signal came mid-stream
    assert _refuses(port)
