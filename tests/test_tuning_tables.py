"""Tuned-parameter tables (``kernels_pallas/tuning_tables.py``): bucket keys, nearest-bucket
fallback, and validation (wrong device, wrong version, bad values), on the example table
``tests/fixtures/tuned/paged_decode.json``."""

from __future__ import annotations

import copy
import json
import pathlib
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernels_pallas.tuning_tables import (
    bucket_key,
    format_key,
    load_table,
    lookup,
    nearest_bucket,
    next_power_of_two,
    parse_key,
    validate_table,
)

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "tuned"
H200 = ("NVIDIA H200", "0.11.2", 1)
DEFAULTS = {"pages_per_step": 8, "num_warps": 4, "num_stages": 1}
BUCKETED = ("batch", "context")


def _h200_table():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the matching table loads without a warning
        return load_table("paged_decode", *H200, directory=FIXTURES)


def _key(batch, context, head_dim=128, group_rows=16):
    dims = {"head_dim": head_dim, "group_rows": group_rows, "batch": batch, "context": context}
    return bucket_key(dims, BUCKETED)


# ----------------------------------------------------------------------------------------------
# Bucket keys


@given(st.integers(1, 1 << 40))
def test_next_power_of_two_rounds_up(value):
    bucket = next_power_of_two(value)
    assert bucket & (bucket - 1) == 0
    assert bucket >= value and (bucket == 1 or bucket // 2 < value)


def test_bucket_key_rounds_only_the_bucketed_dimensions():
    assert _key(3, 3000, head_dim=96) == (
        ("head_dim", 96),
        ("group_rows", 16),
        ("batch", 4),
        ("context", 4096),
    )
    assert bucket_key({"batch": 1, "flag": True}, ["batch"]) == (("batch", 1), ("flag", 1))


@given(st.integers(1, 1 << 20), st.integers(1, 1 << 20))
def test_format_and_parse_key_are_inverse(batch, context):
    key = bucket_key({"batch": batch, "context": context}, BUCKETED)
    assert parse_key(format_key(key)) == key


@pytest.mark.parametrize(
    "dims, bucketed, message",
    [
        ({"batch": 0}, ["batch"], "bucketed dimension batch must be >= 1, got 0"),
        ({"batch": -4}, ["batch"], "bucketed dimension batch must be >= 1, got -4"),
        ({"batch": 2.5}, ["batch"], "dimension batch must be an integer, got 2.5"),
        ({"batch": 2}, ["context"], r"bucketed dimensions \['context'\] are not in dims"),
        ({"Batch": 2}, [], "dimension names are lower_snake_case, got 'Batch'"),
    ],
)
def test_bucket_key_rejects_bad_dimensions(dims, bucketed, message):
    with pytest.raises(ValueError, match=message):
        bucket_key(dims, bucketed)


@pytest.mark.parametrize(
    "text", ["", "batch", "batch=", "batch=4,", "batch=four", "Batch=4", "batch=4,batch=8"]
)
def test_parse_key_rejects_malformed_keys(text):
    with pytest.raises(ValueError, match="bucket key"):
        parse_key(text)


# ----------------------------------------------------------------------------------------------
# Loading: never a mismatched table


def test_the_matching_table_loads():
    table = _h200_table()
    assert table["device_kind"] == "NVIDIA H200" and len(table["entries"]) == 4


@pytest.mark.parametrize(
    "device_kind, jax_version, kernel_version, mismatch",
    [
        ("NVIDIA A100-SXM4-80GB", "0.11.2", 1, "other device"),
        ("NVIDIA H200", "0.12.0", 1, "other jax"),
        ("NVIDIA H200", "0.11.2", 2, "other kernel version"),
        ("NVIDIA H200", "0.11.2", "1", "other kernel version"),  # "1" is not 1
    ],
)
def test_a_mismatched_table_is_ignored_with_a_warning(
    device_kind, jax_version, kernel_version, mismatch
):
    with pytest.warns(UserWarning, match=f"tuned table of paged_decode ignored.*{mismatch}"):
        table = load_table(
            "paged_decode", device_kind, jax_version, kernel_version, directory=FIXTURES
        )
    assert table is None


def test_a_kernel_without_a_table_file_gets_none_silently(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_table("merge_states", *H200, directory=tmp_path) is None


def _write(tmp_path, document, kernel="paged_decode"):
    (tmp_path / f"{kernel}.json").write_text(json.dumps(document))


def test_a_file_that_is_not_a_list_of_tables_is_rejected(tmp_path):
    _write(tmp_path, {"kernel": "paged_decode"})
    with pytest.raises(ValueError, match="must hold a JSON list of tables, got dict"):
        load_table("paged_decode", *H200, directory=tmp_path)
    (tmp_path / "paged_decode.json").write_text("[{")
    with pytest.raises(ValueError, match="not JSON"):
        load_table("paged_decode", *H200, directory=tmp_path)


def test_a_table_of_another_kernel_or_a_duplicate_is_rejected(tmp_path):
    table = _h200_table()
    _write(tmp_path, [{**table, "kernel": "merge_states"}])
    with pytest.raises(ValueError, match="holds a table of kernel 'merge_states'"):
        load_table("paged_decode", *H200, directory=tmp_path)
    _write(tmp_path, [table, table])
    with pytest.raises(ValueError, match="two tables for device/jax/kernel version"):
        load_table("paged_decode", *H200, directory=tmp_path)


KEY = "head_dim=128,group_rows=16,batch=4,context=4096"


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda t: t["entries"][KEY].update(num_warps=0),
            "num_warps must be a positive integer, got 0",
        ),
        (lambda t: t["entries"][KEY].update(num_warps=-4), "got -4"),
        (lambda t: t["entries"][KEY].update(num_warps=4.0), "got 4.0"),
        (lambda t: t["entries"][KEY].update(num_warps=True), "got True"),
        (lambda t: t["entries"][KEY].update(num_warps="4"), "got '4'"),
        (lambda t: t["entries"][KEY].update(block=64), "unknown launch parameter 'block'"),
        (lambda t: t["entries"].update({KEY: {}}), "must be a non-empty object"),
        (
            lambda t: t["entries"].update({"batch=4": {"num_warps": 4}}),
            r"key dimensions \['batch'\]",
        ),
        (
            lambda t: t["entries"].update(
                {"head_dim=128,group_rows=16,batch=3,context=4096": {"num_warps": 4}}
            ),
            "bucketed dimension batch must be a power of two, got 3",
        ),
        (lambda t: t["entries"].update({"batch:4": {"num_warps": 4}}), "malformed bucket key"),
        (lambda t: t.update(tuned_by="me"), r"unknown field\(s\) \['tuned_by'\]"),
        (lambda t: t.pop("jax_version"), r"missing field\(s\) \['jax_version'\]"),
        (lambda t: t.update(device_kind=""), "'device_kind' must be a non-empty string"),
        (lambda t: t.update(kernel_version=1.5), "'kernel_version' must be an int or"),
        (lambda t: t.update(kernel_version=True), "'kernel_version' must be an int or"),
        (lambda t: t.update(bucketed=["seq_len"]), r"'bucketed' names \['seq_len'\]"),
        (lambda t: t.update(parameters=[]), "'parameters' must not be empty"),
        (lambda t: t.update(dimensions=["batch", "batch"]), "names a dimension twice"),
        (lambda t: t.update(provenance=[]), "'provenance' must be an object"),
        (lambda t: t.update(entries=[]), "'entries' must be an object"),
    ],
)
def test_bad_tables_are_rejected_naming_the_field_and_value(tmp_path, change, message):
    table = copy.deepcopy(_h200_table())
    change(table)
    with pytest.raises(ValueError, match=message):
        validate_table(table)
    _write(tmp_path, [table])
    with pytest.raises(ValueError, match="table 0: "):  # load_table validates every table
        load_table("paged_decode", *H200, directory=tmp_path)


