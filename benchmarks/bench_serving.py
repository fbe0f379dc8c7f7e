"""Serving under load on SmolLM2-135M-Instruct: continuous batching against fixed batches and
llama.cpp's server, all fed the same requests at the same arrival times.

The load (fixed seeds): `--requests` chat prompts, half the held-out questions of
jaxgen/train/data/prompts_heldout.jsonl, half a task of bench_speculative.py over the first
k sentences of one of its PASSAGES (about 20-400 prompt tokens), each with an answer budget
drawn lognormal (median 64, clipped to 16..256), arriving as a Poisson process of `--rate`
requests/s. Greedy (temperature 0) everywhere; EOS ends an answer early.

Systems, one after the other, each against the whole load:
  * jaxgen serve: `jaxgen serve --slots N` as a subprocess, the requests streamed from
    /v1/chat/completions by an asyncio httpx client (stream_options.include_usage);
  * jaxgen fixed batches (what jaxgen did before the engine): requests grouped in arrival
    order into batches of N; a batch starts once its last member arrived and the previous
    batch ended; each runs jaxgen.generate over init_state with the rows' own budgets
    (per-row max_new_tokens, so a row stops at its budget or EOS; the batch ends when all
    rows did), one streamer per row through the chunked driver with the engine's chunk
    size, so first tokens are seen as the engine's are;
  * llama.cpp (llama-cpp-python's server, when installed): the F32 GGUF written from the
    same weights (bench_speed.write_f32_gguf) and the package's own Q4_1 GGUF.

Compilation is kept out of the timed runs: the fixed path runs each of its batches once
before with the same shapes and budgets cut to one chunk (a count of traces during the
timed run is printed); the server compiles its three programs at start-up (the decode
chunk, a prompt chunk, a prompt's last chunk: every prompt length shares them) and answers
one request before the load.

Reported per system: generated tokens/s over the run (first request sent to last answer
done), time to first token (from the request's send) p50/p99, and time per output token
(per request: (last token time - first token time) / (tokens - 1)) p50/p99.

    python benchmarks/bench_serving.py                      # 200 requests, 2 req/s, 8 slots
    python benchmarks/bench_serving.py --requests 40 --skip-llama-cpp
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
from bench_ab import host_line
from bench_speculative import PASSAGES, TASKS
from report_table import table_header, table_row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELDOUT = os.path.join(REPO, "jaxgen", "train", "data", "prompts_heldout.jsonl")
START_TIMEOUT = 900  # seconds a server gets to start (loaded machines compile slowly)


# ----------------------------------------------------------------------------- the load
def build_load(count: int, rate: float, seed: int) -> list[dict]:
    """[{messages, budget, arrival}] in arrival order (seconds from the start)."""
    rng = np.random.default_rng(seed)
    with open(HELDOUT, encoding="utf-8") as handle:
        questions = [json.loads(line)["prompt"] for line in handle if line.strip()]
    load, arrival = [], 0.0
    for index in range(count):
        if rng.random() < 0.5:
            content = questions[int(rng.integers(len(questions)))]
        else:
            sentences = PASSAGES[int(rng.integers(len(PASSAGES)))].split(". ")
            kept = ". ".join(sentences[:int(rng.integers(1, len(sentences) + 1))])
            content = TASKS[int(rng.integers(len(TASKS)))].format(p=kept)
        budget = int(np.clip(round(rng.lognormal(np.log(64), 0.8)), 16, 256))
        if index:
            arrival += float(rng.exponential(1.0 / rate))
        load.append({"messages": [{"role": "user", "content": content}], "budget": budget,
                     "arrival": arrival})
    return load


def prompt_ids(tokenizer, request) -> list[int]:
    return list(tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True))


# ----------------------------------------------------------------------------- results
class Timing:
    """One request's send time, token arrival times (one per token or per chunk of tokens)
    and token count."""

    def __init__(self):
        self.sent = None
        self.times: list[float] = []  # arrival of each token (a chunk's tokens share one)
        self.tokens = 0
        self.done = None
        self.text = ""  # the streamed answer (HTTP systems)

    def add(self, at: float, count: int) -> None:
        self.times.extend([at] * count)
        self.tokens += count


def summary(timings: list[Timing]) -> dict:
    """tokens/s, TTFT p50/p99 and per-token latency p50/p99 (milliseconds)."""
    start = min(t.sent for t in timings)
    end = max(t.done for t in timings)
    total = sum(t.tokens for t in timings)
    ttft = [t.times[0] - t.sent for t in timings if t.times]
    tpot = [(t.times[-1] - t.times[0]) / (t.tokens - 1) for t in timings
            if t.tokens > 1 and len(t.times) > 1]
    return {"tokens": total, "seconds": end - start, "tok/s": total / (end - start),
            "ttft p50": np.percentile(ttft, 50) * 1e3, "ttft p99": np.percentile(ttft, 99) * 1e3,
            "tpot p50": np.percentile(tpot, 50) * 1e3, "tpot p99": np.percentile(tpot, 99) * 1e3}


# ----------------------------------------------------------------------------- HTTP servers
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(command: list, url: str, log_path: str) -> subprocess.Popen:
    import httpx

    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[:4]} exited {process.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{command[:4]} did not start in {START_TIMEOUT} s; see {log_path}")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def stream_one(client, url: str, body: dict, timing: Timing, count_tokens) -> None:
    """Sends one streaming chat request; records its content chunks' times and its token
    count: usage's when the server reports one, else count_tokens(the answer's text)."""
    timing.sent = time.perf_counter()
    chunks, usage = 0, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    timing.add(time.perf_counter(), 1)
                    timing.text += content
                    chunks += 1
    timing.done = time.perf_counter()
    if usage and usage.get("completion_tokens"):  # tokens with no text (EOS) count too
        timing.tokens = int(usage["completion_tokens"])
    elif count_tokens is not None:  # a server that may put several tokens in a chunk
        timing.tokens = max(count_tokens(timing.text), 1 if chunks else 0)


async def replay(url: str, load: list[dict], model_name: str, usage: bool,
                 count_tokens=None) -> list[Timing]:
    """The whole load at its arrival times; one Timing per request (count_tokens: text ->
    tokens, for a server that reports no usage)."""
    import httpx

    timings = [Timing() for _ in load]
    limits = httpx.Limits(max_connections=len(load) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()

        async def one(request, timing):
            await asyncio.sleep(max(0.0, start + request["arrival"] - time.perf_counter()))
            body = {"model": model_name, "messages": request["messages"],
                    "max_tokens": request["budget"], "temperature": 0, "stream": True}
            if usage:
                body["stream_options"] = {"include_usage": True}
            await stream_one(client, url, body, timing, count_tokens)

        await asyncio.gather(*(one(r, t) for r, t in zip(load, timings)))
    return timings


async def warm_server(url: str, length: int, model_name: str) -> None:
    """One completion of a `length`-token prompt (the server compiled its programs at
    start-up: the chunk, a prompt chunk and a prompt's last chunk serve every length)."""
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:
        response = await client.post(url + "/v1/completions", json={
            "model": model_name, "prompt": [100 + i % 50 for i in range(length)],
            "max_tokens": 4, "temperature": 0})
        response.raise_for_status()


def run_jaxgen_server(load, lengths, args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(tempfile.gettempdir(), f"bench_serving_jaxgen_{port}.log")
    process = start_server([sys.executable, "-m", "jaxgen.cli.main", "serve", "--port",
                            str(port), "--slots", str(args.slots), "--max-len",
                            str(args.max_len), "--chunk-size", str(args.chunk_size),
                            "--max-waiting", str(len(load) + 8)], url, log)
    try:
        name = "smollm2-135m-instruct"
        started = time.perf_counter()
        asyncio.run(warm_server(url, max(lengths), name))
        print(f"jaxgen serve: warm-up {time.perf_counter() - started:.0f} s (log {log})",
              flush=True)
        return summary(asyncio.run(replay(url, load, name, usage=True)))
    finally:
        stop_server(process)


# ----------------------------------------------------------------------------- fixed batches
def run_fixed(model, params, tokenizer, load, ids, args) -> dict:
    """Batches of `slots` requests in arrival order, each started when its last member has
    arrived and the previous batch ended (see the module docstring)."""
    import jax

    import jaxgen
    from jaxgen.api.generate import default_config
    from jaxgen.core.state import init_state
    from jaxgen.drivers.streamers import BaseStreamer
    from jaxgen.runtime.compiled import set_max_programs, trace_count

    cfg = default_config(model, None, do_sample=False, max_new_tokens=256)

    class RowTimes(BaseStreamer):
        def __init__(self, timing: Timing):
            super().__init__()
            self.timing, self.prompt_seen = timing, False

        def put(self, value):
            if not self.prompt_seen:  # the first put is the prompt
                self.prompt_seen = True
                return
            self.timing.add(time.perf_counter(), int(np.asarray(value).size))

        def end(self):
            self.timing.done = time.perf_counter()

    batches = [list(range(i, min(i + args.slots, len(load))))
               for i in range(0, len(load), args.slots)]

    def run(batch, timings, stop_after=None):
        budgets = np.asarray([load[i]["budget"] for i in batch], np.int32)
        state = init_state(model, [ids[i] for i in batch], cfg, max_new_tokens=budgets)
        if stop_after is not None:  # the same shapes (one program), fewer steps
            state = state.replace(max_new=jax.numpy.minimum(state.max_new, stop_after))
        jaxgen.generate(params, state, cfg, streamer=[RowTimes(t) for t in timings],
                        chunk_size=args.chunk_size)

    # every batch's programs stay alive through the timed run (the default keeps 16)
    previous_limit = set_max_programs(4 * len(batches) + 16)
    started = time.perf_counter()
    warm = args.chunk_size + 1  # a prefill and one whole chunk: every program runs once
    for batch in batches:  # every (rows, buckets) compiles here, outside the timed run
        run(batch, [Timing() for _ in batch], stop_after=warm)
    print(f"fixed batches: warm-up {time.perf_counter() - started:.0f} s", flush=True)
    traces = trace_count()
    timings = [Timing() for _ in load]
    start = time.perf_counter()
    for batch in batches:
        wait = start + load[batch[-1]]["arrival"] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        for i in batch:  # each was sent at its arrival; it waited for the batch
            timings[i].sent = start + load[i]["arrival"]
        run(batch, [timings[i] for i in batch])
        jax.effects_barrier()
    print(f"fixed batches: {trace_count() - traces} traces during the timed run", flush=True)
    set_max_programs(previous_limit)
    return summary(timings)


# ----------------------------------------------------------------------------- llama.cpp
def llama_cpp_flags() -> tuple[str | None, str]:
    """The installed server's flag for parallel sequences (None when it has none), and the
    help text."""
    done = subprocess.run([sys.executable, "-m", "llama_cpp.server", "--help"],
                          capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    for flag in ("--n_parallel", "--n_seq_max", "--parallel"):
        if flag in text:
            return flag, text
    return None, text


def quantize_q4_1(source: str, target: str) -> str | None:
    """`target` as a Q4_1 requantization of `source` with llama.cpp's quantize API, or None
    when the installed package cannot."""
    import ctypes

    try:
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1
        code = llama_cpp.llama_model_quantize(source.encode(), target.encode(),
                                              ctypes.byref(params))
    except (AttributeError, OSError, TypeError, ctypes.ArgumentError) as error:
        print(f"llama.cpp: cannot quantize to Q4_1 ({error})")
        return None
    return target if code == 0 else None


def run_llama_cpp(path: str, load, args, parallel_flag, tokenizer) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(tempfile.gettempdir(), f"bench_serving_llama_cpp_{port}.log")
    command = [sys.executable, "-m", "llama_cpp.server", "--model", path, "--port", str(port),
               "--n_ctx", str(args.max_len * (args.slots if parallel_flag else 1)),
               "--n_threads", str(args.threads), "--n_batch", "512",
               "--interrupt_requests", "False"]  # queue a request behind the running one
    if parallel_flag:
        command += [parallel_flag, str(args.slots)]
    process = start_server(command, url, log)
    try:
        name = os.path.basename(path)
        count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        asyncio.run(replay(url, load[:2], name, usage=False, count_tokens=count))  # warm-up
        return summary(asyncio.run(replay(url, load, name, usage=False, count_tokens=count)))
    finally:
        stop_server(process)


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slots", type=int, default=8, help="N: slots / fixed batch size")
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=704, help="tokens per slot")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's --n_threads")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-fixed", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    args = parser.parse_args()

    from jaxgen.models import DEFAULT_MODEL, load as load_model

    model, params, tokenizer = load_model(DEFAULT_MODEL)
    load = build_load(args.requests, args.rate, args.seed)
    ids = [prompt_ids(tokenizer, r) for r in load]
    lengths = [len(i) for i in ids]
    budgets = [r["budget"] for r in load]
    print(f"\n{host_line()}")
    print(f"load: {len(load)} requests, Poisson {args.rate}/s over "
          f"{load[-1]['arrival']:.0f} s (seed {args.seed}); prompt tokens min/median/max "
          f"{min(lengths)}/{int(np.median(lengths))}/{max(lengths)}; budgets "
          f"{min(budgets)}/{int(np.median(budgets))}/{max(budgets)} (sum {sum(budgets)}); "
          f"greedy; N = {args.slots}, chunk {args.chunk_size}, max_len {args.max_len}\n",
          flush=True)

    rows = {}
    if not args.skip_server:
        rows[f"jaxgen serve, continuous batching ({args.slots} slots)"] = run_jaxgen_server(
            load, lengths, args)
        print(rows[list(rows)[-1]], flush=True)
    if not args.skip_fixed:
        rows[f"jaxgen fixed batches of {args.slots} (in-process)"] = run_fixed(
            model, params, tokenizer, load, ids, args)
        print(rows[list(rows)[-1]], flush=True)
    if args.skip_llama_cpp:
        print("llama.cpp: skipped (--skip-llama-cpp)")
    else:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            llama_cpp = None
            print("llama.cpp: llama-cpp-python is not installed: no llama.cpp rows "
                  "(pip install 'llama-cpp-python[server]')")
        if llama_cpp is not None:
            from bench_speed import write_f32_gguf

            from jaxgen.models.embedded import embedded_path

            parallel_flag, _ = llama_cpp_flags()
            mode = (f"{parallel_flag} {args.slots}" if parallel_flag
                    else "one sequence at a time: this server has no parallel-slots flag")
            folder = tempfile.mkdtemp()
            f32 = write_f32_gguf(embedded_path(DEFAULT_MODEL),
                                 os.path.join(folder, "smollm2-f32.gguf"))
            q4 = quantize_q4_1(f32, os.path.join(folder, "smollm2-q4_1.gguf"))
            if q4 is None:
                print("llama.cpp: Q4_1 could not be produced from the F32 file; the package's "
                      "own Q4_1 GGUF is used instead")
                q4 = embedded_path(DEFAULT_MODEL)
            for label, path in (("F32", f32), ("Q4_1", q4)):
                rows[f"llama.cpp server {label} ({mode})"] = run_llama_cpp(
                    path, load, args, parallel_flag, tokenizer)
                print(rows[list(rows)[-1]], flush=True)

    print()
    print(table_header("system", "tokens", "tok/s", "TTFT p50 ms", "TTFT p99 ms",
                       "per-token p50 ms", "per-token p99 ms", numeric=True))
    for name, r in rows.items():
        print(table_row(name, r["tokens"], f"{r['tok/s']:.1f}", f"{r['ttft p50']:.0f}",
                        f"{r['ttft p99']:.0f}", f"{r['tpot p50']:.1f}", f"{r['tpot p99']:.1f}"))
    continuous = [r for n, r in rows.items() if n.startswith("jaxgen serve")]
    fixed = [r for n, r in rows.items() if n.startswith("jaxgen fixed")]
    if continuous and fixed:
        ratio = continuous[0]["tok/s"] / fixed[0]["tok/s"]
        print(f"\ncontinuous batching at {ratio:.2f}x the fixed batches' tokens/s "
              f"(target >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'})")


if __name__ == "__main__":
    main()
