"""The CPU fast paths change speed, never results."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_utils import make_engine, run
from torch import nn

from pagedserve.engine import SamplingParams
from pagedserve.engine.model_runner import bf16_packing_supported
from pagedserve.models.llama import PackedLinear

needs_bf16_packing = pytest.mark.skipif(
    not bf16_packing_supported(), reason="oneDNN packs bf16 only on CPUs with native bf16")


@needs_bf16_packing
def test_packed_linear_is_bit_identical_to_linear():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for rows in (1, 5, 64, 130):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(packed(x), linear(x))


def test_packed_float32_linear_matches_linear_to_rounding():
    """oneDNN's float32 kernels sum in another order than F.linear's BLAS: the same values
    to float32 rounding, not the same bits."""
    torch.manual_seed(0)
    linear = nn.Linear(576, 960)
    packed = PackedLinear(linear)
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_float32_engine_packs_every_linear_and_the_lm_head(embedded):
    engine = make_engine(embedded, dtype="float32")
    assert not any(isinstance(m, nn.Linear) for m in engine.model.modules())
    assert isinstance(engine.model.lm_head, PackedLinear)  # a packed copy of the tied matrix


def test_bf16_engine_answers_and_packs_only_where_the_cpu_can(embedded):
    engine = make_engine(embedded, dtype="bfloat16")
    packed = any(isinstance(m, PackedLinear) for m in engine.model.modules())
    assert packed == bf16_packing_supported()
    text = embedded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    ids = embedded.tokenizer.encode(text, add_special_tokens=False)
    [out] = run(engine, [ids], SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out.outputs[0].text


def _anon_huge_kib(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, end) (madvise splits
    a mapping where the advice starts)."""
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            overlaps = int(m[1], 16) < end and start < int(m[2], 16)
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="the kernel has no transparent huge pages")
def test_kv_cache_sits_on_huge_pages(embedded):
    engine = make_engine(embedded, dtype="float32", num_kv_blocks=512)  # 2 x 90 MiB
    for cache in (engine.runner.k_caches, engine.runner.v_caches):
        size = cache.numel() * cache.element_size()
        assert _anon_huge_kib(cache.data_ptr(), cache.data_ptr() + size) >= size // 1024 // 2


@pytest.mark.parametrize("preset, want", [
    ({}, ("30000", None)),  # the default: a short spin, then sleep
    ({"OMP_WAIT_POLICY": "PASSIVE"}, (None, "PASSIVE")),  # the user's policy stands
    ({"GOMP_SPINCOUNT": "0"}, ("0", None)),
])
def test_import_sets_a_short_openmp_spin_unless_the_user_chose(preset, want):
    """Set at import, before torch starts OpenMP: what libgomp reads (docs/performance.md §5)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    script = "import os, pagedserve; print(os.environ.get('GOMP_SPINCOUNT'), " \
             "os.environ.get('OMP_WAIT_POLICY'))"
    p = subprocess.run([sys.executable, "-c", script], env={**env, **preset},
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == [str(w) for w in want]
