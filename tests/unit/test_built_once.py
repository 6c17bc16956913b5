"""fixtures.built_once: a directory built once per test run and reused, a failed build redone."""

from __future__ import annotations

import pytest

from fixtures import built_once


def test_built_once_then_reused_and_a_failed_build_is_redone(tmp_path_factory):
    calls = []

    def build(out):
        calls.append(out)
        out.mkdir(parents=True)
        (out / "data").write_text(str(len(calls)))

    first = built_once(tmp_path_factory, "unit-test", build)
    assert built_once(tmp_path_factory, "unit-test", build) == first
    assert len(calls) == 1 and (first / "data").read_text() == "1"

    def broken(out):
        out.mkdir(parents=True)
        (out / "half").write_text("written before the failure")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        built_once(tmp_path_factory, "unit-test-broken", broken)
    again = built_once(tmp_path_factory, "unit-test-broken", build)
    assert not (again / "half").exists() and (again / "data").read_text() == "2"
