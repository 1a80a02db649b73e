"""Tuners: launch-parameter sweeps that chose a kernel's committed defaults, run on a GPU.

Each times every launch variant of one kernel family (and checks its agreement with the
reference first), prints a table best first, and writes a JSON of everything it timed; the
kernel's defaults cite the run. Committed speed figures come from the suites
(``python -m bench <suite>``), not from here. Run one as ``python -m bench.tuning.<name>``:

- ``gumbel``: the Gumbel-max kernel (``kernels_pallas/gumbel.py``).
- ``sampling``: the dual-pivot samplers, renorm and mask kernels (``kernels_pallas/sampling.py``).
- ``speculative``: the chain speculative sampling kernel (``kernels_pallas/spec_accept.py``).

The autotuner that will replace these sweeps and the hand-kept tables (``docs/tuning.md``):
``python -m bench tune <kernel>`` (``tune.py``; the selection rule with its noise guard in
``autotune.py``; what it tunes of a kernel in ``<kernel>_target.py``, one for each kernel
with launch parameters, listed in ``tune.TARGETS``).

The decode kernel's sweep is part of its suite: ``python -m bench decode --tune``; the prefill
kernel's: ``python -m bench prefill --tune``.
"""
