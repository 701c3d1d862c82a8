"""What ``bits_per_value()`` and ``storage_bytes()`` count (issue 32.9): bits are the stored tokens as stored
(``storage_breakdown()["stored"]``), bytes everything held; held = stored + spare capacity + bookkeeping + memo,
exactly. After prompt lookup the same-length cache stores fewer bits (a crop leaves the tokens a draft pushed out of
the raw window archived) and holds other bytes (capacity grown by the verification calls, kept after their crops).
Whether the run's last crop still shows depends on the tokens generated, so both runs end with one verification call
of their own: eleven tokens with ten rejected on the lookup's cache, the one kept on the plain one."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from conftest import fresh_tiny_model, output_cache, tiny_prompt  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf.layer import FlashCodecLayer  # noqa: E402

NEW = 40


def _generate(preset: str, drafted: int, **kwargs):
    """The cache of a greedy run over a repetitive 300-token prompt (prompt lookup finds drafts in it), then one
    verification call of ``1 + drafted`` tokens cropped back to the first."""
    model = fresh_tiny_model("llama")
    fx.apply_flash_codec(model, preset=preset)
    ids = tiny_prompt(length=60).repeat(1, 5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*generation_config.*")
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, **kwargs)
        cache = output_cache(out)
        kept = cache.get_seq_length() + 1
        model(tiny_prompt(length=1 + drafted, seed=2), past_key_values=cache, use_cache=True)
    cache.crop(kept)
    return cache


def _streams(cache):
    return [s for layer in cache.layers if isinstance(layer, FlashCodecLayer) for s in (layer.keys_stream, layer.values_stream)]


def _spare(stream) -> int:
    """Bytes a stream holds beyond its stored tokens and memo, from its state's shapes: archive groups allocated and not
    filled (codes and scales), sink and tail rows not holding a token, the length and start counters."""
    st, n = stream.state, stream.get_seq_length()
    lead, d = st.tail.shape[0] * st.tail.shape[1], st.tail.shape[3]
    archive = (st.data.shape[2] - stream.filled_groups) * lead * stream.codec.group_bytes(d, stream.dtype)
    sinks = (st.sink.shape[2] - min(n, stream.codec.sinks)) * lead * d * st.sink.element_size()
    tail = (st.tail.shape[2] - max(0, n - stream.archived_tokens)) * lead * d * st.tail.element_size()
    return archive + sinks + tail + st.length.nbytes + st.start.nbytes


@pytest.mark.parametrize("preset", ["4bit", "lossless"])
def test_bits_count_the_stored_part_and_bytes_add_spare_capacity_and_memo(preset):
    plain, lookup = _generate(preset, drafted=0), _generate(preset, drafted=10, prompt_lookup_num_tokens=10)
    assert plain.get_seq_length() == lookup.get_seq_length() == 300 + NEW  # the last token is not fed back; one verified
    for cache in (plain, lookup):
        parts = cache.storage_breakdown()
        values = sum(layer.cached_values() for layer in cache.layers if isinstance(layer, FlashCodecLayer))
        assert sum(s.stored_bits() for s in _streams(cache)) == 8 * parts["stored"]
        assert cache.bits_per_value() == 8 * parts["stored"] / values  # the same integers: exactly
        assert cache.storage_bytes() == parts["total"] == parts["stored"] + sum(map(_spare, _streams(cache))) + parts["memo"]
    if preset == "4bit":  # a window of raw tokens: after the crops it holds fewer (archived by a draft, kept archived)
        shorter = [(a.archived_tokens - b.archived_tokens, a) for a, b in zip(_streams(lookup), _streams(plain), strict=True)]
        assert any(extra > 0 for extra, _ in shorter)
        assert all(s.get_seq_length() - s.archived_tokens <= s.codec.window for _, s in shorter)
        raw_minus_coded = 0
        for extra, s in shorter:  # per-token codecs: each token archived instead of raw trades its raw row for a group
            lead, d = s.state.tail.shape[0] * s.state.tail.shape[1], s.state.tail.shape[3]
            raw_minus_coded += extra * lead * (d * s.state.tail.element_size() - s.codec.group_bytes(d, s.dtype))
        assert plain.storage_breakdown()["stored"] - lookup.storage_breakdown()["stored"] == raw_minus_coded
