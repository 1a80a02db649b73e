"""Trains the tiny byte-level target and draft models on the Python standard library's sources.

``python -m serving.train_tiny --out serving/weights`` writes ``target.{npz,json}`` and
``draft.{npz,json}`` (``serving.model_files.save_model``). The committed files and the exact command
that made them are recorded in ``serving/weights/README.md``. ``--only target --target-name
target_long --seq-len 2048 --batch-size 2`` trains the target alone, with the same recipe on
longer windows (the same bytes per step), for the sparse decode quality study.

Data: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` except test suites and
installed packages (``test``, ``tests``, ``idle_test``, ``site-packages`` directories), sorted by
path, read as bytes: text present on every machine with Python, no download. Every 20th file
(in sorted order) is held out. Tokens are bytes (vocabulary 256), so no tokenizer is needed.

Training: windows of ``seq_len + 1`` bytes drawn at random (NumPy generator seeded by
``--seed``) from the training files' concatenation; next-byte cross-entropy; AdamW with linear
warm-up, cosine decay and gradient clipping (optax); float32. The target learns from the data.
The draft learns from the trained target (distillation: cross-entropy against the target's
predicted distribution), since what speculative decoding needs from a draft is agreement with
its target: a drafted token is accepted with probability ``sum_x min(p(x), q(x))`` on average
(``p`` the target, ``q`` the draft), which the script reports on held-out text.

Losses are reported in bits per byte. Evaluation uses the saved (bfloat16-rounded) weights.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from serving.config import TINY_DRAFT, TINY_TARGET, ModelConfig
from serving.model import forward_dense, init_params, param_count
from serving.model_files import load_model, save_model

EXCLUDED_DIRECTORIES = ("test", "tests", "idle_test", "site-packages")
HELD_OUT_EVERY = 20  # file i (sorted) is held out when i % 20 == 19
EVAL_WINDOWS = 64
EVAL_CHUNK_BYTES = 64 * 256  # windows evaluated together: the 256-byte recipe's 64 at once
BITS_PER_NAT = 1 / math.log(2)


def stdlib_sources() -> list[pathlib.Path]:
    """The standard library's ``.py`` files, test suites and installed packages excluded, sorted
    by their path relative to the library root (the same order on every machine)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in root.rglob("*.py")
        if not set(path.relative_to(root).parts[:-1]) & set(EXCLUDED_DIRECTORIES)
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def split_corpus(files: list[pathlib.Path]) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held_out)``: uint8 byte streams, each the concatenation of its files."""
    train, held_out = [], []
    for index, path in enumerate(files):
        (held_out if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(
            path.read_bytes()
        )
    as_array = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8)
    return as_array(train), as_array(held_out)


def windows(stream: np.ndarray, rng: np.random.Generator, count: int, length: int) -> np.ndarray:
    """int32 ``[count, length]``: byte windows starting at random offsets of ``stream``."""
    starts = rng.integers(0, stream.shape[0] - length, size=count)
    return np.stack([stream[start : start + length] for start in starts]).astype(np.int32)


def next_byte_loss(params, config: ModelConfig, batch: jax.Array) -> jax.Array:
    """Mean cross-entropy (nats) of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``."""
    logits = forward_dense(params, config, batch[:, :-1], backend="reference")
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def distillation_loss(params, config, batch, teacher_logits) -> jax.Array:
    """Mean cross-entropy (nats) of the draft against the teacher's next-byte distribution."""
    logits = forward_dense(params, config, batch[:, :-1], backend="reference")
    return optax.softmax_cross_entropy(logits, jax.nn.softmax(teacher_logits)).mean()


def make_optimizer(learning_rate: float, steps: int) -> optax.GradientTransformation:
    warmup = max(1, steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup, steps, end_value=learning_rate / 10
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.01),
    )


def train(
    config: ModelConfig,
    train_stream: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    learning_rate: float,
    seed: int,
    teacher=None,
    log_every: int = 50,
):
    """Trains ``config`` from a fresh initialization; returns ``(params, recent_train_nats)``.

    With ``teacher = (teacher_config, teacher_params)`` the loss is distillation from it;
    otherwise next-byte cross-entropy on the data.
    """
    params = init_params(config, jax.random.key(seed))
    optimizer = make_optimizer(learning_rate, steps)
    state = optimizer.init(params)

    if teacher is None:
        loss_fn = lambda params, batch: next_byte_loss(params, config, batch)
    else:
        teacher_config, teacher_params = teacher

        def loss_fn(params, batch):
            teacher_logits = forward_dense(
                teacher_params, teacher_config, batch[:, :-1], backend="reference"
            )
            return distillation_loss(params, config, batch, teacher_logits)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(seed)
    losses = []
    for index in range(steps):
        batch = jnp.asarray(windows(train_stream, rng, batch_size, seq_len + 1))
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
        if (index + 1) % log_every == 0 or index == 0:
            recent = np.mean(losses[-log_every:])
            print(f"  step {index + 1:5d}/{steps}  loss {recent * BITS_PER_NAT:.3f} bits/byte")
            sys.stdout.flush()
    return params, float(np.mean(losses[-log_every:]))