def test_a_bad_table_of_another_device_still_fails_the_file(tmp_path):
    document = json.loads((FIXTURES / "paged_decode.json").read_text())
    document[1]["entries"][KEY]["num_warps"] = 0
    _write(tmp_path, document)
    with pytest.raises(ValueError, match=r"table 1: .*num_warps must be a positive integer"):
        load_table("paged_decode", *H200, directory=tmp_path)


# ----------------------------------------------------------------------------------------------
# Lookup: exact bucket, nearest bucket, then defaults


def test_lookup_of_a_tuned_bucket_rounds_the_shape_up():
    table = _h200_table()
    expected = {"pages_per_step": 16, "num_warps": 4, "num_stages": 1}
    assert lookup(table, _key(4, 4096), DEFAULTS) == expected
    assert lookup(table, _key(3, 2049), DEFAULTS) == expected  # same bucket as (4, 4096)


def test_lookup_falls_back_to_the_nearest_bucket():
    table = _h200_table()
    # (256, 1024): 1 from (256, 512); (32, 4096) is 3 + 2 = 5 away.
    assert format_key(nearest_bucket(table, _key(256, 1024))).endswith("batch=256,context=512")
    assert lookup(table, _key(256, 1024), DEFAULTS)["pages_per_step"] == 4
    # (64, 4096): 1 from (32, 4096).
    assert lookup(table, _key(64, 4096), DEFAULTS)["pages_per_step"] == 8
    # (2, 16384): (1, 32768) is 1 + 1 = 2 away, (4, 4096) is 1 + 2 = 3.
    assert lookup(table, _key(2, 16384), DEFAULTS)["pages_per_step"] == 16


def test_nearest_bucket_ties_go_to_the_smaller_values_in_dimension_order():
    table = {
        "dimensions": ["batch", "context"],
        "bucketed": ["batch", "context"],
        "entries": {"batch=8,context=1024": {}, "batch=2,context=1024": {}},
    }
    # (4, 1024) is 1 from both: the smaller batch wins, whatever the entries' order.
    assert nearest_bucket(table, (("batch", 4), ("context", 1024))) == (
        ("batch", 2),
        ("context", 1024),
    )


def test_lookup_without_a_matching_exact_dimension_uses_the_defaults():
    table = _h200_table()
    assert lookup(table, _key(4, 4096, head_dim=64), DEFAULTS) == DEFAULTS
    assert lookup(None, _key(4, 4096), DEFAULTS) == DEFAULTS


def test_lookup_rejects_a_key_of_other_dimensions_or_not_bucketed():
    table = _h200_table()
    with pytest.raises(ValueError, match="key dimensions"):
        lookup(table, (("batch", 4),), DEFAULTS)
    unbucketed = (("head_dim", 128), ("group_rows", 16), ("batch", 3), ("context", 4096))
    with pytest.raises(ValueError, match="batch=3 is not a power of two"):
        lookup(table, unbucketed, DEFAULTS)
