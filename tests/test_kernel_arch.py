"""$JAXGEN_KERNEL_ARCH: the instruction set the native kernels are built for. An AVX2 build
(`haswell`) on any host whose CPU runs AVX2 takes the paths an AVX-512 host's own build never
does (4-row groups, 8-lane tiles, the quantized kernel's int16 codes of a few input rows, the
decode-attention kernel's int16 query codes): the kernels' product and rounding tests run again
against that build, in a process of its own, so every x86 run checks both builds."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxgen.backends.cpu.kernels import build
from jaxgen.storage.host_cpu import host_cpu

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ("tests/test_few_rows_kernel.py", "tests/test_quantized_rows_kernel.py",
                "tests/test_decode_attention_kernel.py", "tests/test_prefill_attention_kernel.py")
# the tests whose outcome depends on the build: products against XLA's, the rows and queries
# the build rounds, its row group and row bounds (not the generate runs, which repeat the same
# products, nor the ones that set the row group themselves)
BUILD_DEPENDENT = ("equals or rounds or rounded or reports_its_row_group or row_bound "
                   "or falls_back or stands_for or named_layer")


AVX2_HOST = {"avx2", "fma", "f16c", "bmi2"} <= set(host_cpu().replace(";", " ").split())


@pytest.mark.parametrize("raw", ["-O0", "native -fplugin=x", "x86 64", "ar/ch", "é"])
def test_a_bad_arch_names_the_variable_and_the_form(raw):
    with pytest.raises(ValueError, match=f"{build.ARCH_VARIABLE}=.*not an instruction set name"):
        build.parse_kernel_arch(raw)


def test_the_arch_is_the_march_flag_and_part_of_the_library_name(monkeypatch):
    deadline = time.monotonic() + 60
    monkeypatch.setenv(build.ARCH_VARIABLE, "x86-64-v3")
    assert build.arch_flags() == ("-march=x86-64-v3",)
    v3 = build._library_name(build.QUANTIZED_SOURCE, build.FLAGS + build.arch_flags(), deadline)
    monkeypatch.delenv(build.ARCH_VARIABLE)
    assert build.arch_flags() == ("-march=native",)
    native = build._library_name(build.QUANTIZED_SOURCE, build.FLAGS + build.arch_flags(),
                                 deadline)
    assert v3 != native


@pytest.mark.skipif(not AVX2_HOST, reason="the host's CPU does not run AVX2 code")
def test_the_kernel_tests_hold_for_an_avx2_build(tmp_path):
    env = dict(os.environ, JAXGEN_KERNEL_ARCH="haswell", JAXGEN_KERNEL_DIR=str(tmp_path / "k"),
               JAX_PLATFORMS="cpu")
    env.pop("JAXGEN_CPU_KERNELS", None)
    probe = ("from jaxgen.backends.cpu.kernels import build, quantized_rows; "
             "print(build.group_rows(), quantized_rows.rounded_row_limit(), "
             "build.attention_query_bits())")
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # the AVX2 build: 4-row groups, 3 rows rounded to int16 codes, 16-bit query codes
    assert done.stdout.split()[-3:] == ["4", "3", "16"], done.stdout
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-n", "0", "-m", "not slow", "-k", BUILD_DEPENDENT, *KERNEL_TESTS],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
