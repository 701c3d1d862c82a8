"""flashcodec conforms on every transformers CausalLM architecture that builds tiny and generates natively
(flashcodec_fx/evaluate/architectures.py): ``apply_flash_codec(model, preset=...)`` and nothing else, as a new user
would, against the same tiny random-init model without flashcodec.

One test per (architecture, check) of ``architectures.CHECKS``: lossless tokens (greedy, left-padded batch, 2-beam),
``remove_flash_codec``, int8 / 4bit / 2bit logits within ``LOGIT_BOUNDS`` and a compressing cache, codec layer
placement (compressing nothing fails), no flashcodec warning during the lossy runs. An architecture is run once, its
checks share the native reference runs (the module-scoped ``conformance`` fixture). Encoder-decoders, models that need
pixel / audio inputs and models whose native tiny ``generate()`` fails skip, with the reason; nothing is xfailed: an
architecture flashcodec gets wrong fails here. The limits the project states (``KNOWN_LIMITS``: a model the stored form
cannot serve runs on the decoded view, chosen at apply time and announced; an indexed-attention layer keeps its native
cache, announced by ``NoCodecLayers``) are asserted to fail exactly so, with that reason: the table in
docs/architectures.md shows them as failures, and a limit lifted fails here until it is taken off the list.
``test_core_conformance`` (a few architectures, one per attention kind) is in the quick subset; the rest is ``slow``
(tests/conftest.py). The results table over every architecture is
docs/architectures.md (benchmarks/bench_architectures.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from flashcodec_fx.evaluate import architectures as arch  # noqa: E402

ARCHITECTURES = arch.causal_lm_architectures()
CHECKS = list(arch.CHECKS)
CORE = ("llama", "gemma3_text", "qwen3_5_text", "deepseek_v3")
"""One architecture per attention kind (full; sliding + full; linear + full; multi-head latent): the quick subset's."""
MIN_RUN = 30

_VIEW = {"stored_form": "MaterializationFreeFallback"}  # the decoded view, chosen at apply time and announced once
_NO_CODEC = {"lossless_greedy": "without codec layers", "int8": "no codec layer", "4bit": "no codec layer",
             "2bit": "no codec layer", "placement": "no codec layer", "stored_form": "NoCodecLayers"}
KNOWN_LIMITS: dict[str, dict[str, str]] = {
    # attention modules that do not call transformers' attention interface, or change K/V after the update (JetMoE,
    # DiffLlama), a mask over fewer keys than the layer holds (Doge), per-token sink values (Inkling 2)
    **{m: _VIEW for m in ("big_bird", "cpmant", "diffllama", "doge", "gpt_neo", "gpt_neox_japanese", "inkling2_loop_text",
                          "inkling2_text", "jetmoe", "megatron-bert", "rembert", "roformer", "trocr", "xglm", "xlm")},
    # every attention layer indexed (sparse attention with an indexer): native cache, NoCodecLayers at apply time
    **{m: _NO_CODEC for m in ("axk2", "deepseek_v32", "deepseek_v4", "glm_moe_dsa", "hy_v4", "qwen4_exp_text")},
    # indexed layers beside codec ones; dots3's only codec layer is an 8-position ring inside the presets' raw window
    "kolibri1_1": {"placement": "indexed_attention"},
    "dots3_note_text": {"placement": "indexed_attention", "4bit": "not below 16", "2bit": "not below 16"},
    # a lossy key error flips a near-tie of a random-init MoE router: int8's at layer 2, step 5; 4bit's at layer 1,
    # step 4 and layer 0, step 14 (router logits 0.003 / 0.005 apart); KL 1e-5 at every other step
    "kolibri1": {"int8": "logit variances"},
    "minimax_m3_vl_text": {"4bit": "logit variances"},
}
"""model_type -> {check: a phrase its failure reason holds}: failures the project states as limits (see the module
docstring); each is asserted to fail with that reason."""


@pytest.fixture(scope="module")
def conformance():
    """``run(model_type)``: the architecture's checks, run once for the module (one torch thread)."""
    runs: dict[str, dict] = {}

    def run(model_type: str) -> dict:
        if model_type not in runs:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                runs[model_type] = arch.run_architecture(model_type)
            finally:
                torch.set_num_threads(threads)
        return runs[model_type]

    return run


