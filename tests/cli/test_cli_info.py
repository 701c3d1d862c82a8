"""``flashcodec info`` and transformers' tested range: the version with the range, a WARNING line outside it."""

from __future__ import annotations

import json

from flashcodec_fx import _compat, cli


def test_info_shows_the_tested_range_and_no_warning_inside_it(monkeypatch, capsys):
    monkeypatch.setattr(_compat, "TRANSFORMERS", _compat.TRANSFORMERS_TESTED[1])
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    oldest, newest = (".".join(map(str, end)) for end in _compat.TRANSFORMERS_TESTED)
    assert f"(tested {oldest} .. {newest})" in out and "WARNING" not in out


def test_info_warns_outside_the_tested_range(monkeypatch, capsys):
    monkeypatch.setattr(_compat, "TRANSFORMERS", (5, 99))
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    warning = [line for line in lines if line.startswith("WARNING: ")]
    assert warning == [f"WARNING: {_compat.transformers_untested((5, 99))}"] and "5.99 is newer" in warning[0]
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["warnings"] == [_compat.transformers_untested((5, 99))]
    assert report["tested"]["transformers"] == " .. ".join(".".join(map(str, e)) for e in _compat.TRANSFORMERS_TESTED)
