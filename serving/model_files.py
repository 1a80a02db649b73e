"""Weight files: a model's configuration and parameters on disk.

``NAME.npz`` holds the arrays under flat names (``layers.0.wq``), bfloat16 stored as its raw
uint16 bits (NumPy has no bfloat16); ``NAME.json`` holds the configuration, the storage dtype
and whatever the trainer recorded.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from serving.config import ModelConfig
from serving.model import flat_items, param_shapes, validate_params

STORAGE_DTYPES = ("float32", "bfloat16")


def _stem(path) -> pathlib.Path:
    path = pathlib.Path(path)
    return path.with_suffix("") if path.suffix in (".npz", ".json") else path


def save_model(
    path, config: ModelConfig, params, *, storage: str = "bfloat16", metadata=None
) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes ``PATH.npz`` (the arrays) and ``PATH.json`` (config, storage dtype, metadata).

    Args:
      path: the files' common stem (a ``.npz`` or ``.json`` suffix is dropped).
      config: the model.
      params: its parameters.
      storage: ``"bfloat16"`` (raw uint16 bits: half the bytes) or ``"float32"``.
      metadata: anything JSON-serializable to record beside the config (training details).

    Returns:
      The two paths written.
    """
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"storage must be one of {STORAGE_DTYPES}, got {storage!r}")
    validate_params(params, config)
    stem = _stem(path)
    arrays = {}
    for name, array in flat_items(params):
        values = np.asarray(jnp.asarray(array, jnp.float32))
        if storage == "bfloat16":
            values = values.astype(ml_dtypes.bfloat16).view(np.uint16)
        arrays[name] = values
    weights_path, config_path = stem.with_suffix(".npz"), stem.with_suffix(".json")
    np.savez(weights_path, **arrays)
    record = {"config": config.to_dict(), "storage": storage, "metadata": metadata or {}}
    config_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return weights_path, config_path


def load_model(path) -> tuple[ModelConfig, dict]:
    """Reads what ``save_model`` wrote: ``(config, params)``, params in ``config.dtype``.

    Args:
      path: the stem, or either file (``serving/weights/target`` or ``.../target.npz``).

    Raises:
      FileNotFoundError: if either file is missing.
      ValueError: for a config that ``ModelConfig`` rejects, an unknown storage dtype, or
        arrays missing or misshapen for the config.

    Example:
      >>> config, params = load_model(pathlib.Path(__file__).parent / "weights" / "draft")
      >>> config.vocab_size, config.num_layers
      (256, 2)
    """
    stem = _stem(path)
    record = json.loads(stem.with_suffix(".json").read_text())
    config = ModelConfig.from_dict(record["config"])
    storage = record.get("storage")
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"{stem}.json has storage {storage!r}, expected one of {STORAGE_DTYPES}")
    with np.load(stem.with_suffix(".npz")) as arrays:
        stored = {name: arrays[name] for name in arrays.files}
    shapes = param_shapes(config)
    names = [name for name, _ in flat_items(shapes)]
    missing = [name for name in names if name not in stored]
    if missing:
        raise ValueError(f"{stem}.npz lacks {missing[:3]} (needed by its config)")

    def to_array(name):
        values = stored[name]
        if storage == "bfloat16":
            values = values.view(ml_dtypes.bfloat16)
        return jnp.asarray(values.astype(np.float32), config.jnp_dtype)

    params = {
        "embed": to_array("embed"),
        "layers": [
            {key: to_array(f"layers.{index}.{key}") for key in layer}
            for index, layer in enumerate(shapes["layers"])
        ],
        "final_norm": to_array("final_norm"),
        "lm_head": to_array("lm_head"),
    }
    validate_params(params, config)
    return config, params
