"""What sparse decode costs in quality: the long-context tiny target, teacher-forced, on the CPU.

``python -m bench.quality.sparse_decode_quality --out docs/quality`` writes
``<date>-sparse-decode-quality.{json,md}``.

Data: ``--files`` held-out files of the tiny model's corpus (``serving.train_tiny``'s split) at
least ``--window + 1`` bytes long, chosen by a NumPy generator seeded by ``--seed``, each cut to
its first ``window + 1`` bytes.

Each window's first ``window - decode`` bytes are prefilled densely into a paged KV cache
(``serving.model.forward_paged``). Then the last ``decode`` positions run one token at a time,
teacher-forced (the true byte is fed, whatever the model predicted), every layer attending
through one *method*:

- ``dense``: ``paged.decode_attention``, every key;
- ``quest_kv_head``, ``quest_query_head``: ``paged.sparse_decode_attention`` with a
  ``QuestSelection`` (``per="kv_head"``, ``per="query_head"``);
- ``oracle_top_k``: a ``TokenSelection`` of the tokens that receive the most attention, summed
  over the layer's heads, shared by every head (``bench.quality.sparse_selections``): an upper
  bound of a trained lightning indexer, which this project does not have;
- ``recent_pages``: a ``BlockSelection`` of the first page and the most recent pages, Quest's
  page count (only the scoring differs from Quest; ``paged.recent_pages_selection``);
- ``quest_two_last_pages``: Quest per KV head with the page before the last forced in too (an
  ablation: does Quest lose where its last page holds few recent tokens?).

Budgets are fractions of the window (``--window``): ``window / 16`` to ``window / 2`` tokens
per (request, head), Quest rounding to whole pages. Every op runs with
``backend="reference"``, the decode of a method is one ``jax.lax.scan`` over positions,
``vmap``-ed over files (a batch of one request each: the reference decode attends every row
over every listed slot, so one batch of all files would cost files-squared).

Per decoded position and method: the log-probability of the true next byte and the argmax.
Reported per method and budget: bits per byte, greedy agreement with dense (argmax equal),
the KL divergence from dense (bits), the mean fraction of the context read, the same by the new
token's slot in its page, and the retrieval check: ``--retrieval-cases`` names defined early and
used again at least ``--min-gap`` bytes after their previous occurrence
(``bench.quality.retrieval_cases``), each in its own window that ends with the use, of which the
last 16 positions are decoded by the method and the name's bytes after its first are scored.

The defaults are the committed run's (``docs/quality/2026-12-02-sparse-decode-quality.md``):
16 files, 128 decoded positions each, 32 retrieval cases; about 8 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import subprocess
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np

import paged
from bench.quality.retrieval_cases import retrieval_windows
from bench.quality.sparse_selections import oracle_top_k_selection, quest_two_last_pages_selected
from paged.sparse_quest import head_split_cache, head_split_page_table
from serving.config import ModelConfig

# _decoder is the model with its attention plugged in, the hook forward_dense and forward_paged
# are built on; the study's step needs an attention other than decode_attention.
from serving.model import _decoder, forward_paged, new_caches
from serving.model_files import load_model
from serving.train_tiny import HELD_OUT_EVERY, stdlib_sources

KINDS = (
    "dense",
    "quest_kv_head",
    "quest_query_head",
    "quest_two_last_pages",
    "oracle_top_k",
    "recent_pages",
)
SPARSE_KINDS = KINDS[1:]
FRACTIONS = (16, 8, 4, 2)  # budget = window // fraction
BITS_PER_NAT = 1 / math.log(2)
BACKEND = "reference"
MAX_NAME_BYTES = 17  # retrieval: names up to 17 bytes, so 16 decoded positions score them all


@dataclasses.dataclass(frozen=True)
class Method:
    """How each layer of a decode step attends (hashable: static under ``jit``).

    Attributes:
      kind: one of ``KINDS``.
      token_budget: tokens each (request, head) reads; ``None`` for ``dense``.
    """

    kind: str
    token_budget: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "dense") != (self.token_budget is None):
            raise ValueError(
                f"token_budget must be None exactly for 'dense', got {self.token_budget!r} "
                f"for {self.kind!r}"
            )

    @property
    def name(self) -> str:
        return self.kind if self.token_budget is None else f"{self.kind}@{self.token_budget}"


def prefix_page_table(seq_len: jax.Array, num_pages: int, page_size: int) -> paged.PageTable:
    """One request of ``seq_len`` tokens (traced) on pages ``0, 1, ...`` of a ``num_pages`` pool;
    ``page_indices`` padded with 0 to ``num_pages`` entries (static shapes along a decode)."""
    pages = (seq_len + page_size - 1) // page_size
    slots = jnp.arange(num_pages, dtype=jnp.int32)
    return paged.PageTable(
        jnp.stack([jnp.int32(0), pages]).astype(jnp.int32),
        jnp.where(slots < pages, slots, 0),
        jnp.reshape(seq_len - (pages - 1) * page_size, (1,)).astype(jnp.int32),
        page_size,
    )


def attend(method: Method, q: jax.Array, cache: paged.KVCache, table: paged.PageTable):
    """One layer's attention of the new tokens ``q [B, Hq, D]`` (rotated) by ``method``."""
    if method.kind == "dense":
        return paged.decode_attention(q, cache, table, backend=BACKEND)
    if method.kind == "quest_two_last_pages":
        # Quest's virtual table by hand (paged.sparse.sparse_page_table's Quest branch), since
        # the page mask is not Quest's own.
        bounds = paged.page_key_bounds(cache, table)
        selected = quest_two_last_pages_selected(q, bounds, table, method.token_budget)
        view_table = head_split_page_table(table, selected, cache.num_kv_heads)
        batch, num_heads, head_dim = q.shape
        rows = q.reshape(batch * cache.num_kv_heads, num_heads // cache.num_kv_heads, head_dim)
        o = paged.decode_attention(rows, head_split_cache(cache), view_table, backend=BACKEND)
        return o.reshape(q.shape)
    if method.kind.startswith("quest_"):
        # Recomputed from the keys each step: update_page_key_bounds would give the same bounds
        # exactly (tests/test_sparse_quest.py), at the price of carrying them through the scan.
        bounds = paged.page_key_bounds(cache, table)
        per = method.kind.removeprefix("quest_")
        selection = paged.QuestSelection(bounds, method.token_budget, per)
    elif method.kind == "oracle_top_k":
        selection = oracle_top_k_selection(q, cache, table, method.token_budget)
    else:
        selection = paged.recent_pages_selection(table, method.token_budget)
    return paged.sparse_decode_attention(q, cache, table, selection, backend=BACKEND)


def decode_step(params, config: ModelConfig, method: Method, caches, tokens, table):
    """One teacher-forced step: ``tokens int32 [B]`` at each request's last position.

    Returns:
      ``(logits float32 [B, V], caches)`` with the new keys and values appended.
    """
    batch = tokens.shape[0]
    positions = table.seq_lens() - 1  # [B]
    batch_indices = jnp.arange(batch, dtype=jnp.int32)
    updated = []

    def attention(index, q, k, v):  # q [B, 1, Hq, D], k and v [B, 1, Hkv, D]
        q_rotated, cache = paged.rope_append_kv(
            q[:, 0],
            k[:, 0],
            v[:, 0],
            positions,
            batch_indices,
            caches[index],
            table,
            rope=config.rope,
            backend=BACKEND,
        )
        updated.append(cache)
        return attend(method, q_rotated, cache, table).reshape(q.shape)

    logits = _decoder(params, config, tokens[:, None], attention, BACKEND)
    return logits[:, 0], updated


def prefill(params, config: ModelConfig, tokens: jax.Array, num_pages: int, page_size: int):
    """Dense prefill of one request ``tokens int32 [P]``: the caches of its ``P`` tokens."""
    caches = new_caches(config, num_pages, page_size)
    table = prefix_page_table(jnp.int32(tokens.shape[0]), num_pages, page_size)
    _, caches = forward_paged(params, config, tokens[None], caches, table, backend=BACKEND)
    return caches


def teacher_forced(
    params,
    config: ModelConfig,
    method: Method,
    prefilled,
    windows: jax.Array,
    decode_start: int,
    page_size: int,
    dense_log_probs: jax.Array | None = None,
):
    """Decodes positions ``decode_start .. W - 1`` of every window with ``method``.

    Args:
      prefilled: per file (leading axis ``F``) caches holding positions ``< decode_start``.
      windows: int32 ``[F, W + 1]``: position ``p`` reads byte ``p`` and predicts byte ``p + 1``.
      dense_log_probs: ``[N, F, V]`` dense's log-probabilities, for the KL divergence; ``None``
        for ``dense`` itself.

    Returns:
      ``(outputs, timings)``: ``outputs`` a dict of ``[N, F]`` NumPy arrays (``N = W -
      decode_start``): ``log_prob`` of the true next byte (nats), ``argmax``, ``kl`` from dense
      (nats; zeros for dense), and for ``dense`` also ``log_probs [N, F, V]``; ``timings`` the
      compilation and run seconds.
    """
    num_pages = prefilled[0].k_pages.shape[1]
    width = windows.shape[1] - 1
    positions = jnp.arange(decode_start, width, dtype=jnp.int32)
    if dense_log_probs is None:
        if method.kind != "dense":
            raise ValueError(f"{method.name} needs dense_log_probs (dense's outputs)")
        dense_log_probs = jnp.zeros((positions.shape[0], windows.shape[0], config.vocab_size))
    arguments = (params, prefilled, windows, positions, dense_log_probs)
    started = time.perf_counter()
    compiled = _teacher_forced.lower(config, method, page_size, num_pages, *arguments).compile()
    compiled_at = time.perf_counter()
    outputs = jax.tree.map(np.asarray, compiled(*arguments))
    timings = {
        "compile_s": round(compiled_at - started, 1),
        "run_s": round(time.perf_counter() - compiled_at, 1),
    }
    return outputs, timings


@jax.jit(static_argnums=(0, 1, 2, 3))
def _teacher_forced(
    config, method, page_size, num_pages, params, prefilled, windows, positions, dense_log_probs
):
    def one_file(caches, token, position):
        table = prefix_page_table(position + 1, num_pages, page_size)
        logits, caches = decode_step(params, config, method, caches, token[None], table)
        return logits[0], caches

    def step(caches, inputs):
        position, dense = inputs
        tokens = windows[:, position]
        logits, caches = jax.vmap(one_file, in_axes=(0, 0, None))(caches, tokens, position)
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [F, V]
        truth = windows[:, position + 1]
        out = {
            "log_prob": jnp.take_along_axis(log_probs, truth[:, None], axis=1)[:, 0],
            "argmax": jnp.argmax(log_probs, axis=-1).astype(jnp.int32),
        }
        if method.kind == "dense":
            out["kl"] = jnp.zeros_like(out["log_prob"])
            out["log_probs"] = log_probs
        else:
            out["kl"] = jnp.sum(jnp.exp(dense) * (dense - log_probs), axis=-1)
        return caches, out

    _, outputs = jax.lax.scan(step, prefilled, (positions, dense_log_probs))
    return outputs


def prefill_all(params, config: ModelConfig, windows: np.ndarray, decode_start: int, page_size):
    """Per file caches of the first ``decode_start`` bytes (``lax.map``: one file at a time, the
    dense prefill's scores are quadratic in its length)."""
    num_pages = -(-(windows.shape[1] - 1) // page_size)
    run = jax.jit(
        lambda tokens: jax.lax.map(
            lambda row: prefill(params, config, row, num_pages, page_size), tokens
        )
    )
    return run(jnp.asarray(windows[:, :decode_start]))


def read_fraction(method: Method, context_lens: np.ndarray, page_size: int) -> float:
    """Mean over steps of the keys a (request, head) reads over the keys it has."""
    if method.kind == "dense":
        return 1.0
    if method.kind == "oracle_top_k":
        return float(np.mean(np.minimum(method.token_budget, context_lens) / context_lens))
    pages = -(-context_lens // page_size)
    kept = np.minimum(pages, max(method.token_budget // page_size, 2))
    last_len = context_lens - (pages - 1) * page_size
    return float(np.mean(((kept - 1) * page_size + last_len) / context_lens))


def held_out_texts() -> tuple[list[str], list[bytes]]:
    """Names (relative to the standard library) and bytes of the held-out files, sorted."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for index, path in enumerate(stdlib_sources())
        if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    ]
    return [path.relative_to(root).as_posix() for path in files], [p.read_bytes() for p in files]


def choose_windows(num_files: int, window: int, seed: int):
    """``(names, windows uint8 [F, window + 1])``: the first ``window + 1`` bytes of
    ``num_files`` held-out files long enough, chosen by a generator seeded by ``seed``."""
    names, texts = held_out_texts()
    long_enough = [i for i, text in enumerate(texts) if len(text) > window]
    if len(long_enough) < num_files:
        raise ValueError(f"only {len(long_enough)} held-out files exceed {window} bytes")
    chosen = sorted(np.random.default_rng(seed).choice(len(long_enough), num_files, replace=False))
    picked = [long_enough[i] for i in chosen]
    windows = np.stack([np.frombuffer(texts[i][: window + 1], np.uint8) for i in picked])
    return [names[i] for i in picked], windows


def quality_figures(outputs, dense, windows: np.ndarray, decode_start: int, page_size: int) -> dict:
    """Bits per byte, agreement with dense, KL from dense, accuracy: over every decoded byte;
    and bits per byte and agreement by where the new token sits in its page (``by_slot``, four
    ranges of slots): a page rule that keeps the last page keeps the fewest recent tokens when
    the new token opens a page."""
    log_prob = np.asarray(outputs["log_prob"], np.float64)  # [N, F]
    agrees = outputs["argmax"] == dense["argmax"]
    slots = np.arange(decode_start, decode_start + log_prob.shape[0]) % page_size
    quarter = max(page_size // 4, 1)
    by_slot = {}
    for low in range(0, page_size, quarter):
        rows = (slots >= low) & (slots < low + quarter)
        by_slot[f"{low}-{low + quarter - 1}"] = {
            "bits_per_byte": float(-log_prob[rows].mean() * BITS_PER_NAT),
            "greedy_agreement": float(np.mean(agrees[rows])),
        }
    return {
        "bits_per_byte": float(-log_prob.mean() * BITS_PER_NAT),
        "greedy_agreement": float(np.mean(agrees)),
        "kl_bits_per_byte": float(np.asarray(outputs["kl"], np.float64).mean() * BITS_PER_NAT),
        "greedy_accuracy": float(np.mean(outputs["argmax"] == windows[:, decode_start + 1 :].T)),
        "by_slot": by_slot,
    }


def retrieval_figures(outputs, dense, windows: np.ndarray, decode_start: int, cases) -> dict:
    """Over the cases (window ``f`` holds ``cases[f]``): mean bits per scored byte, the share
    of cases whose scored bytes are all the argmax (*exact*), and agreement with dense."""
    bits, exact, agree = [], [], []
    for f, case in enumerate(cases):
        offsets = np.array(case.scored_offsets())
        steps = offsets - 1 - decode_start  # step p predicts byte p + 1
        argmax = outputs["argmax"][steps, f]
        bits.append(-np.mean(np.asarray(outputs["log_prob"][steps, f], np.float64)) * BITS_PER_NAT)
        exact.append(bool(np.all(argmax == windows[f, offsets])))
        agree.append(float(np.mean(argmax == dense["argmax"][steps, f])))
    return {
        "cases": len(cases),
        "bits_per_byte": float(np.mean(bits)),
        "exact_match": float(np.mean(exact)),
        "greedy_agreement": float(np.mean(agree)),
    }


def run_study(args) -> dict:
    config, params = load_model(args.weights)
    record = json.loads(pathlib.Path(args.weights).with_suffix(".json").read_text())
    names, windows = choose_windows(args.files, args.window, args.seed)
    decode_start = args.window - args.decode
    texts_names, texts = held_out_texts()
    found = retrieval_windows(
        texts, args.window, args.min_gap, MAX_NAME_BYTES, args.retrieval_cases, args.seed
    )
    cases = [case for _, case, _ in found]
    retrieval = np.stack([np.frombuffer(text, np.uint8) for _, _, text in found])
    retrieval_start = args.window - (MAX_NAME_BYTES - 1)
    sets = {
        "main": (windows, decode_start),
        "retrieval": (retrieval, retrieval_start),
    }
    timings, prefilled = {}, {}
    for key, (rows, start) in sets.items():
        started = time.perf_counter()
        prefilled[key] = prefill_all(params, config, rows.astype(np.int32), start, args.page_size)
        jax.block_until_ready(prefilled[key])
        timings[f"prefill_{key}_s"] = round(time.perf_counter() - started, 1)
    print(f"prefill: {timings}", flush=True)
    context_lens = np.arange(decode_start, args.window) + 1
    methods = [Method("dense")] + [
        Method(kind, args.window // fraction)
        for fraction in FRACTIONS
        for kind in SPARSE_KINDS
        if kind in args.kinds
    ]
    results, dense = {}, {}
    for method in methods:
        figures = {
            "kind": method.kind,
            "token_budget": method.token_budget,
            "budget_fraction": None
            if method.token_budget is None
            else method.token_budget / args.window,
            "read_fraction": read_fraction(method, context_lens, args.page_size),
        }
        for key, (rows, start) in sets.items():
            outputs, method_timings = teacher_forced(
                params,
                config,
                method,
                prefilled[key],
                jnp.asarray(rows.astype(np.int32)),
                start,
                args.page_size,
                dense[key]["log_probs"] if key in dense else None,
            )
            dense.setdefault(key, outputs)
            if key == "main":
                figures.update(quality_figures(outputs, dense[key], rows, start, args.page_size))
            else:
                figures["retrieval"] = retrieval_figures(outputs, dense[key], rows, start, cases)
            figures.update({f"{key}_{name}": value for name, value in method_timings.items()})
        results[method.name] = figures
        print(
            f"{method.name:24s} {figures['bits_per_byte']:.4f} bits/byte, agreement "
            f"{figures['greedy_agreement']:.4f}, retrieval {figures['retrieval']}, "
            f"main {figures['main_compile_s']} + {figures['main_run_s']} s",
            flush=True,
        )
    return {
        "study": "sparse decode quality",
        "date": args.date,
        "commit": git_commit(),
        "command": "python -m bench.quality.sparse_decode_quality " + " ".join(args.argv),
        "environment": {
            "python": sys.version.split()[0],
            "jax": jax.__version__,
            "platform": jax.default_backend(),
        },
        "model": {
            "weights": args.weights,
            "config": config.to_dict(),
            "training": record["metadata"].get("training", {}),
            "evaluation": record["metadata"].get("evaluation", {}),
        },
        "data": {"files": names, "window_bytes": args.window, "seed": args.seed},
        "method": {
            "prefill_positions": decode_start,
            "decoded_positions": args.decode,
            "page_size": args.page_size,
            "budgets_tokens": [args.window // f for f in FRACTIONS],
            "retrieval_min_gap_bytes": args.min_gap,
            "retrieval_decoded_positions": args.window - retrieval_start,
            "backend": BACKEND,
        },
        "retrieval_cases": [
            {
                "file": texts_names[index],
                "name": case.name.decode(),
                "definition": case.definition,
                "previous": case.previous,
                "use": case.use,
            }
            for index, case, _ in found
        ],
        "timings": timings,
        "results": results,
    }


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown_report(study: dict) -> str:
    """The report's Markdown: setup, then one table of every method and budget."""
    method, data, model = study["method"], study["data"], study["model"]
    results = study["results"]
    dense = results["dense"]
    lines = [
        f"# Sparse decode quality, {study['date']}",
        "",
        f"Written by `{study['command']}` at commit `{study['commit']}` "
        f"({study['environment']['platform']}, jax {study['environment']['jax']}, "
        f"Python {study['environment']['python']}). Figures: "
        f"`{pathlib.Path(study['date'] + '-sparse-decode-quality.json')}` beside this file.",
        "",
        "## Setup",
        "",
        f"- Model: `{model['weights']}` (the tiny byte-level target trained on "
        f"{model['training'].get('seq_len', '?')}-byte windows, "
        f"{model['training'].get('steps', '?')} steps; held-out "
        f"{model['evaluation'].get('held_out_bits_per_byte', '?')} bits per byte; "
        "`serving/weights/README.md`).",
        f"- Data: {len(data['files'])} held-out files of its corpus, at least "
        f"{data['window_bytes'] + 1} bytes, chosen with seed {data['seed']}; the first "
        f"{data['window_bytes'] + 1} bytes of each: "
        + ", ".join(f"`{name}`" for name in data["files"])
        + ".",
        f"- Positions 0 to {method['prefill_positions'] - 1} prefilled densely; positions "
        f"{method['prefill_positions']} to {data['window_bytes'] - 1} decoded one at a time, "
        f"teacher-forced ({method['decoded_positions']} positions a file, "
        f"{method['decoded_positions'] * len(data['files'])} in all), every layer attending "
        f'through the method; page size {method["page_size"]}; `backend="{method["backend"]}"`.',
        f"- Budgets: {', '.join(str(b) for b in method['budgets_tokens'])} tokens per (request, "
        f"head), 1/16 to 1/2 of the {data['window_bytes']}-byte window. The context at a decoded "
        f"position is {method['prefill_positions'] + 1} to {data['window_bytes']} tokens, so a "
        "budget reads a little more than its fraction of it early on (column *read*: the mean "
        "fraction of the context's keys a head reads).",
        "- Methods: `dense`; `quest_kv_head` and `quest_query_head` (Quest's page bounds, one "
        "selection per KV head or per query head); `oracle_top_k` (the tokens receiving the most "
        "attention summed over the layer's heads, one selection shared by every head: an *upper "
        "bound* of what a trained lightning indexer could reach, not a method one can run); "
        "`recent_pages` (the first page and the latest pages, Quest's page count); "
        "`quest_two_last_pages` (Quest per KV head with the page before the last forced in too, "
        "the same page count: an ablation of where Quest loses).",
        "- *Agreement*: the argmax equals dense decoding's at the same position. *KL*: from dense "
        "to the method, bits per byte. *Accuracy*: the argmax equals the true byte.",
        f"- Retrieval: {dense['retrieval']['cases']} cases from the held-out files (seed "
        f"{data['seed']}, listed in the JSON): an identifier defined at its first occurrence and "
        f"used again at least {method['retrieval_min_gap_bytes']} bytes after its previous "
        "occurrence, so no budget's window of recent pages holds it "
        "(`bench/quality/retrieval_cases.py`). Each case gets its own "
        f"{data['window_bytes'] + 1}-byte window ending with the use and holding the "
        f"definition; all but its last {method['retrieval_decoded_positions']} positions are "
        "prefilled densely, those are decoded by the method, and the identifier's second to "
        "last bytes are scored (the first byte says which name comes, a guess for any method). "
        "*Exact*: every scored byte is the argmax.",
        "",
        "## Results",
        "",
        "| method | budget | read | bits/byte | agreement | KL (bits) | accuracy "
        "| retrieval bits/byte | retrieval exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for figures in results.values():
        retrieval = figures["retrieval"]
        budget = (
            "all"
            if figures["token_budget"] is None
            else f"{figures['token_budget']} (1/{round(1 / figures['budget_fraction'])})"
        )
        lines.append(
            f"| {figures['kind']} | {budget} | {figures['read_fraction']:.3f} "
            f"| {figures['bits_per_byte']:.4f} | {figures['greedy_agreement']:.4f} "
            f"| {figures['kl_bits_per_byte']:.4f} | {figures['greedy_accuracy']:.4f} "
            f"| {retrieval['bits_per_byte']:.4f} | {retrieval['exact_match']:.4f} |"
        )
    slot_ranges = list(dense["by_slot"])
    lines += [
        "",
        "Bits per byte (and agreement) by the new token's slot in its page: at slot 0 a page "
        "rule's forced last page holds only the new token.",
        "",
        "| method | budget | " + " | ".join(f"slots {r}" for r in slot_ranges) + " |",
        "| --- | --- | " + " | ".join("---" for _ in slot_ranges) + " |",
    ]
    for figures in results.values():
        budget = "all" if figures["token_budget"] is None else str(figures["token_budget"])
        cells = [
            f"{cell['bits_per_byte']:.3f} ({cell['greedy_agreement']:.3f})"
            for cell in figures["by_slot"].values()
        ]
        lines.append(f"| {figures['kind']} | {budget} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Wall time on this machine (2 cores, shared): prefill "
        f"{study['timings']['prefill_main_s']} s (main set), "
        f"{study['timings']['prefill_retrieval_s']} s (retrieval windows); each "
        "method's decode of the main set (compilation + run): "
        + ", ".join(
            f"{name} {figures['main_compile_s']} + {figures['main_run_s']} s"
            for name, figures in results.items()
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.quality.sparse_decode_quality", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, help="directory for the .json and .md")
    parser.add_argument("--weights", default="serving/weights/target_long")
    parser.add_argument("--files", type=int, default=16, help="held-out files")
    parser.add_argument("--window", type=int, default=2048, help="bytes of context per file")
    parser.add_argument("--decode", type=int, default=128, help="positions decoded at the end")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--min-gap", type=int, default=1024, help="retrieval: bytes since the name's last use"
    )
    parser.add_argument("--retrieval-cases", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="which held-out files")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=list(SPARSE_KINDS),
        choices=SPARSE_KINDS,
        help="sparse methods to run (dense always runs)",
    )
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if not 0 < args.decode < args.window:
        raise ValueError(f"--decode must be in (0, --window={args.window}), got {args.decode}")
    for name in ("files", "page_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    study = run_study(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{args.date}-sparse-decode-quality"
    stem.with_suffix(".json").write_text(json.dumps(study, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown_report(study))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