def _assert_check(result: dict, check: str) -> None:
    if result["status"] == "skip":
        pytest.skip(f"{result['model_type']}: {result['reason']}")
    rec = result["checks"][check]
    if rec["status"] == "skip":
        pytest.skip(f"{result['model_type']} {check}: {rec['reason']}")
    detail = f" ({rec['where']})" if rec.get("where") else ""
    limit = KNOWN_LIMITS.get(result["model_type"], {}).get(check)
    if limit is not None:
        assert rec["status"] == "fail" and limit in rec["reason"], \
            f"{result['model_type']} {check}: the stated limit ({limit!r}) no longer holds: {rec['status']} {rec['reason']}"
        return
    assert rec["status"] == "pass", f"{result['model_type']} {check}: {rec['reason']}{detail}"


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("model_type", CORE)
def test_core_conformance(conformance, model_type, check):
    _assert_check(conformance(model_type), check)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("model_type", [m for m in ARCHITECTURES if m not in CORE])
def test_conformance(conformance, model_type, check):
    _assert_check(conformance(model_type), check)


def test_enough_architectures_run_and_every_skip_says_why(conformance):
    results = [conformance(m) for m in ARCHITECTURES]
    ran = [r["model_type"] for r in results if r["status"] == "run"]
    assert len(ran) >= MIN_RUN, ran
    for result in results:
        assert result["status"] in ("run", "skip"), result
        if result["status"] == "skip":
            assert result["reason"], result["model_type"]
        for rec in result["checks"].values():
            assert rec["status"] in ("pass", "fail", "skip") and (rec["status"] == "pass" or rec["reason"]), rec


# the harness itself (quick)


def test_skip_reasons_name_encoder_decoders_and_multimodal_models():
    assert arch.skip_reason("bart") == "encoder-decoder"
    assert "not a text-only decoder" in arch.skip_reason("gemma3")
    assert arch.skip_reason("llama") is None and arch.skip_reason("gemma3_text") is None


def test_tiny_configs_are_tiny_and_keep_every_layer_kind():
    for model_type in CORE:
        config = arch.tiny_config(model_type)
        text = config.get_text_config(decoder=True)
        assert text.hidden_size == arch.HIDDEN and text.vocab_size == arch.VOCAB, model_type
        kinds = set(arch._layer_kinds(config))
        assert arch._kinds_of_default(model_type) <= kinds, model_type
    gemma = arch.tiny_config("gemma3_text")
    assert gemma.sliding_window == arch.WINDOW and {"sliding_attention", "full_attention"} <= set(gemma.layer_types)
    mla = arch.tiny_config("deepseek_v3")
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim) == (32, 8, 16, 16)


def test_the_padded_row_is_padded_past_every_window():
    model = arch.build_model("gemma3_text")
    probe = arch.Probe(model)
    assert probe.pad > arch.WINDOW
    assert (probe.batch[1, : probe.pad] == arch.PAD).all() and (probe.mask[1, : probe.pad] == 0).all()
    assert probe.mask[0].all() and probe.mask[1, probe.pad:].all()


def test_logit_stats_and_bounds():
    native = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    same = arch.logit_stats(native, native.clone())
    assert same["kl"] == 0 and same["max_abs"] == 0
    off = arch.logit_stats(native, native + torch.randn_like(native))
    bound = arch.LOGIT_BOUNDS["int8"]
    assert off["kl_rel"] > bound["kl_rel"] and off["max_abs_rel"] > bound["max_abs_rel"]
    error = 0.01 * torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    flat = arch.logit_stats(0.1 * native, 0.1 * (native + error))  # a random-init model's spread
    wider = arch.logit_stats(native, native + error)  # 10x wider logits, the same error relative to them
    assert wider["kl"] > 50 * flat["kl"] and 0.5 < wider["kl_rel"] / flat["kl_rel"] < 2  # scale-free; plain KL is not
    for bounds in arch.LOGIT_BOUNDS.values():
        assert set(bounds) == {"kl_rel", "max_abs_rel"}
    for key in ("kl_rel", "max_abs_rel"):
        values = [arch.LOGIT_BOUNDS[p][key] for p in arch.LOSSY_PRESETS]
        assert values == sorted(values)


def test_a_check_that_raises_is_a_failure_with_the_exception_not_an_escape(monkeypatch):
    def broken(model, probe):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setitem(arch.CHECKS, "broken", broken)
    rec = arch.run_check("broken", None, None)
    assert rec["status"] == "fail" and rec["reason"] == "RuntimeError: first line"


def test_a_model_that_compresses_nothing_fails_placement(monkeypatch):
    """A silent no-op is a failure: the patch is stubbed out so that generate keeps the native cache."""
    import flashcodec_fx as fx

    model = arch.build_model("llama")
    probe = arch.Probe(model)
    monkeypatch.setattr(fx, "apply_flash_codec", lambda model, **options: model)
    monkeypatch.setattr(fx, "remove_flash_codec", lambda model: model)
    rec = arch.run_check("placement", model, probe)
    assert rec["status"] == "fail" and rec["reason"].startswith("silent no-op"), rec
    assert arch.run_check("int8", model, probe)["status"] == "fail"
