"""Quality studies: what an approximation costs in model quality, measured on a trained model.

- ``python -m bench.quality.sparse_decode_quality``: bits per byte, greedy agreement with dense
  decoding and a retrieval check for sparse decode (Quest, an oracle token top-k, recent pages)
  at several budgets, on the long-context tiny target (``serving/weights/target_long``); writes
  ``docs/quality/<date>-sparse-decode-quality.{md,json}``.

These run on a CPU with the reference backends: they measure what the model predicts, not how
fast, so they belong neither to the benchmark suites nor to ``docs/benchmark_results/``.
"""
