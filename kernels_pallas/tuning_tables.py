"""Per-device tables of tuned launch parameters, by shape bucket (written by ``python -m bench
tune``), and how a kernel finds its entry.

Pure Python on purpose: a kernel reads its table at trace time, so this module imports neither
JAX nor any kernel. No kernel reads a table yet (``docs/tuning.md``).

File format. ``kernels_pallas/tuned/<kernel>.json`` holds a JSON list with one object per
(device, jax version, kernel version) the kernel was tuned on::

    {
      "kernel": "paged_decode",
      "kernel_version": 1,                 # int or string the kernel declares; bumped when a
                                           # change to the kernel makes old timings meaningless
      "device_kind": "NVIDIA H200",        # jax.Device.device_kind
      "jax_version": "0.11.2",
      "dimensions": ["head_dim", "group_rows", "batch", "context"],  # order of a bucket key
      "bucketed": ["batch", "context"],    # dimensions rounded up to a power of two
      "parameters": ["pages_per_step", "num_warps", "num_stages"],   # launch parameters
      "entries": {"head_dim=128,group_rows=16,batch=4,context=4096": {"pages_per_step": 16}},
      "provenance": {...}                  # optional, free form: command, commit, decisions
    }

A bucket key is ``name=value`` pairs joined by commas, in the order of ``dimensions``. A
dimension not in ``bucketed`` must match exactly (``head_dim``); a bucketed one is a power of
two, and a missing bucket falls back to the nearest one (``lookup``).

Never a wrong table: ``load_table`` returns the object whose device, jax version and kernel
version all match, or None with a warning that names what did not match. A table measured on
another GPU, under another compiler, or for an older kernel would silently pick launches tuned
for something else.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

TUNED_DIRECTORY = pathlib.Path(__file__).resolve().parent / "tuned"
REQUIRED_FIELDS = (
    "kernel",
    "kernel_version",
    "device_kind",
    "jax_version",
    "dimensions",
    "bucketed",
    "parameters",
    "entries",
)
OPTIONAL_FIELDS = ("provenance",)
_NAME = re.compile(r"[a-z_][a-z0-9_]*\Z")

BucketKey = tuple[tuple[str, int], ...]


# ----------------------------------------------------------------------------------------------
# Bucket keys


def next_power_of_two(value: int) -> int:
    """The smallest power of two ``>= value``, for ``value >= 1``.

    Example:
      >>> [next_power_of_two(n) for n in (1, 2, 3, 4, 5, 4096, 4097)]
      [1, 2, 4, 4, 8, 4096, 8192]
    """
    return 1 << (value - 1).bit_length()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def bucket_key(dims: Mapping[str, int], bucketed: Sequence[str]) -> BucketKey:
    """The bucket of a shape: every dimension in ``bucketed`` rounded UP to the next power of
    two (a shape is tuned at or above its size, never below: a launch chosen for 4096 tokens is
    used for 3000, not for 5000); the others unchanged. Order: that of ``dims``.

    Args:
      dims: dimension name -> value, e.g. ``{"head_dim": 128, "batch": 3, "context": 3000}``.
        Bucketed values must be integers ``>= 1`` (so the minimum bucket is 1); the others
        integers (a bool counts as 0 or 1).
      bucketed: the names of the dimensions to round up.

    Returns:
      ``(("head_dim", 128), ("batch", 4), ("context", 4096))``.

    Raises:
      ValueError: for a bucketed name not in ``dims``, a bad name, a non-integer value, or a
        bucketed value below 1.

    Example:
      >>> bucket_key({"head_dim": 128, "batch": 3, "context": 3000}, ("batch", "context"))
      (('head_dim', 128), ('batch', 4), ('context', 4096))
    """
    missing = [name for name in bucketed if name not in dims]
    if missing:
        raise ValueError(f"bucketed dimensions {missing} are not in dims {sorted(dims)}")
    key = []
    for name, value in dims.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"dimension names are lower_snake_case, got {name!r}")
        if isinstance(value, bool):
            value = int(value)
        if not _is_int(value):
            raise ValueError(f"dimension {name} must be an integer, got {value!r}")
        if name in bucketed:
            if value < 1:
                raise ValueError(f"bucketed dimension {name} must be >= 1, got {value}")
            value = next_power_of_two(value)
        key.append((name, value))
    return tuple(key)


def format_key(key: BucketKey) -> str:
    """``(("batch", 4), ("context", 4096))`` -> ``"batch=4,context=4096"`` (a JSON key).

    Example:
      >>> format_key((("batch", 4), ("context", 4096)))
      'batch=4,context=4096'
    """
    return ",".join(f"{name}={value}" for name, value in key)


def parse_key(text: str) -> BucketKey:
    """The inverse of ``format_key``.

    Raises:
      ValueError: for a malformed key (an item without ``=``, a bad name, a non-integer value,
        a name given twice), naming the key.

    Example:
      >>> parse_key("batch=4,context=4096")
      (('batch', 4), ('context', 4096))
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"bucket key must be a non-empty string, got {text!r}")
    key = []
    for item in text.split(","):
        name, separator, value = item.partition("=")
        if not separator or not _NAME.match(name) or not re.fullmatch(r"-?[0-9]+", value):
            raise ValueError(f"malformed bucket key {text!r}: item {item!r} is not name=integer")
        key.append((name, int(value)))
    names = [name for name, _ in key]
    if len(set(names)) != len(names):
        raise ValueError(f"malformed bucket key {text!r}: a dimension is given twice")
    return tuple(key)


