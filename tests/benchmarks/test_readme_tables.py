"""README.md's measured tables are what benchmarks/readme_tables.py renders from benchmarks/results/*.json."""

from __future__ import annotations

import json
import re

import pytest
import readme_tables

pytest.importorskip("transformers")


def test_readme_tables_match_the_committed_json():
    text = readme_tables.README.read_text()
    assert readme_tables.regenerate(text) == text, "README is out of date: run python benchmarks/readme_tables.py"
    assert readme_tables.main(["--check"]) == 0


def test_every_table_names_a_json_that_records_its_commit():
    text = readme_tables.README.read_text()
    for match in readme_tables.BLOCK.finditer(text):
        named = re.findall(r"\[([\w-]+)\.json\]\(benchmarks/results/", match.group("body"))
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
    text = readme_tables.README.read_text()
    cells = [c for m in readme_tables.BLOCK.finditer(text) for c in kl_cells(m.group("body"))]
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


def test_table_blocks_must_all_be_there_and_known():
    text = readme_tables.README.read_text()
    with pytest.raises(ValueError, match=r"missing \['e2e'\]"):
        readme_tables.regenerate(text.replace("<!-- table: e2e -->", "<!-- e2e -->"))
    with pytest.raises(ValueError, match=r"unknown \['nope'\]"):
        readme_tables.regenerate(text + "\n<!-- table: nope -->\n<!-- /table -->\n")


def test_check_reports_a_stale_readme(tmp_path, capsys):
    stale = tmp_path / "README.md"
    stale.write_text(readme_tables.README.read_text().replace("| SDPA, raw fp32 K/V | - |", "| SDPA, raw fp32 K/V | x |"))
    assert readme_tables.main(["--check", "--readme", str(stale)]) == 1
    assert "| SDPA, raw fp32 K/V | x |" in capsys.readouterr().out
    assert readme_tables.main(["--readme", str(stale)]) == 0 and readme_tables.main(["--check", "--readme", str(stale)]) == 0



def test_a_preset_row_names_the_recipe_it_ran_with():
    earlier = {"tier": "flashcodec 3bit", "options": {"preset": "3bit"},
               "recipe": {"key_options": {"quant_bits": 3, "window": 32}, "value_options": {"quant_bits": 2, "window": 32}}}
    assert readme_tables._as_run(earlier)["tier"] == "flashcodec 3bit (as run: K3 W32 + V2 W32)"
    assert readme_tables._as_run({"tier": "K3 W20 + V2 W4", "recipe": None})["tier"] == "K3 W20 + V2 W4"
