"""The plugin's configuration from the environment: off by default, clear errors naming the variable, overrides."""

from __future__ import annotations

import pytest
import torch

from flashcodec_fx.vllm import check_vllm_version, register
from flashcodec_fx.vllm.config import (
    ENV_ANCHORS,
    ENV_LAYER_PRESETS,
    ENV_PRESET,
    ENV_SKIP,
    VLLM_PRESETS,
    PluginConfig,
    config_from_env,
)
from flashcodec_fx.vllm.page import RAW, page_format


def test_off_unless_the_preset_is_set():
    assert config_from_env({}) is None
    assert config_from_env({ENV_PRESET: "  "}) is None
    with pytest.raises(ValueError, match=f"{ENV_SKIP} set but {ENV_PRESET} is not"):
        config_from_env({ENV_SKIP: "0"})


def test_register_is_a_no_op_when_off(monkeypatch):
    """The entry point does nothing (imports nothing of vLLM) without the preset, however often it is called."""
    import sys

    for name in (ENV_PRESET, ENV_LAYER_PRESETS, ENV_SKIP, ENV_ANCHORS):
        monkeypatch.delenv(name, raising=False)
    had_vllm = "vllm" in sys.modules
    register()
    register()
    assert ("vllm" in sys.modules) == had_vllm


def test_vllm_presets_are_the_per_token_ones():
    """The scalar per-token presets and their trellis twins (issue 42: lower KL on the pages at the same bytes)."""
    assert VLLM_PRESETS == ("int8", "4bit", "3bit", "2.5bit", "2bit", "4bit-tcq", "3bit-tcq", "2.5bit-tcq", "2bit-tcq")
    assert config_from_env({ENV_PRESET: "3bit-tcq", ENV_LAYER_PRESETS: "0=3bit"}).layers == {0: "3bit"}


@pytest.mark.parametrize("environ, match", [
    ({ENV_PRESET: "lossless"}, f"{ENV_PRESET} must be one of \\['int8', '4bit', .*, '2bit-tcq'\\], got 'lossless'"),
    ({ENV_PRESET: "3bit-tcq", ENV_LAYER_PRESETS: "0=1bit-tcq"}, f"{ENV_LAYER_PRESETS} must be one of"),
    ({ENV_PRESET: "4bits"}, f"{ENV_PRESET} must be one of"),
    ({ENV_PRESET: "4bit", ENV_LAYER_PRESETS: "0=5bit"}, f"{ENV_LAYER_PRESETS} must be one of .*'raw'"),
    ({ENV_PRESET: "4bit", ENV_LAYER_PRESETS: "0:int8"}, "entries must be LAYERS=PRESET"),
    ({ENV_PRESET: "4bit", ENV_LAYER_PRESETS: "a=int8"}, "layers must be indices or ranges"),
    ({ENV_PRESET: "4bit", ENV_SKIP: "5-2"}, f"{ENV_SKIP}: a layer range needs 0 <= first <= last"),
    ({ENV_PRESET: "4bit", ENV_SKIP: "1", ENV_LAYER_PRESETS: "1=int8"}, "pick one"),
    ({ENV_PRESET: "4bit", ENV_ANCHORS: "x"}, f"{ENV_ANCHORS} must be an int >= 0"),
    ({ENV_PRESET: "4bit", ENV_ANCHORS: "-2"}, f"{ENV_ANCHORS} must be an int >= 0"),
])
def test_bad_configuration_names_the_variable(environ, match):
    with pytest.raises(ValueError, match=match):
        config_from_env(environ)


def test_overrides():
    config = config_from_env({ENV_PRESET: "3bit", ENV_LAYER_PRESETS: "0=int8, 27-28=4bit", ENV_SKIP: "29",
                              ENV_ANCHORS: "2"})
    assert config == PluginConfig("3bit", {0: "int8", 27: "4bit", 28: "4bit", 29: RAW}, 2)
    assert [config.preset_of(i) for i in (0, 1, 27, 28, 29)] == ["int8", "3bit", "4bit", "4bit", RAW]
    fmt = config.layer_format(28, 64, torch.bfloat16)
    assert fmt.name == "4bit" and fmt.key.rotate == 28 and fmt.anchors == 2


def test_every_page_is_the_largest_format():
    """One page size for every layer (vLLM's customize_spec does not see the layer): the largest format's."""
    dtype = torch.bfloat16
    alone = PluginConfig("3bit").state_content_bytes(64, dtype, 128)
    assert alone == page_format("3bit", 0, 64, dtype).state_content_bytes(128) == 51
    assert PluginConfig("3bit", {5: "2.5bit"}).state_content_bytes(64, dtype, 128) == alone
    assert PluginConfig("3bit-tcq", {5: "3bit"}).state_content_bytes(64, dtype, 128) == alone  # a twin's bytes
    assert PluginConfig("3bit", {5: "int8"}).state_content_bytes(64, dtype, 128) == 132
    assert PluginConfig("3bit", {0: RAW}).state_content_bytes(64, dtype, 128) == 256
    # the default preset counts even where layer 0 has another: its layers' pages must hold it
    assert PluginConfig("int8", {0: "3bit", 1: "4bit"}).state_content_bytes(64, dtype, 128) == 132


def test_format_errors_name_the_preset():
    with pytest.raises(ValueError, match=f"{ENV_PRESET}=4bit .*head_dim=60"):
        PluginConfig("4bit").state_content_bytes(60, torch.bfloat16, 128)
    with pytest.raises(ValueError, match=f"{ENV_ANCHORS}=16 raw rows leave no code slot"):
        PluginConfig("4bit", anchors=16).state_content_bytes(64, torch.bfloat16, 16)


def test_vllm_version_check():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(ValueError, match=r"supports vLLM \['0.32.0'\], not 0.31.1"):
        check_vllm_version("0.31.1")
