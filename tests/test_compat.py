"""`flashcodec_fx._compat`: version floors, the private-API table, the cache keyword of generate()."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import pytest

from flashcodec_fx import _compat


@pytest.mark.parametrize(("text", "expected"), [("2.13.0+cpu", (2, 13)), ("5.17.0", (5, 17)), ("3.6", (3, 6)),
                                                ("2.11.0a0+git1234", (2, 11))])
def test_version_tuple(text, expected):
    assert _compat.version_tuple(text) == expected


def test_version_tuple_rejects_garbage():
    with pytest.raises(ValueError, match="version"):
        _compat.version_tuple("latest")


def test_require_names_the_version_found_and_the_fix():
    with pytest.raises(ImportError, match=r"transformers >= 5\.17, found 5\.16: pip install 'transformers>=5\.17'"):
        _compat.require("transformers", (5, 16), (5, 17))
    _compat.require("transformers", (5, 17), (5, 17))
    _compat.require("transformers", None, (5, 17))  # absent: nothing to check


def test_installed_versions_meet_the_floors():
    assert _compat.TORCH >= _compat.TORCH_FLOOR
    for dist, floor in (("transformers", _compat.TRANSFORMERS_FLOOR), ("triton", _compat.TRITON_FLOOR)):
        have = _compat.installed(dist)
        assert have is None or have >= floor, (dist, have)
    assert _compat.installed("no-such-distribution-flashcodec") is None


def test_pyproject_floors_match():
    """The floors pip enforces (pyproject.toml) are the ones _compat checks."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    requires = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    for dist, floor in (("torch", _compat.TORCH_FLOOR), ("transformers", _compat.TRANSFORMERS_FLOOR),
                        ("triton", _compat.TRITON_FLOOR)):
        assert f"{dist}>={floor[0]}.{floor[1]}" in requires, (dist, requires)


@pytest.mark.parametrize("name", sorted(_compat.PRIVATE))
def test_every_private_api_resolves(name):
    assert getattr(_compat, name) is not None


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_api"):
        _compat.no_such_api  # noqa: B018


def test_generate_cache_keyword_is_the_one_this_transformers_wants():
    transformers = pytest.importorskip("transformers")
    from conftest import tiny_model, tiny_prompt

    forward = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    assert _compat.GENERATE_CACHE_KWARG in forward
    model = tiny_model("llama")
    cache = transformers.DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(tiny_prompt(), max_new_tokens=3, do_sample=False, **{_compat.GENERATE_CACHE_KWARG: cache})
    assert cache.get_seq_length() == out.shape[1] - 1


@pytest.mark.parametrize(("have", "expected"), [
    (None, None), ((5, 17), None), ((5, 21), None), ((5, 25), None),
    ((5, 26), r"transformers 5\.26 is newer than the newest release flashcodec_fx is tested with \(tested 5\.17 \.\. "
              r"5\.25\).*pip install 'transformers>=5\.17,<5\.26'"),
    ((6, 0), r"transformers 6\.0 is newer"),
    ((5, 16), r"transformers 5\.16 is older than flashcodec_fx supports \(tested 5\.17 \.\. 5\.25\): "
              r"pip install 'transformers>=5\.17'"),
])
def test_transformers_outside_the_tested_range_is_named_with_the_fix(have, expected):
    message = _compat.transformers_untested(have)
    assert message is None if expected is None else re.search(expected, message), message


@pytest.fixture
def untested_transformers(monkeypatch):
    """``set((major, minor))``: the installed transformers as the integration sees it; the once-per-process record reset."""
    monkeypatch.setattr(_compat, "_warned_untested", set())
    return lambda version: monkeypatch.setattr(_compat, "TRANSFORMERS", version)


def test_the_integration_warns_once_on_an_untested_transformers(untested_transformers):
    pytest.importorskip("transformers")
    from flashcodec_fx.hf import FlashCodecCache, compress_kv

    untested_transformers((5, 99))
    with pytest.warns(_compat.UntestedTransformersWarning, match="transformers 5.99 is newer"):
        FlashCodecCache(preset="int8", num_layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        FlashCodecCache(preset="int8", num_layers=1)
        compress_kv(preset="int8")
    untested_transformers((5, 98))
    with pytest.warns(_compat.UntestedTransformersWarning, match="transformers 5.98 is newer"):
        compress_kv(preset="int8")


def test_apply_flash_codec_warns_and_a_tested_transformers_does_not(untested_transformers):
    pytest.importorskip("transformers")
    from conftest import fresh_tiny_model

    from flashcodec_fx.hf import FlashCodecCache, apply_flash_codec, remove_flash_codec

    model = fresh_tiny_model("llama")
    untested_transformers((5, 97))
    with pytest.warns(_compat.UntestedTransformersWarning, match="5.97"):
        apply_flash_codec(model, preset="int8")
    remove_flash_codec(model)
    untested_transformers(_compat.TRANSFORMERS_TESTED[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FlashCodecCache(preset="int8", num_layers=1)
        apply_flash_codec(model, preset="int8")
    remove_flash_codec(model)


def test_tested_newest_policy_no_upper_pin_and_the_docs_state_the_range():
    """pyproject sets the floor only (the warning covers newer releases); docs/hf.md states the tested range."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [r for extra in extras.values() for r in extra if r.startswith("transformers")]
    assert pins and all("<" not in r for r in pins), pins
    oldest, newest = (".".join(map(str, end)) for end in _compat.TRANSFORMERS_TESTED)
    assert f"transformers {oldest} .. {newest}" in (root / "docs" / "hf.md").read_text()
    assert _compat.TRANSFORMERS_FLOOR == _compat.TRANSFORMERS_TESTED[0]
