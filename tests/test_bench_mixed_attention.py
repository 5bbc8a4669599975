"""scripts/bench_triton_kernels.py's mixed-step attention, which gpu-check step 4w times to
decide whether whole graphs may be the default at long contexts: its three ways of
attending decodes beside a prompt chunk (the whole graph's flat grid, the eager split, and
the sketch of split-KV inside a whole graph) must give the same rows, or the times it
reports compare different work. Interpreted, in float32 (exact dots), untimed."""

from pathlib import Path

import pytest
import torch


@pytest.mark.parametrize(("ctx", "prompt"), [(600, 40), (30, 40)])
def test_the_three_ways_give_the_same_rows(ctx: int, prompt: int, monkeypatch) -> None:
    """600-token decodes split in the eager path (two partitions) and in the sketch (16
    asked for, 5 of 128 tokens used); 30-token ones beside a longer prompt."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_triton_kernels

    monkeypatch.setattr(bench_triton_kernels, "median_ms", lambda fn, device, reps: 0.0)
    case = dict(seqs=3, ctx=ctx, prompt=prompt, heads=4, kv_heads=2, d=32, max_seqs=8,
                table_ctx=1024)
    row = bench_triton_kernels.bench_mixed(case, torch.float32, torch.device("cpu"), 1)
    assert row["max_abs_diff"] < 1e-5
