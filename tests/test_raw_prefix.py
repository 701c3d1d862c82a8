"""The raw prefix of a dynamic stream (``flashcodec_fx/raw_prefix.py``): its first tokens are held exactly as a
DynamicCache holds them and read exactly; the conversion to the codec's state is invisible afterwards (every state
tensor bitwise the state the same calls build without the prefix, for every preset and the tiers the tests use)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from codec_tiers import kv_like, tier_table

from flashcodec_fx import CodecKVCache, CodecStream, make_codec
from flashcodec_fx.presets import PRESETS, preset_codecs
from flashcodec_fx.raw_prefix import MAX_PREFIX, RAW_CODEC_PREFIX, prefix_length, replay_calls

D = 16
CODECS = {f"{preset}-{role}": codec for preset in PRESETS
          for role, codec in zip(("keys", "values"), preset_codecs(preset, layer_idx=1), strict=True)}
CODECS.update({f"{name}-r{r}": codec for r in (4, 8) for name, codec in tier_table(r, 2).items()})
SPLITS = {"decode": [1] * 90, "prompt-then-chunks": [3, 2, 7, 1, 1, 5, 30, 1, 40], "long-prompt": [70, 1, 1, 9]}


def stream(codec, prefix: bool = True, **kwargs) -> CodecStream:
    out = CodecStream(codec, **kwargs)
    out._raw_prefix = prefix
    return out


def assert_same_state(a: CodecStream, b: CodecStream) -> None:
    """Bitwise: the host mirrors, every state tensor (archive fields over the shorter capacity, zeros past it), the
    memo over the stored positions."""
    assert (a.get_seq_length(), a.archived_tokens, a._host_start) == (b.get_seq_length(), b.archived_tokens, b._host_start)
    for x, y in zip(a.state[:4], b.state[:4], strict=True):
        g = min(x.shape[2], y.shape[2])
        assert torch.equal(x[:, :, :g], y[:, :, :g]) and not x[:, :, g:].any() and not y[:, :, g:].any()
    for x, y in zip(a.state[4:], b.state[4:], strict=True):
        assert torch.equal(x, y)
    assert (a.memo is None) == (b.memo is None)
    if a.memo is not None:
        n = a.get_seq_length()
        assert torch.equal(a.memo[:, :, :n], b.memo[:, :, :n])


@pytest.mark.parametrize("memoize", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(CODECS))
def test_the_raw_prefix_is_invisible_after_conversion(name, dtype, memoize):
    codec = CODECS[name]
    until = prefix_length(codec, D, dtype)
    for split in SPLITS.values():
        x = kv_like((2, 2, sum(split), D), dtype, seed=len(split))
        ours, plain = stream(codec, memoize=memoize), stream(codec, False, memoize=memoize)
        at = 0
        for t in split:
            for s in (ours, plain):
                s.append(x[:, :, at: at + t])
            at += t
            assert ours.raw_prefix == (at < until and split[0] < until)
            if ours.raw_prefix:  # held exactly as given, nothing else
                assert torch.equal(ours.read(), x[:, :, :at]) and ours.memo is None
                assert ours.storage_bytes() == ours.stored_bits() // 8 == x[:, :, :at].nbytes
            else:
                assert_same_state(ours, plain)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_crop_while_raw_rolls_back_exactly(preset):
    """Crop inside the prefix (into the first call past the sinks too) + the same tokens again in the same calls:
    after conversion every tensor as if no crop had happened."""
    codec = preset_codecs(preset, layer_idx=2)[0]
    first = prefix_length(codec, D, torch.bfloat16) - 1  # the longest call held raw
    keep = first // 2 + 1  # past the sinks of every preset
    x = kv_like((1, 2, 80, D), torch.bfloat16, seed=4)
    plain, ours = stream(codec, False), stream(codec)
    for s in (plain, ours):
        s.append(x[:, :, :first])
    ours.crop(keep)
    ours.append(x[:, :, keep:first])
    assert ours.raw_prefix and torch.equal(ours.read(), x[:, :, :first])
    for i in range(first, 80):
        for s in (plain, ours):
            s.append(x[:, :, i: i + 1])
    assert not ours.raw_prefix
    assert_same_state(ours, plain)


def test_other_tokens_after_a_crop_into_the_first_call_set_the_mean_at_conversion():
    """The mean is of the first call past the sinks; a crop into it while raw, then other tokens: the mean is of the
    tokens held at those positions when the stream converts (what was cropped is not held any more)."""
    codec = preset_codecs("3bit", layer_idx=1)[0]
    assert codec.center and codec.sinks == 4
    x, y = kv_like((1, 2, 60, D), torch.float32, seed=5), kv_like((1, 2, 60, D), torch.float32, seed=6)
    ours = stream(codec)
    ours.append(x[:, :, :10])  # the first call past the sinks: positions 0..9
    ours.crop(7)
    held = torch.cat([x[:, :, :7], y[:, :, 7:60]], dim=2)
    for i in range(7, 60):
        ours.append(held[:, :, i: i + 1])
    plain = stream(codec, False)
    for lo, hi in ((0, 10), (10, 60)):  # the first call's positions, over the tokens held
        plain.append(held[:, :, lo:hi])
    assert not ours.raw_prefix
    assert_same_state(ours, plain)


def test_attention_while_raw_reads_the_tokens_exactly():
    """Attention on the stored form while both streams are raw, and while only the keys still are (the values
    converted): SDPA over the tokens held raw and the values' decoded view."""
    key, value = preset_codecs("3bit", layer_idx=1)
    until_k, until_v = (prefix_length(c, D, torch.float32) for c in (key, value))
    assert until_v < until_k
    x, y = kv_like((2, 2, until_k, D), torch.float32, seed=7), kv_like((2, 2, until_k, D), torch.float32, seed=8)
    q = kv_like((2, 4, 3, D), torch.float32, seed=9)
    cache = CodecKVCache(key, value)
    repeat = lambda t: t.repeat_interleave(2, 1)  # noqa: E731
    for n in (3, until_v + 2):
        cache.append(x[:, :, cache.get_seq_length():n], y[:, :, cache.get_seq_length():n])
        assert cache.keys.raw_prefix and cache.values.raw_prefix == (n < until_v)
        k, v = cache.read()
        assert torch.equal(k, x[:, :, :n])
        mask = torch.ones(1, 1, 3, n, dtype=torch.bool).tril(n - 3)
        want = F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask)
        torch.testing.assert_close(cache.attention(q, mask), want, atol=1e-5, rtol=0)
        new = (x[:, :, n - 3:n], y[:, :, n - 3:n])
        v_exact = torch.cat([v[:, :, :n - 3], new[1]], dim=2)
        want = F.scaled_dot_product_attention(q, repeat(k), repeat(v_exact), attn_mask=mask)
        torch.testing.assert_close(cache.attention(q, mask, new=new), want, atol=1e-5, rtol=0)


