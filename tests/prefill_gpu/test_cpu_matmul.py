"""cpu_matmul.py: MKL's strict mode, asked before and after MKL's first call, and the row-floor check
on products that do and do not keep a row's bits (real torch and MKL, no doubles)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.prefill_gpu.cpu_matmul import invariant_floor, request_strict_mkl

ROOT = Path(__file__).resolve().parents[2]
needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")


@needs_mkl
def test_the_suite_runs_mkl_in_strict_mode_as_the_service_does():
    assert request_strict_mkl() == "strict"  # tests/conftest.py asked before any matmul


@needs_mkl
def test_strict_mode_asked_after_a_matmul_is_refused_and_said():
    code = ("import torch; torch.ones(4, 4) @ torch.ones(4, 4)\n"
            "from services.prefill_gpu.cpu_matmul import request_strict_mkl\n"
            "print(request_strict_mkl())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "too late"


def test_a_product_whose_rows_see_each_other_has_no_floor():
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    assert invariant_floor([(lambda x: x @ w + x.sum(0, keepdim=True) @ w, 64)], torch.float32) is None


def test_a_product_that_changes_its_arithmetic_below_four_rows_has_floor_four():
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))

    def product(x):  # rows below four summed in float64, like a BLAS switching kernels at small M
        return x @ w if len(x) >= 4 else (x.double() @ w.double()).float()

    assert invariant_floor([(product, 64)], torch.float32) == 4
    exact = lambda x: (x.double() @ w.double()).float()  # noqa: E731 - each row alone, any row count
    assert invariant_floor([(exact, 64)], torch.float32) == 1


def test_the_answer_is_kept_per_key_and_computed_once():
    calls = []
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))

    def product(x):
        calls.append(len(x))
        return (x.double() @ w.double()).float()

    key = ("test", object())
    assert invariant_floor([(product, 16)], torch.float32, key) == 1
    n = len(calls)
    assert invariant_floor([(product, 16)], torch.float32, key) == 1 and len(calls) == n
