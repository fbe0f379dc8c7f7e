"""Run a benchmark as an AVX2-only host runs it, on a host with AVX-512: `--isa avx2`.

`--isa avx2` restarts the benchmark (before anything is measured) with every system in it
held to AVX2 where the system can be told so at run time: jaxgen's native kernels are built
for it ($JAXGEN_KERNEL_ARCH=haswell), PyTorch's own kernels and its MKL and oneDNN products
stop at AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA), and XLA's
generated code too (--xla_cpu_max_isa=AVX2). Two things stay as they are and the run's
`isa_line()` says so: XLA's library matrix products (prefill-sized dots) keep the host's
widest code, and llama.cpp runs the instruction set it was built with (point PYTHONPATH at an
AVX2-only llama-cpp-python build; the line names what the imported one uses).

    python benchmarks/bench_speed.py --isa avx2 --batches 1 8

    >>> sorted(isa_environment("avx2"))[:3]
    ['ATEN_CPU_CAPABILITY', 'JAXGEN_KERNEL_ARCH', 'MKL_ENABLE_INSTRUCTIONS']
    >>> isa_environment("native")
    {}
"""
from __future__ import annotations

import argparse
import os
import sys

ISA_CHOICES = ("native", "avx2")
_XLA_FLAG = "--xla_cpu_max_isa=AVX2"
_RESTARTED = "JAXGEN_BENCH_ISA"  # set in the restarted process: it restarts once


def isa_environment(isa: str) -> dict:
    """The environment variables that hold every system of a run to `isa` (none for
    "native": each runs the widest code this host has)."""
    if isa not in ISA_CHOICES:
        raise ValueError(f"isa={isa!r}: expected one of {', '.join(ISA_CHOICES)}")
    if isa == "native":
        return {}
    return {"JAXGEN_KERNEL_ARCH": "haswell", "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "XLA_FLAGS": " ".join(filter(None, [os.environ.get("XLA_FLAGS", "").replace(
                _XLA_FLAG, "").strip(), _XLA_FLAG]))}


def add_isa_argument(parser: argparse.ArgumentParser) -> None:
    """`--isa {native,avx2}` on a benchmark's command line."""
    parser.add_argument("--isa", choices=ISA_CHOICES, default="native",
                        help="avx2: hold every system to AVX2 on an AVX-512 host "
                             "(benchmarks/host_isa.py)")


def restart_for_isa(isa: str) -> None:
    """Re-run this process (same arguments) once with `isa_environment(isa)`: the libraries
    read these variables when they load. Refuses a CPU that lacks the instruction set."""
    wanted = isa_environment(isa)
    if not wanted or os.environ.get(_RESTARTED) == isa:
        return
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = set(f.read().split())
    if isa not in flags:
        raise SystemExit(f"--isa {isa}: this CPU has no {isa.upper()} (/proc/cpuinfo flags)")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv],
              {**os.environ, **wanted, _RESTARTED: isa})


def isa_line() -> str:
    """What each system of this run executes: jaxgen's kernel build, PyTorch's dispatch (when
    imported), llama.cpp's build (when installed), for the table's host line."""
    parts = [f"jaxgen kernels -march={os.environ.get('JAXGEN_KERNEL_ARCH') or 'native'}"]
    if _XLA_FLAG in os.environ.get("XLA_FLAGS", ""):
        parts.append("XLA generated code AVX2 (its library dots: the host's widest)")
    if "torch" in sys.modules:
        parts.append(f"PyTorch {sys.modules['torch'].backends.cpu.get_cpu_capability()}"
                     f" (MKL {os.environ.get('MKL_ENABLE_INSTRUCTIONS', 'widest')})")
    try:
        import llama_cpp
    except ImportError:
        pass
    else:
        info = llama_cpp.llama_print_system_info().decode()
        parts.append("llama.cpp " + ("AVX-512" if "AVX512 = 1" in info else "AVX2"
                                     if "AVX2 = 1" in info else "no AVX2") + " build")
    return "isa: " + "; ".join(parts)
