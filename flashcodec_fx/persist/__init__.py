"""Keeping and moving caches: the lossless stored form of tensors (:mod:`.lossless`: plane transforms + entropy
coders), the cache file format (:mod:`.fileformat`), a stream's state as named tensors (:mod:`.stream_io`) and
copy-on-append sharing of a prefix (:mod:`.fork`). No transformers import; ``flashcodec_fx.hf.cache_file`` builds
``FlashCodecCache.save`` / ``load`` on it."""
