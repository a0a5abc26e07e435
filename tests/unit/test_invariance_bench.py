"""benchmarks/invariance_bench.py: which of a `bench` command line's extra flags `prepare` receives
(each arm is prepared with the engine flags its runs use, so both arms' kernel choices are measured)."""
from __future__ import annotations

import pytest

from mixserve.cli import build_parser
from tests.scripts import load_script


def test_engine_flags_keep_engine_flags_with_their_values_and_drop_the_rest():
    b = load_script("invariance_bench")
    extra = ["--gguf-weights", "native", "--request-rate", "4", "--dtype=float32", "--batch-invariant", "off",
             "--kernels", "eager", "--max-num-seqs", "8", "--model", "x", "--no-prefix-caching-typo"]
    got = b.engine_flags(extra)
    assert got == ["--gguf-weights", "native", "--dtype=float32", "--kernels", "eager", "--max-num-seqs", "8"]
    # what it keeps, prepare's own parser takes: the prepare run cannot fail on a bench-only flag
    build_parser().parse_args(["prepare", "--model", "m", "--batch-invariant", "on", *got])


@pytest.mark.parametrize("extra", [[], ["--num-prompts", "3"]])
def test_engine_flags_empty_where_no_engine_flag(extra):
    assert load_script("invariance_bench").engine_flags(extra) == []
