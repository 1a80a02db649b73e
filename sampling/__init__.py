"""Samplers with explicit randomness (arrives with the sampling issue).

Will hold Gumbel-max sampling from logits and sorting-free top-k / top-p / min-p sampling by
dual-pivot rejection: the pure-JAX references (with ``*_from_uniforms`` forms for exact
enumeration), input validation, and public functions with ``backend=``.
"""
