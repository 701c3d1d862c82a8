"""``FlashCodecCache.save`` / ``FlashCodecCache.load``: a cache as a file (:mod:`flashcodec_fx.persist.fileformat`).

What a file holds: per codec layer, both streams' stored form (:mod:`~flashcodec_fx.persist.stream_io`: filled
archive groups, scales, raw sinks and tail, mean, lengths) with their codec specs (rotation seeds included) and the
layer's flags (a sliding-window ring as its next update leaves it: the groups no later query can see are not
stored); per native layer (sliding or linear-attention layers transformers keeps), its tensors and plain
attributes; the cache options, the layer types, the package versions and a fingerprint of the model config (the
decoder text config without run-time fields such as dtype or the attention implementation), and, when ``save`` was
given the model, a digest of its weights. ``load`` checks all of it against the model it is given before it builds
anything: another architecture, layer layout, dtype, weights (when both sides know them), format version, or a
truncated or corrupted file raises ``ValueError`` naming what differs.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..persist import fileformat
from ..persist.lossless import DTYPES, check_method
from ..persist.stream_io import export_stream, install_state, prepare_state
from ..provenance import version
from .attention import NAMES
from .flash_codec_cache import FlashCodecCache
from .hybrid_layer import HybridCodecLayer
from .layer import FlashCodecLayer
from .sliding_layer import FlashCodecSlidingLayer

RUNTIME_CONFIG_FIELDS = frozenset({
    "transformers_version", "dtype", "torch_dtype", "use_cache", "output_attentions", "output_hidden_states",
    "return_dict", "architectures", "name_or_path", "attn_implementation", "pad_token_id", "bos_token_id",
    "eos_token_id", "tokenizer_class", "problem_type", "id2label", "label2id", "task_specific_params", "prefix",
    "chunk_size_feed_forward"})
LAYER_FLAGS = ("materialization_free", "strict", "is_initialized")
_WEIGHT_SAMPLE = 4096  # bytes of each parameter hashed into the weights digest


def _text_config(model_or_config: Any) -> tuple[Any, torch.nn.Module | None]:
    model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    config = getattr(model, "config", None) if model is not None else model_or_config
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"model_or_config must be a transformers model or its config, got "
                        f"{type(model_or_config).__name__}")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return text, model


def config_fingerprint(config: Any) -> dict[str, Any]:
    """The fields of a (text) config that shape its K/V, as plain JSON (run-time fields left out)."""
    fields = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in RUNTIME_CONFIG_FIELDS}
    return json.loads(json.dumps(fields, sort_keys=True, default=str))


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over each parameter's name, shape, dtype and first bytes: tells checkpoints of one architecture apart."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        head = p.detach().reshape(-1)[: _WEIGHT_SAMPLE // p.element_size()].cpu().contiguous()
        digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        digest.update(head.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _layer_types(cache: FlashCodecCache) -> list[str]:
    return [type(layer).__name__ for layer in cache.layers]


# --- plain values of native layers and options, with tensors split off ------------------------------------------------

def _pack(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON, tensors moved into ``tensors`` under ``name``-derived keys."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value
        return {"tensor": name}
    if isinstance(value, torch.device):
        return {"device": True}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            raise ValueError(f"{name}: a dict with keys other than str / int cannot be saved")
        return {"dict": [[k, _pack(v, f"{name}.{k}", tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [_pack(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ValueError(f"{name}: a {type(value).__name__} cannot be saved (tensors, devices, dtypes, dicts, lists and "
                     f"plain values can)")


def _unpack(packed: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
    (kind, body), = packed.items()
    if kind == "tensor":
        return tensors[body].to(device)
    if kind == "device":
        return device
    if kind == "dtype":
        return DTYPES[body]
    if kind == "dict":
        return {k: _unpack(v, tensors, device) for k, v in body}
    if kind in ("list", "tuple"):
        items = [_unpack(v, tensors, device) for v in body]
        return items if kind == "list" else tuple(items)
    return body


ROLES = ("keys", "values")  # a codec layer's streams, in the order of FlashCodecLayer.streams

# --- save ---------------------------------------------------------------------------------------------------------

def _codec_layer(idx: int, layer: FlashCodecLayer, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if layer.handed_out:
        raise ValueError(f"layer {idx} is in the middle of a step (attention has not read it yet): save the cache "
                         f"between forward calls")
    if isinstance(layer, FlashCodecSlidingLayer) and layer._drop_target() > layer.dropped:
        layer = copy.deepcopy(layer)  # saved as its next update leaves it: no group that no later query can see
        layer.slide()
    entry = {"class": type(layer).__name__, **{f: getattr(layer, f) for f in LAYER_FLAGS},
             "attention_bound": layer.attention_bound,
             "dtype": None if getattr(layer, "dtype", None) is None else str(layer.dtype).removeprefix("torch.")}
    if isinstance(layer, FlashCodecSlidingLayer):
        entry["dropped"] = layer.dropped
    if isinstance(layer, HybridCodecLayer):
        entry["linear"] = _pack(layer.linear_state, f"layers.{idx}.linear", tensors)
    for role, stream in zip(ROLES, layer.streams, strict=False):  # an MLA layer: its one latent stream, as "keys"
        state, described = export_stream(stream)
        described["memoize"] = stream.memoize
        tensors.update({f"layers.{idx}.{role}.{field}": t for field, t in state.items()})
        entry[role] = described
    return entry


def save(cache: FlashCodecCache, path: str | os.PathLike, compression: str = "ppmd",
         model_or_config: Any = None) -> Path:
    """Write ``cache`` to ``path`` (see the module docstring); ``compression``: ``"raw"``, ``"zstd"`` or
    ``"ppmd"`` (:mod:`flashcodec_fx.persist.lossless`, exact whichever). ``model_or_config``: the model (its config
    and a digest of its weights are recorded) or its config; default: the config the cache was built from."""
    check_method(compression)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    source = cache.source_config if model_or_config is None else model_or_config
    if source is None:
        raise ValueError("model_or_config is required: this cache was built without a config (num_layers=, or "
                         "layers created as the model asked), so it cannot fingerprint the model it belongs to")
    config, model = _text_config(source)
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for idx, layer in enumerate(cache.layers):
        if isinstance(layer, FlashCodecLayer):
            layers.append({"kind": "codec", **_codec_layer(idx, layer, tensors)})
        else:
            attributes = dict(vars(layer))
            layers.append({"kind": "native", "class": type(layer).__name__,
                           "attributes": _pack(attributes, f"layers.{idx}.native", tensors)})
    header = {
        "package": {"flashcodec_fx": __version__, "torch": version("torch"), "transformers": version("transformers")},
        "config": config_fingerprint(config), "weights": None if model is None else weights_digest(model),
        "layer_types": _layer_types(cache), "layers": layers,
        "options": _pack(cache.options, "options", tensors),
        "offload_only_non_sliding": bool(getattr(cache, "only_non_sliding", True)),
        "padding_mask": _pack(cache._padding_mask, "padding_mask", tensors),
    }
    return fileformat.write(path, tensors, header, compression)


# --- load ---------------------------------------------------------------------------------------------------------

def _check_model(header: dict[str, Any], config: Any, model: torch.nn.Module | None, path: Path) -> None:
    saved, have = header["config"], config_fingerprint(config)
    differ = sorted(k for k in set(saved) | set(have) if saved.get(k) != have.get(k))
    if differ:
        shown = "; ".join(f"{k}: file {saved.get(k)!r}, model {have.get(k)!r}" for k in differ[:6])
        raise ValueError(f"{path}: the cache was saved for another model config ({len(differ)} fields differ: "
                         f"{shown})")
    dtypes = {layer["dtype"] for layer in header["layers"] if layer["kind"] == "codec" and layer["dtype"]}
    if model is not None and dtypes and dtypes != {str(model.dtype).removeprefix("torch.")}:
        raise ValueError(f"{path}: the cache holds {sorted(dtypes)} K/V, the model runs in {model.dtype}")
    if model is not None and header["weights"] is not None and weights_digest(model) != header["weights"]:
        raise ValueError(f"{path}: the cache was saved for a model with other weights (same config, weights digest "
                         f"differs)")


def _options(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return _unpack(header["options"], tensors, torch.device("cpu"))


def load(path: str | os.PathLike, model_or_config: Any, device: str | torch.device | None = None) -> FlashCodecCache:
    """The cache saved at ``path``, for ``model_or_config`` (checked against the file), on ``device`` (default: the
    model's device, or the CPU for a config). Attention on the stored form continues where the file's layers had it
    when the model uses the ``"kvcodec"`` attention (``apply_flash_codec`` / ``apply_codec_attention`` first)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    config, model = _text_config(model_or_config)
    if device is None:
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be None, a str or a torch.device, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device must name a torch device (e.g. 'cpu', 'cuda:0'), got {device!r}: {err}") from None
    path = Path(path)
    header, tensors = fileformat.read(path)
    _check_model(header, config, model, path)
    full = model.config if model is not None else model_or_config
    cache = FlashCodecCache(config=full, offload_only_non_sliding=header["offload_only_non_sliding"],
                            **_options(header, tensors))
    if _layer_types(cache) != header["layer_types"]:
        raise ValueError(f"{path}: the file's layers are {header['layer_types']}, this model's cache has "
                         f"{_layer_types(cache)}")
    kvcodec = getattr(config, "_attn_implementation", None) in NAMES
    installs = []
    for idx, (layer, entry) in enumerate(zip(cache.layers, header["layers"], strict=True)):
        if entry["kind"] == "native":
            installs.append((layer, None, _unpack(entry["attributes"], tensors, device)))
            continue
        states = {}
        for role, stream in zip(ROLES, layer.streams, strict=False):
            stream.memoize = entry[role]["memoize"]
            own = {k.rsplit(".", 1)[1]: t for k, t in tensors.items() if k.startswith(f"layers.{idx}.{role}.")}
            states[role] = prepare_state(f"layer {idx} {role}", stream, own, entry[role], device)
        installs.append((layer, states, entry))
    for layer, states, entry in installs:  # everything checked: now build
        if states is None:
            vars(layer).clear()
            vars(layer).update(entry)
            continue
        for role, stream in zip(ROLES, layer.streams, strict=False):
            install_state(stream, states[role])
        for flag in LAYER_FLAGS:
            setattr(layer, flag, entry[flag])
        layer.attention_bound = entry["attention_bound"] and kvcodec
        if entry["dtype"] is not None:
            layer.device, layer.dtype = device, DTYPES[entry["dtype"]]
        if isinstance(layer, FlashCodecSlidingLayer):
            layer.dropped = entry["dropped"]
        if isinstance(layer, HybridCodecLayer):
            layer.linear_state = _unpack(entry["linear"], tensors, device)
    cache.set_padding_mask(_unpack(header["padding_mask"], tensors, device))
    return cache
