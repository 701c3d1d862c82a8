"""`flashcodec_fx._compat`: version floors, the private-API table, the cache keyword of generate()."""

from __future__ import annotations

import inspect
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
