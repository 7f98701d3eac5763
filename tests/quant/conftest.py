"""Fixtures shared by the quantized-weight engine tests."""

from __future__ import annotations

import pytest

from perfxlm.ops import cpu_plan


@pytest.fixture
def interleave(monkeypatch):
    """Set PERFXLM_ROW_INTERLEAVE (the CPU plan's row groups) for the engines made after it (the plan is
    read again)."""

    def set_to(value: int) -> None:
        monkeypatch.setenv("PERFXLM_ROW_INTERLEAVE", str(value))
        cpu_plan.reset()

    yield set_to
    monkeypatch.delenv("PERFXLM_ROW_INTERLEAVE", raising=False)
    cpu_plan.reset()
