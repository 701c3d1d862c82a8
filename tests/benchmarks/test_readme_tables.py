"""The measured tables of README.md and docs/results.md are what benchmarks/readme_tables.py renders from
benchmarks/results/*.json."""

from __future__ import annotations

import json
import re

import pytest
import readme_tables

pytest.importorskip("transformers")


def texts() -> dict:
    return {path: path.read_text() for path in readme_tables.DOCUMENTS}


def test_readme_tables_match_the_committed_json():
    for path, text in texts().items():
        assert readme_tables.regenerate(text, path) == text, f"{path.name} is out of date: run benchmarks/readme_tables.py"
    assert readme_tables.main(["--check"]) == 0


def test_every_table_names_a_json_that_records_its_commit():
    for match in (m for text in texts().values() for m in readme_tables.BLOCK.finditer(text)):
        named = re.findall(r"\[([\w-]+)\.json\]\((?:\.\./)?benchmarks/results/", match.group("body"))
        assert named, match.group("name")
        for name in named:
            result = json.loads((readme_tables.RESULTS / f"{name}.json").read_text())
            assert re.fullmatch(r"[0-9a-f]{40}", result["versions"]["git_commit"]), name
            assert result["versions"]["git_commit"][:7] in match.group("body")


def kl_cells(block: str) -> list[str]:
    """The cells of every column headed "KL vs raw" (or "<model>: KL vs raw") of every table in a README block."""
    cells = []
    for table in block.split("\n\n"):
        lines = [line for line in table.splitlines() if line.startswith("|")]
        if not lines:
            continue
        heads = [c.strip() for c in lines[0].strip("|").split("|")]
        cols = [i for i, head in enumerate(heads) if head == "KL vs raw" or head.endswith(": KL vs raw")]
        cells += [[c.strip() for c in line.strip("|").split("|")][i] for line in lines[2:] for i in cols]
    return cells


def test_no_kl_cell_is_negative_or_a_bare_approximation():
    cells = [c for text in texts().values() for m in readme_tables.BLOCK.finditer(text) for c in kl_cells(m.group("body"))]
    assert cells
    for cell in cells:
        assert cell == "0" or re.fullmatch(r"< \de[+-]\d\d", cell) or (re.fullmatch(r"\d\.\d\de[+-]\d\d", cell)
                                                                      and float(cell) > 0), cell


@pytest.mark.parametrize(("row", "cell"), [
    ({"kl": 0.0}, "0"), ({"kl": -1.9e-8}, "0"), ({"kl": 7.36e-4}, "7.36e-04"),
    ({"kl": -1.9e-8, "kl_noise_floor": 3e-7}, "< 3e-07"), ({"kl": 2e-7, "kl_noise_floor": 3e-7}, "< 3e-07"),
    ({"kl": 7.4e-4, "kl_noise_floor": 3e-7}, "7.40e-04"), ({"kl": 0.0, "kl_noise_floor": None}, "0"),
])
def test_kl_cell(row, cell):
    assert readme_tables.kl_cell(row) == cell


def test_table_blocks_must_all_be_there_once_and_known():
    docs = texts()
    readme_tables.check_complete(docs)
    results = readme_tables.DOCUMENTS[1]
    with pytest.raises(ValueError, match=r"missing \['e2e'\]"):
        readme_tables.check_complete({**docs, results: docs[results].replace("<!-- table: e2e -->", "<!-- e2e -->")})
    with pytest.raises(ValueError, match=r"in more than one place \['presets'\]"):
        readme_tables.check_complete({**docs, results: docs[results] + docs[readme_tables.README]})
    with pytest.raises(ValueError, match=r"unknown \['nope'\]"):
        readme_tables.regenerate(docs[results] + "\n<!-- table: nope -->\n<!-- /table -->\n", results)


def test_links_are_relative_to_the_document():
    readme, results = readme_tables.DOCUMENTS[:2]
    assert "](../benchmarks/results/" in results.read_text() and "](../benchmarks/results/" not in readme.read_text()
    block = "<!-- table: presets -->\n<!-- /table -->\n"
    assert "](benchmarks/results/ppl.json)" in readme_tables.regenerate(block, readme)
    assert "](../benchmarks/results/ppl.json)" in readme_tables.regenerate(block, results)


def test_check_reports_a_stale_document(tmp_path, capsys):
    stale = tmp_path / "results.md"
    text = readme_tables.DOCUMENTS[1].read_text()
    assert "| SDPA, raw fp32 K/V | - |" in text
    stale.write_text(text.replace("| SDPA, raw fp32 K/V | - |", "| SDPA, raw fp32 K/V | x |"))
    assert readme_tables.main(["--check", "--document", str(stale)]) == 1
    assert "| SDPA, raw fp32 K/V | x |" in capsys.readouterr().out
    assert readme_tables.main(["--document", str(stale)]) == 0
    assert readme_tables.main(["--check", "--document", str(stale)]) == 0



def test_a_preset_row_names_the_recipe_it_ran_with():
    earlier = {"tier": "flashcodec 3bit", "options": {"preset": "3bit"},
               "recipe": {"key_options": {"quant_bits": 3, "window": 32}, "value_options": {"quant_bits": 2, "window": 32}}}
    assert readme_tables._as_run(earlier)["tier"] == "flashcodec 3bit (as run: K3 W32 + V2 W32)"
    assert readme_tables._as_run({"tier": "K3 W20 + V2 W4", "recipe": None})["tier"] == "K3 W20 + V2 W4"
