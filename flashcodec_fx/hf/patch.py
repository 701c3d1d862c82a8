"""Make ``generate()`` default to a FlashCodecCache: per instance (``apply_flash_codec``) or per class (``compress_kv``).

Both wrap the model's ``_prepare_cache_for_generation`` (same signature in transformers 5.17 .. 5.24): transformers
first prepares its own cache as usual; a fresh ``DynamicCache`` is then replaced by
``FlashCodecCache.from_config(model.config, **options)`` and a fresh ``StaticCache`` (``cache_implementation="static"``)
by the static layout with the same ``max_cache_len``; their offloading variants (``"offloaded"``,
``"offloaded_static"``) by the same caches with ``offloading=True``. A cache passed by the caller is kept as is (a
FlashCodecCache passed this way still receives the prompt's padding mask). Every other ``cache_implementation``
raises ValueError before transformers builds anything. ``remove_flash_codec`` restores exactly what was there.
"""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from transformers.cache_utils import Cache, DynamicCache, StaticCache

from .._compat import GENERATE_CACHE_KWARG, PREPARE_CACHE_METHOD, is_user_defined_cache, warn_untested_transformers
from .attention import MaterializationFreeFallback, apply_codec_attention, remove_codec_attention
from .compile_option import check_compile, forget_compiled_call, install_compile_config
from .flash_codec_cache import FlashCodecCache, NoCodecLayers, no_codec_message
from .options import CACHE_SWITCHES, resolve_codecs
from .own_caches import builds_own_cache, own_cache_class, takes_cache

METHOD = PREPARE_CACHE_METHOD
REPLACED = (None, "dynamic", "static", "offloaded", "offloaded_static")  # cache_implementation values the codec serves
T = TypeVar("T", bound=type)


def _validate(options: dict[str, Any], config: Any = None) -> dict[str, Any]:
    """Check every option now (a static layout may omit max_cache_len: generate's max length is used; without a
    model config, the codec options are checked on their own and the cache switches on a default cache). A model
    config none of whose layers carries a codec (warned :class:`NoCodecLayers`) keeps its own attention:
    ``materialization_free=False`` (no layer to attend on a stored form)."""
    probe = dict(options)
    if probe.get("layout") == "static" and probe.get("max_cache_len") is None:
        probe["max_cache_len"] = 1
    if config is not None:
        if not FlashCodecCache.from_config(config, **probe).codec_layers:
            return {**options, "materialization_free": False}
        return dict(options)
    switches = {k: v for k, v in probe.items() if k in CACHE_SWITCHES}
    resolve_codecs(probe.get("codecs"), {k: v for k, v in probe.items() if k not in CACHE_SWITCHES and k != "codecs"})
    FlashCodecCache(**switches)
    return dict(options)


