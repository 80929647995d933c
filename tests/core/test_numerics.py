"""`core.numerics`: `auto` becomes bfloat16 only where the CPU has bfloat16 instructions and
the model is wide enough for them to pay, and the CPU facts a run records are read from the
machine, not assumed."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.numerics import BF16_FLAGS, BF16_MIN_HIDDEN, cpu_bf16_instructions, cpu_facts, resolve_dtype


@pytest.mark.parametrize("setting", ["float32", "bfloat16"])
def test_an_explicit_dtype_is_kept_on_any_machine(setting):
    for flags in ((), ("amx_bf16",)):
        assert resolve_dtype(setting, hidden_size=64, bf16_instructions=flags) == setting
    assert resolve_dtype(setting, hidden_size=4096, device="cuda") == setting


def test_auto_is_bfloat16_only_with_instructions_and_width():
    wide, narrow = BF16_MIN_HIDDEN, BF16_MIN_HIDDEN - 1
    assert resolve_dtype("auto", hidden_size=wide, bf16_instructions=("avx512_bf16",)) == "bfloat16"
    assert resolve_dtype("auto", hidden_size=wide, bf16_instructions=("amx_bf16",)) == "bfloat16"
    assert resolve_dtype("auto", hidden_size=narrow, bf16_instructions=("amx_bf16",)) == "float32"
    assert resolve_dtype("auto", hidden_size=wide, bf16_instructions=()) == "float32"
    assert resolve_dtype("auto", hidden_size=64, device="cuda:0") == "bfloat16"


def test_cpu_facts_come_from_this_machines_cpuinfo():
    text = Path("/proc/cpuinfo").read_text()
    flags = next(line.split(":", 1)[1].split() for line in text.splitlines()
                 if line.startswith("flags"))
    want = [flag for flag in BF16_FLAGS if flag in flags]
    assert list(cpu_bf16_instructions()) == want
    facts = cpu_facts()
    assert facts["cpu_bf16"] == want and facts["cpu"] in text
    assert resolve_dtype("auto", hidden_size=BF16_MIN_HIDDEN) == ("bfloat16" if want else "float32")
