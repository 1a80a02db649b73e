"""The timed loop keeps every call inside its loop (``bench.harness.timing.TimedLoop``).

A call that XLA can prove loop-invariant is hoisted out of the ``fori_loop`` and run once, so
the program times almost nothing. With one input set the index ``call_index % 1`` is the
constant 0; an H100 run of ``bench/probes/mla_decode.py`` reported eight times the copy
ceiling for its one-set cases before ``TimedLoop`` hid the index and operands behind an
optimization barrier. These tests read XLA's compiled CPU program: the matmul under test must
sit in the loop's body once per unrolled call, and no operand may be copied to get it there.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from bench.harness.timing import TimedLoop

SIZE = 64
UNROLL = 4


def _computations(hlo_text: str) -> dict[str, str]:
    """The compiled module's computations by name (each one's text, header included)."""
    by_name = {}
    for block in re.split(r"\n(?=\S)", hlo_text):
        match = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
        if match:
            by_name[match.group(1)] = block
    return by_name


def dots_inside_the_loop(hlo_text: str) -> int:
    """Dot instructions reachable from the while loop's body (fusions and calls followed)."""
    computations = _computations(hlo_text)
    body = re.search(r" while\(.*?body=%?([\w.\-]+)", hlo_text).group(1)
    seen, pending, dots = set(), [body], 0
    while pending:
        name = pending.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        text = computations[name]
        dots += len(re.findall(r" dot\(", text))
        pending += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", text)
    return dots


def compiled_program(num_sets: int) -> str:
    operands = jnp.ones((num_sets, SIZE, SIZE), jnp.float32)
    loop = TimedLoop(lambda s, stacked: stacked[s] @ stacked[s], num_sets, operands, unroll=UNROLL)
    return loop.program(2 * UNROLL).lower(operands).compile().as_text()


@pytest.mark.parametrize("num_sets", [1, 2])
def test_every_unrolled_call_stays_in_the_loop(num_sets):
    assert dots_inside_the_loop(compiled_program(num_sets)) == UNROLL


def test_one_set_is_not_copied_to_keep_its_calls_in_the_loop():
    copies = re.findall(r"= (\S+) copy\(", compiled_program(1))
    assert not [shape for shape in copies if f"{SIZE},{SIZE}" in shape], copies