# ----------------------------------------------------------------------------------------------
# Validation


def _check_names(field: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(
        isinstance(name, str) and _NAME.match(name) for name in value
    ):
        raise ValueError(
            f"table field {field!r} must be a list of lower_snake_case names, got {value!r}"
        )
    if len(set(value)) != len(value):
        raise ValueError(f"table field {field!r} names a dimension twice: {value!r}")
    return value


def validate_table(table: Any) -> dict[str, Any]:
    """Checks one table object (see the module docstring); returns it unchanged.

    Raises:
      ValueError: naming the field and the bad value: a missing or unknown field, an empty
        ``kernel``/``device_kind``/``jax_version``, a ``kernel_version`` neither an int nor a
        non-empty string, ``bucketed`` not a subset of ``dimensions``, a malformed bucket key
        (other dimensions, a bucketed value not a power of two), or an entry with an unknown
        launch parameter or a value that is not a positive integer.

    Example:
      >>> table = {"kernel": "k", "kernel_version": 1, "device_kind": "NVIDIA H200",
      ...          "jax_version": "0.11.2", "dimensions": ["batch"], "bucketed": ["batch"],
      ...          "parameters": ["num_warps"], "entries": {"batch=3": {"num_warps": 4}}}
      >>> validate_table(table)
      Traceback (most recent call last):
      ...
      ValueError: table k: entry 'batch=3': bucketed dimension batch must be a power of two, got 3
    """
    if not isinstance(table, dict):
        raise ValueError(f"a table must be a JSON object, got {type(table).__name__}")
    missing = [field for field in REQUIRED_FIELDS if field not in table]
    if missing:
        raise ValueError(f"table is missing field(s) {missing}")
    unknown = sorted(set(table) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise ValueError(f"table has unknown field(s) {unknown}")
    for field in ("kernel", "device_kind", "jax_version"):
        if not isinstance(table[field], str) or not table[field]:
            raise ValueError(
                f"table field {field!r} must be a non-empty string, got {table[field]!r}"
            )
    version = table["kernel_version"]
    if not (_is_int(version) or (isinstance(version, str) and version)):
        raise ValueError(
            f"table field 'kernel_version' must be an int or a non-empty string, got {version!r}"
        )
    name = table["kernel"]
    dimensions = _check_names("dimensions", table["dimensions"])
    if not dimensions:
        raise ValueError(f"table {name}: field 'dimensions' must not be empty")
    bucketed = _check_names("bucketed", table["bucketed"])
    stray = [dimension for dimension in bucketed if dimension not in dimensions]
    if stray:
        raise ValueError(
            f"table {name}: 'bucketed' names {stray}, not in 'dimensions' {dimensions}"
        )
    parameters = _check_names("parameters", table["parameters"])
    if not parameters:
        raise ValueError(f"table {name}: field 'parameters' must not be empty")
    if "provenance" in table and not isinstance(table["provenance"], dict):
        raise ValueError(
            f"table {name}: field 'provenance' must be an object, got {table['provenance']!r}"
        )
    entries = table["entries"]
    if not isinstance(entries, dict):
        raise ValueError(f"table {name}: field 'entries' must be an object, got {entries!r}")
    for text, launch in entries.items():
        where = f"table {name}: entry {text!r}"
        key = parse_key(text)
        names = [dimension for dimension, _ in key]
        if names != dimensions:
            raise ValueError(f"{where}: key dimensions {names} are not {dimensions}")
        for dimension, value in key:
            if dimension in bucketed and not _is_power_of_two(value):
                raise ValueError(
                    f"{where}: bucketed dimension {dimension} must be a power of two, got {value}"
                )
        if not isinstance(launch, dict) or not launch:
            raise ValueError(
                f"{where}: launch parameters must be a non-empty object, got {launch!r}"
            )
        for parameter, value in launch.items():
            if parameter not in parameters:
                raise ValueError(
                    f"{where}: unknown launch parameter {parameter!r} (the table's "
                    f"parameters: {parameters})"
                )
            if not _is_int(value) or value < 1:
                raise ValueError(
                    f"{where}: launch parameter {parameter} must be a positive "
                    f"integer, got {value!r}"
                )
    return table


# ----------------------------------------------------------------------------------------------
# Loading


def table_path(kernel: str, directory: str | pathlib.Path | None = None) -> pathlib.Path:
    """``<directory>/<kernel>.json`` (default directory: ``kernels_pallas/tuned``)."""
    if not isinstance(kernel, str) or not _NAME.match(kernel):
        raise ValueError(f"kernel must be a lower_snake_case name, got {kernel!r}")
    return pathlib.Path(directory or TUNED_DIRECTORY) / f"{kernel}.json"


def read_tables(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """Every table object of one file, each validated.

    Raises:
      ValueError: if the file is not a JSON list of valid tables (naming the file and, for a
        bad table, its position), or two tables share device, jax version and kernel version.
    """
    path = pathlib.Path(path)
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(document, list):
        raise ValueError(f"{path}: must hold a JSON list of tables, got {type(document).__name__}")
    seen = set()
    for position, table in enumerate(document):
        try:
            validate_table(table)
        except ValueError as error:
            raise ValueError(f"{path}: table {position}: {error}") from None
        identity = (table["device_kind"], table["jax_version"], table["kernel_version"])
        if identity in seen:
            raise ValueError(f"{path}: two tables for device/jax/kernel version {identity}")
        seen.add(identity)
    return document


def _describe(table: Mapping[str, Any]) -> str:
    return (
        f"{table['device_kind']!r} jax {table['jax_version']} "
        f"kernel version {table['kernel_version']!r}"
    )


def load_table(
    kernel: str,
    device_kind: str,
    jax_version: str,
    kernel_version: int | str,
    directory: str | pathlib.Path | None = None,
) -> dict[str, Any] | None:
    """The table of ``kernel`` for this device, jax version and kernel version, or None.

    Returns None without a warning when the kernel has no table file (never tuned); with a
    ``warnings.warn`` naming every mismatch when the file has tables but none for this
    combination (other device, other jax, other kernel version): the caller then uses its
    defaults. A mismatched table is never returned.

    Args:
      kernel: the kernel's name, the file's stem (``"paged_decode"``).
      device_kind: ``jax.Device.device_kind`` (``"NVIDIA H200"``).
      jax_version: ``jax.__version__``.
      kernel_version: the version the kernel declares.
      directory: where the tables are (default ``kernels_pallas/tuned``).

    Raises:
      ValueError: for a malformed file (``read_tables``) or a table of another kernel in it.
    """
    path = table_path(kernel, directory)
    if not path.exists():
        return None
    tables = read_tables(path)
    for table in tables:
        if table["kernel"] != kernel:
            raise ValueError(f"{path}: holds a table of kernel {table['kernel']!r}, not {kernel!r}")
    reasons = []
    for table in tables:
        mismatches = []
        if table["device_kind"] != device_kind:
            mismatches.append(f"other device ({table['device_kind']!r}, not {device_kind!r})")
        if table["jax_version"] != jax_version:
            mismatches.append(f"other jax ({table['jax_version']}, not {jax_version})")
        if table["kernel_version"] != kernel_version:
            mismatches.append(
                f"other kernel version ({table['kernel_version']!r}, not {kernel_version!r})"
            )
        if not mismatches:
            return table
        reasons.append(f"{_describe(table)}: " + ", ".join(mismatches))
    warnings.warn(
        f"tuned table of {kernel} ignored, the defaults are used: {path} has no table for "
        f"{device_kind!r} jax {jax_version} kernel version {kernel_version!r} ("
        + "; ".join(reasons)
        + ")",
        stacklevel=2,
    )
    return None


# ----------------------------------------------------------------------------------------------
# Lookup


def _bucket_distance(a: BucketKey, b: BucketKey, bucketed: Sequence[str]) -> float:
    return sum(
        abs(math.log2(x) - math.log2(y))
        for (n, x), (_, y) in zip(a, b, strict=True)
        if n in bucketed
    )


def nearest_bucket(table: Mapping[str, Any], key: BucketKey) -> BucketKey | None:
    """The bucket of ``table`` that serves ``key``: ``key`` itself if present; else, among the
    entries whose unbucketed dimensions equal ``key``'s, the nearest one; else None.

    "Nearest": the smallest sum over the bucketed dimensions of ``|log2(entry) - log2(key)|``
    (buckets 2x apart in one dimension are 1 apart; each dimension counts alike). Ties go to
    the entry whose values, read in the order of ``dimensions``, are smallest (a plain tuple
    comparison): the smaller bucket in the first dimension where the tied entries differ.

    Raises:
      ValueError: if ``key``'s dimensions are not the table's, or a bucketed value in it is not
        a power of two (pass it through ``bucket_key`` first).

    Example:
      >>> table = {"dimensions": ["batch", "context"], "bucketed": ["batch", "context"],
      ...          "entries": {"batch=1,context=32768": {}, "batch=32,context=4096": {}}}
      >>> format_key(nearest_bucket(table, (("batch", 4), ("context", 16384))))
      'batch=1,context=32768'
    """
    dimensions = list(table["dimensions"])
    bucketed = list(table["bucketed"])
    names = [name for name, _ in key]
    if names != dimensions:
        raise ValueError(f"key dimensions {names} are not the table's {dimensions}")
    for name, value in key:
        if name in bucketed and not _is_power_of_two(value):
            raise ValueError(
                f"key dimension {name}={value} is not a power of two; "
                "pass the shape through bucket_key"
            )
    keys = [parse_key(text) for text in table["entries"]]
    if key in keys:
        return key
    exact = [name not in bucketed for name in dimensions]
    same_exact = [
        other
        for other in keys
        if all(o == k for (_, o), (_, k), fixed in zip(other, key, exact, strict=True) if fixed)
    ]
    if not same_exact:
        return None
    return min(
        same_exact,
        key=lambda other: (
            _bucket_distance(other, key, bucketed),
            tuple(value for _, value in other),
        ),
    )


def lookup(
    table: Mapping[str, Any] | None, key: BucketKey, defaults: Mapping[str, int]
) -> dict[str, int]:
    """Launch parameters for ``key``: ``defaults`` updated with the entry of
    ``nearest_bucket(table, key)``, or ``defaults`` alone when there is no table (None) or no
    entry with the same unbucketed dimensions.

    Example:
      >>> table = {"dimensions": ["head_dim", "batch"], "bucketed": ["batch"],
      ...          "entries": {"head_dim=128,batch=4": {"pages_per_step": 16}}}
      >>> defaults = {"pages_per_step": 8, "num_warps": 4}
      >>> lookup(table, bucket_key({"head_dim": 128, "batch": 3}, ["batch"]), defaults)
      {'pages_per_step': 16, 'num_warps': 4}
      >>> lookup(table, bucket_key({"head_dim": 128, "batch": 64}, ["batch"]), defaults)
      {'pages_per_step': 16, 'num_warps': 4}
      >>> lookup(table, bucket_key({"head_dim": 64, "batch": 4}, ["batch"]), defaults)
      {'pages_per_step': 8, 'num_warps': 4}
    """
    if table is None:
        return dict(defaults)
    bucket = nearest_bucket(table, key)
    if bucket is None:
        return dict(defaults)
    return {**defaults, **table["entries"][format_key(bucket)]}
