"""Probes: one-off GPU measurements that answered a design question, kept so they can be re-run.

A probe times variants that no user runs (a noise generator, a sliced input, a two-level race)
or counts something without timing it, and prints what it found; its answer is quoted where it
was used, and a raw output that was committed sits in ``docs/benchmark_results/archive/`` with
a page beside it. Run one as ``python -m bench.probes.<name>``:

- ``gumbel``: where the Gumbel-max kernel's time goes, by generator and noise variant.
- ``gumbel_variants``: the rebuilt Gumbel kernel's internals (layout, rounds, prefetch, warps).
- ``gumbel_two_level``: what a two-level exponential race (noise for one block a row) costs.
- ``rounds``: dual-pivot rounds on the serving model's logits against synthetic ones (CPU).
- ``decode_clamps``: what the decode kernel's bounds clamps cost, against the kernels of
  earlier commits (``docs/benchmark_results/archive/2026-12-01-clamp-probe.md``).
- ``slice``: whether slicing a rotating set out of a stacked array copies before a Pallas call.
"""
