"""The sparse decode quality study (``bench/quality``): its decode equals dense when the budget
covers the context, its two added selections follow their rules, the retrieval finder finds what
it should, and the long-context target is trained.

Small shapes: a random two-layer model, windows of 40 bytes, pages of 4.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from bench.quality.retrieval_cases import (
    RetrievalCase,
    find_retrieval_cases,
    retrieval_windows,
)
from bench.quality.sparse_decode_quality import (
    SPARSE_KINDS,
    Method,
    prefill_all,
    prefix_page_table,
    quality_figures,
    read_fraction,
    retrieval_figures,
    teacher_forced,
)
from bench.quality.sparse_selections import oracle_top_k_selection, quest_two_last_pages_selected
from paged.sparse_quest import quest_page_scores, quest_selected_pages
from serving import model, model_files
from serving.config import TINY_TARGET, ModelConfig

WEIGHTS = pathlib.Path(model.__file__).parent / "weights"
CONFIG = ModelConfig(
    vocab_size=32,
    hidden=32,
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate=48,
)
PAGE_SIZE = 4
WINDOW = 40
DECODE_START = 33  # 7 decoded positions, the first in the middle of a page


@pytest.fixture(scope="module")
def study_inputs():
    params = model.init_params(CONFIG, jax.random.key(0))
    windows = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, WINDOW + 1))
    windows = windows.astype(np.int32)
    prefilled = prefill_all(params, CONFIG, windows, DECODE_START, PAGE_SIZE)
    dense, _ = teacher_forced(
        params, CONFIG, Method("dense"), prefilled, jnp.asarray(windows), DECODE_START, PAGE_SIZE
    )
    return params, windows, prefilled, dense


def test_dense_decode_equals_the_dense_forward(study_inputs):
    params, windows, _, dense = study_inputs
    logits = model.forward_dense(params, CONFIG, jnp.asarray(windows[:, :-1]))
    want = jax.nn.log_softmax(logits[:, DECODE_START:], axis=-1)  # [F, N, V]
    np.testing.assert_allclose(dense["log_probs"], np.swapaxes(want, 0, 1), atol=1e-5)
    np.testing.assert_array_equal(dense["kl"], 0.0)


@pytest.mark.parametrize("kind", SPARSE_KINDS)
def test_a_budget_covering_the_context_decodes_as_dense(study_inputs, kind):
    params, windows, prefilled, dense = study_inputs
    outputs, _ = teacher_forced(
        params,
        CONFIG,
        Method(kind, WINDOW),  # the whole window: every page, every token
        prefilled,
        jnp.asarray(windows),
        DECODE_START,
        PAGE_SIZE,
        dense["log_probs"],
    )
    np.testing.assert_allclose(outputs["log_prob"], dense["log_prob"], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(outputs["argmax"], dense["argmax"])
    assert np.all(np.abs(outputs["kl"]) < 1e-6)


def test_a_small_budget_changes_the_decode(study_inputs):
    """The comparison above can fail: two pages of ten change the predictions."""
    params, windows, prefilled, dense = study_inputs
    outputs, _ = teacher_forced(
        params,
        CONFIG,
        Method("recent_pages", 2 * PAGE_SIZE),
        prefilled,
        jnp.asarray(windows),
        DECODE_START,
        PAGE_SIZE,
        dense["log_probs"],
    )
    assert np.max(np.abs(outputs["log_prob"] - dense["log_prob"])) > 1e-3
    assert np.all(outputs["kl"] > 0)


def test_prefix_page_table():
    table = prefix_page_table(jnp.int32(9), num_pages=5, page_size=4)
    assert table.page_lists() == [[0, 1, 2]]
    assert table.last_page_len.tolist() == [1]
    assert table.page_indices.tolist() == [0, 1, 2, 0, 0]


def test_read_fraction():
    context = np.array([10, 16])
    assert read_fraction(Method("dense"), context, 4) == 1.0
    # 2 pages kept of 3 (10 tokens: 4 + 4 + 2): first + last = 6 of 10; of 4 (16): 8 of 16.
    assert read_fraction(Method("recent_pages", 8), context, 4) == pytest.approx((0.6 + 0.5) / 2)
    assert read_fraction(Method("oracle_top_k", 8), context, 4) == pytest.approx((0.8 + 0.5) / 2)


def test_the_reported_figures_are_bits_per_byte_of_the_right_positions():
    """``quality_figures`` and ``retrieval_figures`` on made-up outputs whose every figure is
    known: log-probabilities in nats become bits, each decoded step ``i`` (position
    ``decode_start + i``) is scored against byte ``decode_start + i + 1`` and falls in the slot
    ``position % page_size``, and a retrieval case scores the steps that predict its name's
    second to last bytes, no other."""
    decode_start, steps, files, page_size = 4, 8, 2, 4
    windows = np.arange(files * (decode_start + steps + 1)).reshape(files, -1) % 7
    truth = windows[:, decode_start + 1 :].T  # [N, F]: the byte each step predicts
    slot = (decode_start + np.arange(steps)) % page_size
    outputs = {
        "log_prob": np.repeat(-math.log(2) * (1.0 + slot)[:, None], files, axis=1),  # 1 + slot bits
        "argmax": np.stack([truth[:, 0], truth[:, 1] + 1], axis=1),  # file 0 right, file 1 wrong
        "kl": np.full((steps, files), 0.5 * math.log(2)),
    }
    dense = {"argmax": outputs["argmax"].copy()}
    dense["argmax"][0, 0] += 1  # one disagreement in 16
    figures = quality_figures(outputs, dense, windows, decode_start, page_size)
    assert figures["bits_per_byte"] == pytest.approx(2.5)
    assert figures["kl_bits_per_byte"] == pytest.approx(0.5)
    assert figures["greedy_accuracy"] == 0.5
    assert figures["greedy_agreement"] == 15 / 16
    assert list(figures["by_slot"]) == ["0-0", "1-1", "2-2", "3-3"]
    for low, cell in enumerate(figures["by_slot"].values()):
        assert cell["bits_per_byte"] == pytest.approx(1.0 + low)
    # decode_start = 4 is slot 0: the one disagreement is there, 1 of its 4 entries.
    assert [cell["greedy_agreement"] for cell in figures["by_slot"].values()] == [0.75, 1, 1, 1]

    # Retrieval: windows of 13 bytes, the last 4 positions (8 to 11) decoded; a 3-byte name used
    # at offset 10 scores bytes 11 and 12, predicted by steps 2 and 3.
    decode_start, steps = 8, 4
    windows = np.arange(2 * 13).reshape(2, 13) % 11
    cases = [RetrievalCase(b"abc", 0, 10, 1), RetrievalCase(b"abc", 0, 10, 1)]
    log_prob = np.full((steps, 2), -50.0)
    log_prob[2:] = -2 * math.log(2)  # 2 bits on each scored byte, 72 on the others
    argmax = windows[:, 9:13].T.copy()  # step i predicts byte 9 + i, all right
    argmax[3, 1] += 1  # file 1 misses its last byte
    dense = {"argmax": argmax.copy()}
    dense["argmax"][2, 0] += 1
    figures = retrieval_figures(
        {"log_prob": log_prob, "argmax": argmax}, dense, windows, decode_start, cases
    )
    assert figures["cases"] == 2
    assert figures["bits_per_byte"] == pytest.approx(2.0)
    assert figures["exact_match"] == 0.5
    assert figures["greedy_agreement"] == 0.75


@pytest.mark.parametrize(
    "kind, budget, message",
    [("walk", 8, "kind must be"), ("dense", 8, "token_budget"), ("quest_kv_head", None, "token")],
)
def test_bad_method(kind, budget, message):
    with pytest.raises(ValueError, match=message):
        Method(kind, budget)


# ----------------------------------------------------------------------------------------------
# The two selections


def random_cache(seed: int, table: paged.PageTable, num_pages: int):
    rng = np.random.default_rng(seed)
    shape = (num_pages, CONFIG.num_kv_heads, PAGE_SIZE, CONFIG.head_dim)  # HND
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        "HND",
    )
    q = jnp.asarray(
        rng.standard_normal((table.batch_size, CONFIG.num_q_heads, CONFIG.head_dim)), jnp.float32
    )
    return cache, q


def numpy_attention_received(q, cache, page_lists, seq_lens):
    """Per request: softmax weights over its tokens, per query head, summed over heads."""
    k = np.asarray(cache.k_pages)  # [P, KVH, S, D]
    group = CONFIG.num_q_heads // CONFIG.num_kv_heads
    received = []
    for b, (pages, length) in enumerate(zip(page_lists, seq_lens, strict=True)):
        keys = np.concatenate([k[p].transpose(1, 0, 2) for p in pages])[:length]  # [T, KVH, D]
        total = np.zeros(length)
        for h in range(CONFIG.num_q_heads):
            logits = keys[:, h // group] @ np.asarray(q[b, h], np.float64)
            logits /= math.sqrt(CONFIG.head_dim)
            weights = np.exp(logits - logits.max())
            total += weights / weights.sum()
        received.append(total)
    return received


@pytest.mark.parametrize("top_k", [1, 5, 64])
def test_oracle_top_k_takes_the_most_attended_tokens_for_every_head(top_k):
    page_lists, seq_lens = [[6, 2, 9], [4], [0, 7]], [11, 3, 5]
    table = paged.PageTable.from_page_lists(page_lists, seq_lens, PAGE_SIZE, num_indices=8)
    cache, q = random_cache(top_k, table, num_pages=10)
    selection = oracle_top_k_selection(q, cache, table, top_k)
    received = numpy_attention_received(q, cache, page_lists, seq_lens)
    counts = np.asarray(selection.counts)
    positions = np.asarray(selection.positions)
    assert positions.shape == (3, min(top_k, 8 * PAGE_SIZE))  # one row a request, all heads
    for b, length in enumerate(seq_lens):
        assert counts[b] == min(top_k, length)
        chosen = positions[b, : counts[b]]
        # Stable: among equal weights the earlier position first, as the selection's rule.
        want = np.sort(np.argsort(-received[b], kind="stable")[: counts[b]])
        np.testing.assert_array_equal(chosen, want)


def test_oracle_top_k_rejects_a_bad_budget():
    table = paged.PageTable.from_seq_lens([5], PAGE_SIZE)
    cache, q = random_cache(0, table, num_pages=2)
    with pytest.raises(ValueError, match="token_budget"):
        oracle_top_k_selection(q, cache, table, 0)
    with pytest.raises(TypeError, match="token_budget"):
        oracle_top_k_selection(q, cache, table, 4.0)


@pytest.mark.parametrize("token_budget", [1, 8, 13, 16, 100])
def test_recent_pages_keep_the_first_and_the_latest_pages(token_budget):
    seq_lens = [1, 4, 9, 21, 30]  # 1, 1, 3, 6 and 8 pages
    table = paged.PageTable.from_seq_lens(seq_lens, PAGE_SIZE, num_indices=24)
    selection = paged.recent_pages_selection(table, token_budget)
    indptr = np.asarray(selection.block_indptr)
    blocks = np.asarray(selection.block_indices)
    keep = max(token_budget // PAGE_SIZE, 2)
    for b, length in enumerate(seq_lens):
        pages = -(-length // PAGE_SIZE)
        kept = min(pages, keep)
        want = [0, *range(pages - kept + 1, pages)] if kept > 1 else [0]
        assert blocks[indptr[b] : indptr[b + 1]].tolist() == want


@pytest.mark.parametrize("token_budget", [8, 12, 20])
def test_quest_two_last_pages_forces_the_page_before_the_last(token_budget):
    seq_lens = [3, 6, 13, 30]  # 1, 2, 4 and 8 pages
    page_lists = [[9], [4, 1], [6, 0, 11, 2], [3, 8, 5, 10, 7, 12, 13, 14]]
    table = paged.PageTable.from_page_lists(page_lists, seq_lens, PAGE_SIZE, num_indices=16)
    cache, q = random_cache(token_budget, table, num_pages=15)
    bounds = paged.page_key_bounds(cache, table)
    selected = np.asarray(quest_two_last_pages_selected(q, bounds, table, token_budget))
    quest = np.asarray(
        quest_selected_pages(
            quest_page_scores(q, bounds, table, per="kv_head"), table, token_budget
        )
    )
    indptr = np.asarray(table.page_indptr)
    keep = max(token_budget // PAGE_SIZE, 2)
    for b in range(len(seq_lens)):
        start, end = indptr[b], indptr[b + 1]
        for head in range(CONFIG.num_kv_heads):
            row = selected[b, head, start:end]
            assert row.sum() == quest[b, head].sum() == min(end - start, keep)
            assert row[0] and row[-1]
            if keep >= 3 and end - start >= 3:
                assert row[-2]
            if keep == 2 or end - start <= 2:
                np.testing.assert_array_equal(row, quest[b, head, start:end])
        assert not selected[b][:, :start].any() and not selected[b][:, end:].any()


# ----------------------------------------------------------------------------------------------
# Retrieval cases

SNIPPET = (
    b"""import textwrap