def _quietly(build: Callable[[], FlashCodecCache]) -> FlashCodecCache:
    """``build()`` without its :class:`NoCodecLayers` warning (``apply_flash_codec`` gave it once already)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoCodecLayers)
        return build()


def _check_coverage(model: Any, options: dict[str, Any]) -> None:
    """At apply time: a model that builds its own cache of a kind no codec cache serves compresses nothing, said now
    (:class:`NoCodecLayers`; ``strict=True`` raises), and so does one whose generation config keeps no cache
    (``use_cache=False``: warned, as a call may pass ``use_cache=True``). A model config with no codec-carrying layer
    warned already (:func:`_validate` built a cache from it)."""
    if getattr(getattr(model, "generation_config", None), "use_cache", True) is False:
        warnings.warn(no_codec_message(f"{type(model).__name__}") + ": its generation config says use_cache=False, "
                      "so generate() keeps no KV cache unless a call passes use_cache=True (or set "
                      "model.generation_config.use_cache = True)", NoCodecLayers, stacklevel=3)  # a call may override
    if _keeps_no_codec_cache(model):
        message = no_codec_message(f"{type(model).__name__}") + (
            ": the model builds a cache of its own (generate() prepares none), which flashcodec does not replace"
            if takes_cache(model) else ": its forward takes no KV cache (it recomputes every token at every step)")
        if options.get("strict"):
            raise ValueError(f"{message} (strict=True)")
        warnings.warn(message, NoCodecLayers, stacklevel=3)


def _keeps_no_codec_cache(model: Any) -> bool:
    """Whether no generate() of ``model`` can hold a codec cache: it takes no cache, or builds one of its own that no
    codec cache class serves."""
    return not takes_cache(model) or (builds_own_cache(model) and own_cache_class(model) is None)


VIEW_CHOSEN = "_flashcodec_view_chosen"  # on a model instance: why its codec caches attend on the decoded view


def _choose_dataflow(model: Any, options: dict[str, Any], stacklevel: int = 3) -> dict[str, Any]:
    """``options`` with the dataflow this model can run: where ``materialization_free`` is on, the model switches to
    the ``"kvcodec"`` attention (:func:`apply_codec_attention`); a model that cannot (its attention modules do not
    call transformers' attention interface, or it runs another implementation than sdpa / eager) attends on the
    decoded view instead (``materialization_free=False``), announced once per model with a
    :class:`MaterializationFreeFallback` warning; ``strict=True`` raises ``ValueError`` instead, changing nothing. A
    model whose own cache flashcodec does not replace keeps its attention (nothing to serve)."""
    if not options.get("materialization_free", True):
        return options
    if _keeps_no_codec_cache(model):
        return {**options, "materialization_free": False, "strict": False}
    reason = vars(model).get(VIEW_CHOSEN)
    if reason is None:
        try:
            apply_codec_attention(model)
            return options
        except ValueError as err:
            reason = str(err)
        if options.get("strict"):
            raise ValueError(f"{reason}: attention on the stored form cannot serve it (strict=True; without it the "
                             f"codec cache attends on the decoded view)") from None
        warnings.warn(f"{reason}: attention on the stored form cannot serve it, so its codec caches attend on the "
                      f"decoded view (materialization_free=False: one decoded full-precision memo per codec layer "
                      f"beside its codes)", MaterializationFreeFallback, stacklevel=stacklevel)
        setattr(model, VIEW_CHOSEN, reason)
    return {**options, "materialization_free": False}


def _own_cache(model: Any, options: dict[str, Any], compiled: bool) -> FlashCodecCache:
    """The codec cache that is also ``model``'s own cache class (:mod:`flashcodec_fx.hf.own_caches`)."""
    if compiled:
        raise ValueError(f"apply_flash_codec(compile=...): {type(model).__name__} builds a cache of its own, which "
                         f"runs eagerly only")
    opts = {k: v for k, v in options.items() if k not in ("layout", "max_cache_len")}
    return own_cache_class(model).from_config(model.config, **opts)


def _codec_cache_for(model: Any, options: dict[str, Any], native: Cache, max_cache_length: int,
                     compiled: bool) -> FlashCodecCache:
    opts = dict(options)
    if type(native) is StaticCache:
        opts["layout"] = "static"
        opts["max_cache_len"] = opts.get("max_cache_len") or native.get_max_length()
    elif type(native) is DynamicCache:
        if opts.get("layout") == "static":
            opts["max_cache_len"] = opts.get("max_cache_len") or max_cache_length
    else:
        raise ValueError(f"flashcodec_fx replaces transformers' default dynamic and static caches; this generate() call "
                         f"asked for a {type(native).__name__} (cache_implementation); pass a FlashCodecCache or remove "
                         f"the codec")
    if native.offloading:
        if compiled:
            raise ValueError("apply_flash_codec(compile=...) does not combine with an offloaded cache "
                             "(cache_implementation='offloaded' / 'offloaded_static'): offloading runs eagerly")
        opts["offloading"] = True
    return FlashCodecCache.from_config(model.config, **opts)


def _prepare_with_codec(model: Any, native: Callable, options: dict[str, Any], args: tuple, kwargs: dict,
                        compiled: dict[str, Any] | None = None) -> None:
    bound = inspect.signature(native).bind(*args, **kwargs)
    model_kwargs, max_cache_length = bound.arguments["model_kwargs"], bound.arguments["max_cache_length"]
    generation_config = bound.arguments["generation_config"]
    install_compile_config(generation_config, compiled)  # compile=...: see flashcodec_fx.hf.compile_option
    wanted = getattr(generation_config, "cache_implementation", None)
    if wanted not in REPLACED and not _user_cache(bound.arguments["model_kwargs"]):
        raise ValueError(f"flashcodec_fx replaces transformers' dynamic and static caches (cache_implementation in "
                         f"{REPLACED}); this generate() call asked for cache_implementation={wanted!r}: pass a "
                         f"FlashCodecCache or remove the codec (remove_flash_codec)")
    options = _choose_dataflow(model, options, stacklevel=6)  # compress_kv: decided on an instance's first generate
    native(*args, **kwargs)
    name = next((k for k in ("cache", "past_key_values") if isinstance(model_kwargs.get(k), Cache)), None)
    if name is None:  # use_cache=False, or a model that brings its own cache
        if generation_config.use_cache is False or own_cache_class(model) is None or not builds_own_cache(model):
            return
        name = GENERATE_CACHE_KWARG
        model_kwargs[name] = _quietly(lambda: _own_cache(model, options, compiled is not None))
    cache = model_kwargs[name]
    if not is_user_defined_cache(cache) and not isinstance(cache, FlashCodecCache):
        cache = _quietly(lambda: _codec_cache_for(model, options, cache, max_cache_length, compiled is not None))
        if getattr(generation_config, "is_assistant", False):
            cache.activate_past_recording()
        model_kwargs[name] = cache
    if isinstance(cache, FlashCodecCache):
        cache.check_model(model.config)
        cache.set_padding_mask(model_kwargs.get("attention_mask"))


def _user_cache(model_kwargs: dict) -> bool:
    return any(isinstance(model_kwargs.get(k), Cache) for k in ("cache", "past_key_values"))


def _check_model(model: Any) -> None:
    if not hasattr(model, METHOD) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers generative model (GenerationMixin), got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("flashcodec_fx supports decoder-only (CausalLM) models; this model is an encoder-decoder")


def apply_flash_codec(model: Any, **options: Any) -> Any:
    """Every later ``model.generate()`` defaults to a FlashCodecCache built with ``options`` (see FlashCodecCache).

    ``preset=NAME`` picks a preset (``flashcodec_fx.PRESETS``); other options override it. Attention runs on the
    stored form (the model switches to the ``"kvcodec"`` attention implementation) unless ``materialization_free=False``.
    ``compile=True`` (or a dict of ``flashcodec_fx.backend`` options, ``mode``, ``dynamic``) decodes through
    ``torch.compile`` with the flashcodec backend on a static, unmemoized cache (see ``flashcodec_fx.hf.compile_option``).
    Calling it again replaces the options. Returns ``model``. Undo with :func:`remove_flash_codec`.
    """
    warn_untested_transformers()
    _check_model(model)
    compiled = check_compile(options.pop("compile", False), options)
    options = _validate(options, model.config)  # warns NoCodecLayers where no layer of the config carries a codec
    _check_coverage(model, options)
    state = getattr(model, "_flashcodec_patch", None)
    if state is None:
        own = vars(model).get(METHOD)
        native = own if own is not None else types.MethodType(_class_native(type(model)), model)
        state = {"own": own, "native": native}
    remove_codec_attention(model)  # options replaced: the dataflow is chosen anew
    vars(model).pop(VIEW_CHOSEN, None)
    options = _choose_dataflow(model, options)
    state["options"], state["compile"] = options, compiled

    def prepare(self, *args, **kwargs):
        return _prepare_with_codec(self, state["native"], state["options"], args, kwargs, state["compile"])

    setattr(model, METHOD, types.MethodType(prepare, model))
    model._flashcodec_patch = state
    return model


def _class_native(cls: type) -> Callable:
    fn = getattr(cls, METHOD)
    while getattr(fn, "__flashcodec_native__", None) is not None:
        fn = fn.__flashcodec_native__
    return fn


def compress_kv(**options: Any) -> Callable[[T], T]:
    """Class decorator: every instance's ``generate()`` defaults to a FlashCodecCache with ``options``.

    ``@flashcodec_fx.compress_kv(mode="png")`` on a ``...ForCausalLM`` class (or a subclass of one; the class is
    modified in place and returned). With ``materialization_free=True`` each instance switches to the ``"kvcodec"``
    attention implementation on its first ``generate()``. Undo with ``remove_flash_codec(cls)``.
    """
    warn_untested_transformers()
    compiled = check_compile(options.pop("compile", False), options)
    options = _validate(options)

    def decorate(cls: T) -> T:
        if not isinstance(cls, type) or not hasattr(cls, METHOD):
            raise TypeError(f"compress_kv decorates a transformers model class (GenerationMixin), got {cls!r}")
        previous = vars(cls).get(METHOD)
        native = _class_native(cls)

        def prepare(self, *args, **kwargs):
            return _prepare_with_codec(self, types.MethodType(native, self), options, args, kwargs, compiled)

        prepare.__flashcodec_native__ = native
        prepare.__flashcodec_previous__ = (previous,) if getattr(previous, "__flashcodec_native__", None) is None \
            else previous.__flashcodec_previous__
        prepare.__flashcodec_options__ = options
        setattr(cls, METHOD, prepare)
        return cls

    return decorate


def remove_flash_codec(target: Any) -> Any:
    """Undo :func:`apply_flash_codec` on a model, or :func:`compress_kv` on a class: the exact previous behaviour
    comes back (including the attention implementation). ValueError when the target was not patched."""
    if isinstance(target, type):
        current = vars(target).get(METHOD)
        if getattr(current, "__flashcodec_native__", None) is None:
            raise ValueError(f"{target.__name__} is not decorated with compress_kv")
        (previous,) = current.__flashcodec_previous__
        if previous is None:
            delattr(target, METHOD)
        else:
            setattr(target, METHOD, previous)
        return target
    state = getattr(target, "_flashcodec_patch", None)
    if state is None:
        raise ValueError(f"{type(target).__name__} instance is not patched with apply_flash_codec"
                         + (" (its class is decorated with compress_kv: use remove_flash_codec(cls))"
                            if getattr(getattr(type(target), METHOD, None), "__flashcodec_native__", None) else ""))
    if state["own"] is None:
        delattr(target, METHOD)
    else:
        setattr(target, METHOD, state["own"])
    remove_codec_attention(target)
    vars(target).pop(VIEW_CHOSEN, None)
    forget_compiled_call(target)
    del target._flashcodec_patch
    return target
