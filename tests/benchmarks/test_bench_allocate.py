"""bench_allocate.py refuses, before loading any model, a calibration that does not fit the run: another model's or
another base recipe's, or one judged on its own text (in-sample)."""

from __future__ import annotations

import json
from pathlib import Path

import bench_allocate
import pytest


def _calibration(tmp_path: Path, **changes) -> Path:
    payload = {"model": "SmolLM2-135M-Instruct",
               "calibration": {"texts": "dialogue", "base": bench_allocate.BASE, "upgraded": [1, 0]}}
    payload["calibration"].update(changes.pop("calibration", {}))
    payload.update(changes)
    path = tmp_path / "allocate.json"
    path.write_text(json.dumps(payload))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"model": "gemma-3-270m"}, "calibrated gemma-3-270m"),
    ({"calibration": {"base": {"key_options": {}, "value_options": {}}}}, "another base recipe"),
    ({"calibration": {"texts": "prose"}}, "in-sample"),
])
def test_a_calibration_that_does_not_fit_the_run_is_refused(tmp_path, capsys, changes, message):
    with pytest.raises(SystemExit):
        bench_allocate.main(["--calibration", str(_calibration(tmp_path, **changes)), "--out", str(tmp_path / "o")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_calibrating_on_the_judged_text_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_allocate.main(["--calibration-texts", "prose", "--judge-texts", "prose"])
    assert "in-sample" in capsys.readouterr().err