from os import path as ospath

LIMIT = 10


def shorten(text):
    return textwrap.shorten(text, LIMIT)
"""
    + b"#" * 80
    + b"""
print(ospath.join("a", shorten("b")), LIMIT, textwrap)
"""
)


def test_retrieval_finder_returns_early_definitions_used_late():
    cases = find_retrieval_cases(SNIPPET, min_gap=60)
    # Not cases: 'print' (a builtin), 'text' and 'join' (never defined here), 'path' (imported
    # but never used again), 'shorten' in 'textwrap.shorten' (35 bytes after 'def shorten').
    assert [(case.name, case.use) for case in cases] == [
        (b"textwrap", 90),
        (b"LIMIT", 113),
        (b"ospath", 207),
        (b"shorten", 224),
        (b"LIMIT", 239),
        (b"textwrap", 246),
    ]
    for case in cases:
        assert SNIPPET[case.use : case.use + len(case.name)] == case.name
        assert SNIPPET[case.definition : case.definition + len(case.name)] == case.name
        assert case.use - case.previous >= 60
        assert list(case.scored_offsets()) == list(range(case.use + 1, case.use + len(case.name)))
    # The gap is measured from the previous occurrence, not from the definition.
    assert [case.use for case in find_retrieval_cases(SNIPPET, min_gap=100)] == [207, 224, 239, 246]
    assert find_retrieval_cases(SNIPPET, min_gap=200) == []
    assert [case.use for case in find_retrieval_cases(SNIPPET, 60, max_span=100)] == [90, 113]


def test_retrieval_windows_end_with_the_use():
    texts = [b"#" * 50 + SNIPPET, SNIPPET]
    # Three cases fit a window of 101 bytes: textwrap and LIMIT in 'shorten' of the first text
    # (its 50 leading bytes make room), LIMIT of the second; the last line's are too far from
    # their definitions, the second text's textwrap too near its start.
    windows = retrieval_windows(texts, window=100, min_gap=60, max_name_bytes=8, count=3, seed=0)
    assert [(index, case.name) for index, case, _ in windows] == [
        (0, b"textwrap"),
        (0, b"LIMIT"),
        (1, b"LIMIT"),
    ]
    for index, case, text in windows:
        assert len(text) == 101
        assert text[case.use :] == case.name  # the window ends with the use
        assert text[case.definition : case.definition + len(case.name)] == case.name
        assert text in texts[index]
    with pytest.raises(ValueError, match="retrieval cases"):
        retrieval_windows(texts, window=100, min_gap=60, max_name_bytes=8, count=4, seed=0)


@pytest.mark.parametrize(
    "kwargs, message", [({"min_gap": 0}, "min_gap"), ({"min_gap": 5, "max_span": 0}, "max_span")]
)
def test_retrieval_finder_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        find_retrieval_cases(SNIPPET, **kwargs)


# ----------------------------------------------------------------------------------------------
# The committed long-context target

LONG_SNIPPET = b'''"""A small inventory of parts, read from a CSV file."""

import csv
import dataclasses


@dataclasses.dataclass
class Part:
    name: str
    quantity: int
    unit_price: float

    def total_price(self):
        return self.quantity * self.unit_price


def read_parts(path):
    """Return the parts listed in the CSV file at path."""
    parts = []
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            parts.append(Part(row["name"], int(row["quantity"]), float(row["unit_price"])))
    return parts


def inventory_value(parts):
    """Return the total price of all parts."""
    return sum(part.total_price() for part in parts)


def cheapest_part(parts):
    """Return the part with the lowest unit price."""
    return min(parts, key=lambda part: part.unit_price)


def write_parts(path, parts):
    """Write parts to a CSV file at path."""
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["name", "quantity", "unit_price"])
        for part in parts:
            writer.writerow([part.name, part.quantity, part.unit_price])


if __name__ == "__main__":
    parts = read_parts("parts.csv")
    print(inventory_value(parts), cheapest_part(parts).name)
    write_parts("copy.csv", parts)
'''
# Random weights score about 8.9 bits per byte and byte frequencies alone about 4.5; the committed
# target_long (240 steps) scores 3.31 here. The bound keeps room for a retraining.
LONG_SNIPPET_BITS_PER_BYTE_BOUND = 3.8


def test_committed_long_context_target_loads_and_is_trained():
    config, params = model_files.load_model(WEIGHTS / "target_long")
    assert config == TINY_TARGET
    metadata = json.loads((WEIGHTS / "target_long.json").read_text())["metadata"]
    assert metadata["training"]["seq_len"] >= 2048
    tokens = jnp.asarray([list(LONG_SNIPPET)], jnp.int32)
    logits = model.forward_dense(params, config, tokens[:, :-1])
    assert np.all(np.isfinite(np.asarray(logits)))
    log_probs = jax.nn.log_softmax(logits)
    nats = -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1).mean()
    bits_per_byte = float(nats) / math.log(2)
    assert bits_per_byte < LONG_SNIPPET_BITS_PER_BYTE_BOUND, bits_per_byte


def test_train_tiny_can_train_the_target_alone_under_another_name(tmp_path):
    """``--only target --target-name``: one model written, its evaluation recorded, no draft."""
    from serving import train_tiny

    args = ["--out", str(tmp_path), "--only", "target", "--target-name", "long"]
    args += ["--target-steps", "2", "--seq-len", "8", "--batch-size", "2"]
    assert train_tiny.main(args) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["long.json", "long.npz"]
    record = json.loads((tmp_path / "long.json").read_text())
    assert record["metadata"]["training"]["seq_len"] == 8
    assert record["metadata"]["training"]["steps"] == 2
    assert set(record["metadata"]["evaluation"]) == {
        "train_bits_per_byte",
        "held_out_bits_per_byte",
        "windows",
    }
    config, _ = model_files.load_model(tmp_path / "long")
    assert config == TINY_TARGET


def test_train_tiny_refuses_a_target_named_as_the_draft(tmp_path, capsys):
    """Both models trained, a target named 'draft' would be overwritten by the draft: refused
    before any data is read."""
    from serving import train_tiny

    with pytest.raises(SystemExit) as exit_info:
        train_tiny.main(["--out", str(tmp_path), "--target-name", "draft"])
    assert exit_info.value.code == 2
    assert "--target-name draft would overwrite the draft" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
