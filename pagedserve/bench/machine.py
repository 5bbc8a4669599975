"""The facts every CPU figure is quoted with: the CPU's model name and the instruction-set
extensions that decide which kernels and dtypes run fast (AVX2/FMA for float32, AVX-512 and
AMX with native bf16)."""

import os
import platform
from functools import cache
from typing import Any

# The flags that change which code paths PyTorch, oneDNN and our C++ kernels take.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")


@cache
def machine_facts() -> dict[str, Any]:
    cpu, flags = platform.processor() or platform.machine(), set()
    # x86 family/model: the model name alone ("AMD EPYC") does not tell Zen 4 from Zen 5.
    generation: dict[str, int] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    cpu = value.strip()
                elif key in ("cpu family", "model") and value.strip().isdigit():
                    generation[key.split()[-1]] = int(value)
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:  # not Linux: the model name from platform, no flags
        pass
    return {"cpu": cpu, **generation, "isa": [f for f in ISA_FLAGS if f in flags],
            "logical_cpus": os.cpu_count()}


def describe(facts: dict[str, Any]) -> str:
    """'AMD EPYC, 2 logical CPUs, avx2 fma f16c (no AVX-512, no AMX)'."""
    isa = facts.get("isa") or []
    missing = [name for name, flag in (("AVX-512", "avx512f"), ("AMX", "amx_tile"))
               if flag not in isa]
    tail = f" (no {', no '.join(missing)})" if missing else ""
    generation = (f" (family {facts['family']}, model {facts['model']})"
                  if "family" in facts and "model" in facts else "")
    return (f"{facts['cpu']}{generation}, {facts['logical_cpus']} logical CPUs, "
            f"{' '.join(isa)}{tail}")
