"""The call site: a Llama-style model, its layers, the scheduler, the decode engine, the CLI.

Uses only the public functions of ``paged``, ``sampling`` and ``speculative``, so what is
benchmarked here is what users get.

- ``serving.model``, ``serving.layers``: the decoder (dense and paged forwards) and its norms.
- ``serving.requests``, ``serving.scheduler``: requests, continuous batching over fixed slots,
  page allocation, prefix sharing, preemption, speculative rewinds (host-side Python).
- ``serving.engine``: the scheduler's steps on the device, one jitted program a decode step
  (or a block of several plain steps), with speculative decoding by a draft model; host and
  device time per step; which backend ran.
- ``python -m serving``: ``generate`` (the trained tiny pair of ``serving/weights/``), ``demo``
  (``serving.demo``, behind ``make demo``) and ``paged-demo`` (``serving.paged_demo``).
"""