def evaluate(config, params, stream: np.ndarray, seed: int, seq_len: int) -> float:
    """Next-byte loss in bits per byte on ``EVAL_WINDOWS`` fixed windows of ``stream``.

    The windows go through the model in chunks of at most ``EVAL_CHUNK_BYTES`` bytes (all 64 at
    once for 256-byte windows, as before): dense attention holds every score, quadratic in the
    window length, and 64 windows of 2048 bytes would need gigabytes.
    """
    batch = windows(stream, np.random.default_rng(seed), EVAL_WINDOWS, seq_len + 1)
    loss = jax.jit(lambda params, batch: next_byte_loss(params, config, batch))
    chunk = max(1, min(EVAL_WINDOWS, EVAL_CHUNK_BYTES // seq_len))
    total_nats = 0.0
    for start in range(0, EVAL_WINDOWS, chunk):
        part = batch[start : start + chunk]
        total_nats += float(loss(params, jnp.asarray(part))) * part.shape[0]
    return total_nats / EVAL_WINDOWS * BITS_PER_NAT


def expected_acceptance(target, draft, stream: np.ndarray, seed: int, seq_len: int) -> float:
    """Mean over held-out positions of ``sum_x min(p(x), q(x))`` at temperature 1: the chance
    that a drafted byte is accepted."""
    batch = jnp.asarray(windows(stream, np.random.default_rng(seed), EVAL_WINDOWS, seq_len))
    p = jax.nn.softmax(forward_dense(target[1], target[0], batch, backend="reference"))
    q = jax.nn.softmax(forward_dense(draft[1], draft[0], batch, backend="reference"))
    return float(jnp.minimum(p, q).sum(-1).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serving.train_tiny", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, help="directory for target.* and draft.*")
    parser.add_argument(
        "--only",
        choices=("both", "target"),
        default="both",
        help="'target': train the target alone (no draft, no acceptance figure)",
    )
    parser.add_argument(
        "--target-name", default="target", help="file stem of the target under --out"
    )
    parser.add_argument("--seed", type=int, default=0, help="initialization and data order")
    parser.add_argument("--target-steps", type=int, default=600)
    parser.add_argument("--draft-steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=16, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=256, help="bytes per window")
    parser.add_argument("--target-lr", type=float, default=3e-3)
    parser.add_argument("--draft-lr", type=float, default=5e-3)
    args = parser.parse_args(argv)
    if args.only == "both" and args.target_name == "draft":
        parser.error("--target-name draft would overwrite the draft (train it with --only target)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    files = stdlib_sources()
    train_stream, held_out_stream = split_corpus(files)
    data = {
        "python": sys.version.split()[0],
        "files": len(files),
        "train_bytes": int(train_stream.shape[0]),
        "held_out_bytes": int(held_out_stream.shape[0]),
        "held_out_rule": f"file i of the sorted list when i % {HELD_OUT_EVERY} == "
        f"{HELD_OUT_EVERY - 1}",
    }
    print(f"data: {data}")
    common = {
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "command": "python -m serving.train_tiny "
        + " ".join(sys.argv[1:] if argv is None else argv),
    }

    models = [(args.target_name, TINY_TARGET, args.target_steps, args.target_lr)]
    if args.only == "both":
        models.append(("draft", TINY_DRAFT, args.draft_steps, args.draft_lr))
    results = {}
    teacher = None
    for name, config, steps, lr in models:
        print(f"{name}: {param_count(init_params(config, jax.random.key(0)))} parameters")
        started = time.perf_counter()
        params, recent_nats = train(
            config,
            train_stream,
            steps=steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            learning_rate=lr,
            seed=args.seed,
            teacher=teacher,
        )
        wall_s = time.perf_counter() - started
        metadata = {
            "data": data,
            "training": {
                **common,
                "steps": steps,
                "learning_rate": lr,
                "objective": "distillation from target" if teacher else "next-byte",
                "wall_s": round(wall_s, 1),
                "final_objective_bits_per_byte_last_50_steps": round(recent_nats * BITS_PER_NAT, 4),
            },
        }
        stem = out / name
        save_model(stem, config, params, metadata=metadata)
        config, params = load_model(stem)  # evaluate what was saved (bfloat16-rounded)
        metadata["evaluation"] = {
            "train_bits_per_byte": round(
                evaluate(config, params, train_stream, 1, args.seq_len), 4
            ),
            "held_out_bits_per_byte": round(
                evaluate(config, params, held_out_stream, 2, args.seq_len), 4
            ),
            "windows": EVAL_WINDOWS,
        }
        results[name] = (config, params, metadata)
        if teacher is None:
            teacher = (config, params)
        print(f"{name}: {wall_s:.0f} s, {metadata['evaluation']}")

    if args.only == "target":  # no draft: record the evaluation now
        for name, (config, params, metadata) in results.items():
            save_model(out / name, config, params, metadata=metadata)
        return 0
    acceptance = expected_acceptance(
        results[args.target_name][:2], results["draft"][:2], held_out_stream, 3, args.seq_len
    )
    print(f"expected acceptance of a drafted byte (temperature 1, held out): {acceptance:.3f}")
    for name, (config, params, metadata) in results.items():
        metadata["evaluation"]["expected_acceptance_temperature_1"] = round(acceptance, 4)
        save_model(out / name, config, params, metadata=metadata)
    return 0


if __name__ == "__main__":
    sys.exit(main())
