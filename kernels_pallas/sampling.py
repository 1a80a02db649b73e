"""Sampling kernels (Pallas, Triton lowering): the public names of the three families, each in
its own module:

- ``gumbel_sample`` (``kernels_pallas/gumbel.py``): the Gumbel-max race, one pass, no softmax,
  no noise array, one launch;
- ``dual_pivot_sample`` (``kernels_pallas/dual_pivot.py``): top-k, top-p, min-p and joint
  filtered sampling by dual-pivot rejection, one pass a round;
- ``filter_rows`` (``kernels_pallas/filter_masks.py``): top-k / top-p renormalization and
  top-k masking of logits by radix selection.

All three were written against the references of ``sampling/`` and checked in interpret mode;
``kernels_pallas.platform.AUTO_PICKS_KERNEL`` records which ones were also compiled, checked and
measured faster than the reference on a GPU.
"""

from __future__ import annotations

from kernels_pallas.dual_pivot import dual_pivot_sample
from kernels_pallas.filter_masks import filter_rows
from kernels_pallas.gumbel import MIN_TEMPERATURE, gumbel_sample

__all__ = ["MIN_TEMPERATURE", "dual_pivot_sample", "filter_rows", "gumbel_sample"]
