"""The demonstration behind ``make demo``: the trained byte-level pair through the engine.

Several prompts (more than there are slots, so continuous batching admits them as others
finish) are decoded with top-p sampling and speculative decoding by the tiny target and draft
of ``serving/weights/``, then once more without speculation. It prints the generated text, the
measured acceptance against the formula's prediction, tokens per second, where a step's time
goes (host against device), and which backend ran each operation. It ends with ``OK`` when
every request finished and both pools came back full. Requests are numbered from 1 (``spec-1``
.. ``spec-6``, ``plain-1`` ..), as everywhere on the command line; request ``k`` samples from
``seed + k - 1``.

The prediction: with drafts accepted independently at rate ``alpha``, a verification step
emits ``(1 - alpha^(n + 1)) / (1 - alpha)`` tokens on average. ``alpha`` is measured (accepted
drafts over drafts tested, every position pooled), so the comparison tests independence across
positions, not the rate itself; the per-position rates show how far from constant it is.

Also here, shared with the command line: loading the pair and the byte-level text codec (a
token is a byte; output bytes that are not valid UTF-8 print as U+FFFD).
"""

from __future__ import annotations

import pathlib
import time

import numpy as np

from serving.engine import Engine
from serving.model_files import load_model
from serving.paged_demo import device_description
from serving.requests import Request, SamplingParams

WEIGHTS = pathlib.Path(__file__).parent / "weights"
PROMPTS = (
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n        ",
    "    for line in lines:\n        if ",
    "# Copyright ",
    "    raise ValueError(",
)
# The pair's held-out expectation at temperature 1 without filters (serving/weights/README.md).
OFFLINE_ALPHA = 0.851


def load_tiny_pair(directory=WEIGHTS):
    """``(target, draft)``, each ``(ModelConfig, params)``, from ``serving/weights/``."""
    directory = pathlib.Path(directory)
    return load_model(directory / "target"), load_model(directory / "draft")


def encode_text(text: str) -> list[int]:
    """The byte-level tokens of ``text`` (UTF-8)."""
    return list(text.encode("utf-8"))


def decode_tokens(tokens) -> str:
    """Bytes back to text; invalid UTF-8 (a tiny model's output can be) becomes U+FFFD."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def _run(engine: Engine, requests: list[Request]) -> tuple[list, list, float]:
    """Generates; returns the outputs, the per-step stats and the wall time."""
    steps = []
    start = time.perf_counter()
    outputs = engine.generate(requests, progress_callback=lambda out: steps.append(out.stats))
    return outputs, steps, time.perf_counter() - start


def _speed_line(label: str, outputs, steps, wall_s: float) -> str:
    tokens = sum(len(out.token_ids) for out in outputs)
    warm = [s for s in steps if not s.compiled]
    warm_s = sum(s.total_s for s in warm)
    warm_tokens = sum(s.num_emitted for s in warm)
    return (
        f"{label:<13} {tokens} tokens in {len(steps)} steps, {wall_s:.1f} s wall "
        f"(compiling included); {warm_tokens / warm_s:.0f} tokens/s over the "
        f"{len(warm)} steps that compiled nothing"
    )


def run_demo(
    *,
    backend: str = "auto",
    seed: int = 0,
    max_tokens: int = 160,
    num_speculative: int = 4,
    parallel: int = 4,
    temperature: float = 0.8,
    top_p: float = 0.9,
) -> int:
    """Runs the demonstration; returns the exit status (0 when everything checked out)."""
    print(f"decodelab serving demo on {device_description()}")
    target, draft = load_tiny_pair()
    print(
        f"target {target[0].num_layers} layers x {target[0].hidden}, draft "
        f"{draft[0].num_layers} layers x {draft[0].hidden}, bytes as tokens; "
        f"{len(PROMPTS)} prompts on {parallel} slots, n={num_speculative} drafts, "
        f"temperature {temperature}, top-p {top_p}, {max_tokens} tokens each"
    )

    def requests(prefix: str) -> list[Request]:
        params = [
            SamplingParams(
                temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed + index
            )
            for index in range(len(PROMPTS))
        ]
        return [
            Request(f"{prefix}-{number}", encode_text(prompt), p)
            for number, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True), start=1)
        ]

    pages = -(-(max(map(len, PROMPTS)) + max_tokens + num_speculative) // 16)
    options = dict(num_pages=parallel * pages + 1, page_size=16, parallel=parallel)
    options.update(backend=backend, prefill_chunk_size=64)
    speculative = Engine(target, draft, num_speculative=num_speculative, **options)
    outputs, steps, wall_s = _run(speculative, requests("spec"))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        print(f"\n--- {output.request_id} ({len(output.token_ids)} tokens) ---")
        print(prompt + decode_tokens(output.token_ids))

    stats = speculative.acceptance
    rates = ", ".join(f"{rate:.3f}" for rate in stats.rate_at())
    print(f"\nacceptance over {stats.rows} verification rows, per draft position: {rates}")
    print(
        f"alpha (accepted / tested, pooled) {stats.alpha:.3f}; the pair's held-out "
        f"expectation at temperature 1, no filter: {OFFLINE_ALPHA}"
    )
    print(
        f"tokens per verification step: predicted (1 - alpha^{num_speculative + 1}) / "
        f"(1 - alpha) = {stats.predicted_tokens_per_step:.3f}, measured "
        f"{stats.measured_tokens_per_step:.3f}"
    )

    plain = Engine(target, None, **options)
    plain_outputs, plain_steps, plain_wall_s = _run(plain, requests("plain"))
    print()
    print(_speed_line("speculative", outputs, steps, wall_s))
    print(_speed_line("plain", plain_outputs, plain_steps, plain_wall_s))
    warm = [s for s in steps if not s.compiled and s.num_decode_rows]
    print(
        f"per speculative step (medians of {len(warm)}): host "
        f"{1e3 * np.median([s.host_s for s in warm]):.2f} ms (scheduling, tables, plans), "
        f"device {1e3 * np.median([s.decode_s for s in warm]):.2f} ms (one jitted program)"
    )

    print(f"\nwhich backend ran each operation (backend={backend!r}):")
    for op, implementation in speculative.backend_report().items():
        print(f"  {op:<40} {implementation}")
    for op, implementation in plain.backend_report().items():
        if op.startswith("decode: sampling"):
            print(f"  {'plain ' + op:<40} {implementation}")

    # No stop tokens here: every request must end by length, with exactly max_tokens tokens.
    finished = all(
        output.finish_reason == "length" and len(output.token_ids) == max_tokens
        for output in (*outputs, *plain_outputs)
    ) and len(outputs) == len(plain_outputs) == len(PROMPTS)
    full = all(
        engine.scheduler.pool.num_free == engine.scheduler.usable_pages
        for engine in (speculative, plain)
    )
    print(f"\nall requests finished: {finished}; page pools back to full: {full}")
    ok = finished and full
    print("OK" if ok else "FAILED")
    return 0 if ok else 1
