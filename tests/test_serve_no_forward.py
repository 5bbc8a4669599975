"""scripts/serve_no_forward.py, the fake forward the host-cost measurements serve with
(docs/performance-gpu.md), replaces ModelRunner.run and DecodeGraphs._forward: its
functions must take what the runner passes them, which only a run of the script would
otherwise show."""

from pathlib import Path

from engine_utils import greedy, make_engine, prompts_of_lengths, run

from pagedserve.engine.cuda_graphs import DecodeGraphs
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.kernels import REFERENCE


def test_fixed_logits_serve_every_kind_of_step(tiny_llama, monkeypatch) -> None:
    """Eager steps with prompt chunks, decode graphs, and the warm-up's plain forward of an
    engine with whole graphs: every one runs on the fixed logits, and the requests end."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import serve_no_forward

    monkeypatch.setattr(ModelRunner, "run", serve_no_forward.fixed_logits)
    monkeypatch.setattr(DecodeGraphs, "_forward", serve_no_forward.fixed_graph_logits)
    engine = make_engine(tiny_llama, REFERENCE, enforce_eager=False, piecewise_graphs=True,
                         full_graphs=True, max_num_seqs=4, max_num_batched_tokens=32)
    engine.runner.warm_up(engine.config.max_num_batched_tokens, engine.max_model_len)
    outputs = run(engine, prompts_of_lengths([40, 9, 3], seed=5), greedy(5))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5, 5]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_narrow_rows_pick_text_tokens(tiny_llama, monkeypatch) -> None:
    """``LOGITS_WIDTH=64`` rows: every sampled id lies in [32, 64), past the special ids, so
    every token streams text (a request sampling only special ids streamed none)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import serve_no_forward

    monkeypatch.setattr(serve_no_forward, "_width", 64)
    monkeypatch.setattr(serve_no_forward, "_fixed", {})
    monkeypatch.setattr(ModelRunner, "run", serve_no_forward.fixed_logits)
    engine = make_engine(tiny_llama, REFERENCE, max_num_seqs=64)
    outputs = run(engine, prompts_of_lengths([7] * 64, seed=3), greedy(4))
    ids = {i for o in outputs for i in o.outputs[0].token_ids}
    assert min(ids) >= 32 and max(ids) < 64 and len(ids) > 8
