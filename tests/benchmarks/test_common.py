"""benchmarks/common.py: the CPU-burning neighbours of the busy-machine rows."""

from __future__ import annotations

import os

import pytest
from common import NEIGHBOURS, neighbour


@pytest.mark.parametrize("kind", [k for k in NEIGHBOURS if k != "none"])
def test_neighbours_burn_while_the_block_runs_and_stop_after(kind):
    with neighbour(kind) as procs:
        assert len(procs) == ((os.cpu_count() or 1) if kind == "python" else 1)
        assert all(p.poll() is None for p in procs)  # still running: burning
    assert all(p.poll() is not None for p in procs)


def test_no_neighbour_and_unknown_ones():
    with neighbour("none") as procs:
        assert procs == []
    with pytest.raises(ValueError, match="neighbour must be one of"), neighbour("gpu"):
        pass


def test_threads_argument_is_the_clis_policy():
    import argparse

    from common import add_threads_argument

    parser = argparse.ArgumentParser()
    add_threads_argument(parser, 2)
    assert parser.parse_args([]).threads == 2
    assert parser.parse_args(["--threads", "auto"]).threads == "auto"
    assert parser.parse_args(["--threads", "3"]).threads == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])
