"""The (key, value) codecs a preset gives one layer, without the transformers integration.

``hf.options.resolve_layer_codecs`` builds the same codecs (with its option checks, and transformers imported by the
``hf`` package); the Triton tests and benchmarks/triton_compile.py run where transformers is absent (the triton 3.6
venv of .ci/run), so they build them here. ``tests/ops/test_triton_register.py`` checks that both agree.
"""

from __future__ import annotations

from flashcodec_fx.codecs import Codec, make_codec
from flashcodec_fx.presets import preset_options

STREAMS = ("key_options", "value_options")


def preset_codecs(name: str, layer_idx: int = 0) -> tuple[Codec, Codec]:
    """``(key codec, value codec)`` of preset ``name`` as layer ``layer_idx`` gets them (``rotate=True`` seeds
    ``layer_idx``)."""
    options = preset_options(name)
    shared = {k: v for k, v in options.items() if k not in STREAMS}
    codecs = []
    for stream in STREAMS:
        merged = {**shared, **options.get(stream, {})}
        mode = merged.pop("mode")
        if merged.get("rotate") is True:
            merged["rotate"] = layer_idx
        codecs.append(make_codec(mode, **merged))
    return codecs[0], codecs[1]
