"""Benchmark tooling: `pagedserve bench serve` (load-test any OpenAI-compatible server) and
`pagedserve bench throughput` (offline engine workloads, an HF transformers baseline and a
matmul roofline). Nothing in the package imports this one except `pagedserve.cli`."""
