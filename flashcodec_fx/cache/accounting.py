"""What a :class:`~flashcodec_fx.cache.CodecStream` holds: every byte by part, and the bits its tokens take as
stored."""

from __future__ import annotations

STORAGE_PARTS = ("archive", "scales", "sinks", "tail", "mean", "norm", "memo")
GROUP_PARTS = ("archive_held", "archive_used")  # archive groups with their scales: allocated, filled (not in total)


class StreamAccounting:
    """:class:`~flashcodec_fx.cache.CodecStream`'s storage accounting (a part of that class: it reads the stream's
    state, memo, raw prefix and host mirrors)."""

    def storage_breakdown(self) -> dict[str, int]:
        """Every byte held, by part: ``archive`` (codes / coefficients, allocated capacity), ``scales`` (scales, zero
        points, png indices), ``sinks``, ``tail`` (raw rows + length), ``mean``, ``norm`` (channel exponents), ``memo``,
        and ``total``.
        Not added into ``total``: ``archive_held``, every allocated group's archive + scales; ``archive_used``, the
        filled groups' archive + scales (at most ``archive_held``); ``stored``, what the stored tokens take as stored
        (:meth:`stored_bits` / 8: filled groups, sinks, the tail rows holding tokens, the mean and norm). Tokens held raw
        (:attr:`raw_prefix`) are all ``tail``: exactly a DynamicCache's bytes."""
        if self.state is None:
            held = 0 if self._raw is None else self._raw.nbytes
            return {**dict.fromkeys(STORAGE_PARTS, 0), "tail": held, "total": held, **dict.fromkeys(GROUP_PARTS, 0),
                    "stored": held}
        st = self.state
        nbytes = {"archive": st.data.nbytes, "scales": st.scale.nbytes + st.zero.nbytes + st.index.nbytes,
                  "sinks": st.sink.nbytes, "tail": st.tail.nbytes + st.length.nbytes + st.start.nbytes, "mean": st.mean.nbytes,
                  "norm": st.norm.nbytes, "memo": 0 if self.memo is None else self.memo.nbytes}
        nbytes["total"] = sum(nbytes.values())
        nbytes["archive_held"] = st.data.nbytes + nbytes["scales"]
        nbytes["archive_used"] = self.filled_groups * nbytes["archive_held"] // max(1, st.data.shape[2])
        nbytes["stored"] = self.stored_bits() // 8
        return nbytes

    def storage_bytes(self) -> int:
        """Every byte this stream holds (see :meth:`storage_breakdown`)."""
        return self.storage_breakdown()["total"]

    def stored_bits(self) -> int:
        """Bits that the stored tokens take as stored: filled archive groups (codes, scales, zero points), the sinks
        and tail rows holding tokens (in their stored dtype: :attr:`raw_dtype`), the mean and norm; no unused capacity,
        no memo. Tokens held raw: their bytes."""
        if self.state is None:
            return 0 if self._raw is None else 8 * self._raw.nbytes
        st, codec, n = self.state, self.codec, self.get_seq_length()
        d, item = st.tail.shape[3], st.tail.element_size()
        lead = st.tail.shape[0] * st.tail.shape[1]
        archived = self.archived_tokens
        raw = min(n, codec.sinks) + (n - archived if n > archived else 0)
        return 8 * (lead * self.filled_groups * codec.group_bytes(d, self.dtype) + lead * raw * d * item
                    + st.mean.nbytes + st.norm.nbytes)