def test_raw_tokens_move_select_repeat_and_crop_to_nothing():
    codec = preset_codecs("2bit", layer_idx=1)[0]
    x = kv_like((3, 2, 12, D), torch.bfloat16, seed=10)
    s = stream(codec, memoize=True)
    s.append(x)
    assert s.raw_prefix and s.capacity == 12 and s.archived_tokens == s.filled_groups == 0 and s.tail.shape == x.shape
    s.index_select(torch.tensor([2, 0]))
    s.repeat_interleave(2)
    s.move_to("cpu")
    assert torch.equal(s.read(), x[[2, 0]].repeat_interleave(2, dim=0))
    s.crop(0)
    assert s.raw_prefix and s.get_seq_length() == 0 and s.storage_bytes() == 0
    more = kv_like((4, 2, 70, D), torch.bfloat16, seed=11)
    s.append(more)  # converts at once (past the prefix length): the memo comes with the codec state
    assert not s.raw_prefix and s.memo is not None
    s.crop(0)  # emptied: held raw again, the state released
    assert s.raw_prefix and s.state is None and s.memo is None and s.storage_bytes() == 0
    s.reset()
    assert not s.is_initialized


def test_where_there_is_no_prefix():
    lossy = preset_codecs("int8")[0]
    x = torch.randn(1, 2, 5, D)
    static = stream(lossy, layout="static", max_length=32)
    static.append(x[:, :, :1])
    assert not static.raw_prefix and static.state is not None  # preallocated for max_length by design
    png = stream(make_codec("png", block_size=4))
    png.append(x)
    assert not png.raw_prefix  # png holds more than raw at every length: nothing to gain
    long = stream(lossy)
    long.append(torch.randn(1, 2, prefix_length(lossy, D, torch.float32), D))
    assert not long.raw_prefix  # a first call of the prefix length or more allocates the codec state at once


def test_a_compiled_step_converts_first():
    codec = preset_codecs("4bit", layer_idx=1)[0]
    x = kv_like((1, 2, 8, D), torch.float32, seed=12)
    ours, plain = stream(codec), stream(codec, False)
    for s in (ours, plain):
        s.append(x[:, :, :5])
    assert ours.raw_prefix

    @torch.compile(backend="eager")  # the conversion runs eagerly (a graph break), then the step on the codec state
    def step(t):
        ours.append(t)
        return torch.ops.flashcodec.read(list(ours.state), ours.spec, t)

    view = step(x[:, :, 5:6])
    plain.append(x[:, :, 5:6])
    assert not ours.raw_prefix
    assert_same_state(ours, plain)
    assert torch.equal(view[:, :, :6], torch.ops.flashcodec.read(list(plain.state), plain.spec, x[:, :, 5:6])[:, :, :6])


def test_prefix_lengths():
    """SmolLM2's shapes (head_dim 64, bf16): a few dozen tokens for the lossy presets, 64 for lossless; none for png."""
    lengths = {name: [prefix_length(c, 64, torch.bfloat16) for c in preset_codecs(name)] for name in PRESETS}
    scalar = {"4bit": [48, 47], "3bit": [32, 11], "2.5bit": [28, 11], "2bit": [23, 15]}
    twins = {f"{name}-tcq": prefix for name, prefix in scalar.items()}  # the same sinks and windows as their twins
    assert lengths == {"lossless": [64, 64], "int8": [3, 3], **scalar, **twins}
    assert RAW_CODEC_PREFIX == 64 and prefix_length(make_codec("png", block_size=8), 64, torch.bfloat16) == 0
    barely = make_codec("jpeg", block_size=8, keep_freqs=7, sinks=4, window=64)  # compresses by 1/8 only
    assert prefix_length(barely, 64, torch.bfloat16) == MAX_PREFIX


def test_replay_calls():
    assert replay_calls(None, 0, 5) == [(0, 5)]
    assert replay_calls((3, 9), 20, 1) == [(0, 3), (3, 9), (9, 20), (20, 21)]
    assert replay_calls((0, 9), 6, 30) == [(0, 9), (9, 36)]  # a crop cut into the first call: it runs into the new one
    assert replay_calls(None, 3, 10) == [(0, 3), (3, 13)]
