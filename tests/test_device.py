"""`--device`: the CPU as before, CUDA where there is one, a clear error where there is none; the GPU's blocked
products keep each row's result its own. (The runtime on a real GPU: benchmarks/cuda_check.py, README.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchspec.errors import BatchspecError
from batchspec.runtime import linear as linear_module
from batchspec.runtime.device import check_precision_on, resolve_device
from batchspec.weights.loading import load_model
from test_errors import assert_clear_error, run_cli

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without a CUDA GPU")


def test_device_names_resolve_or_name_the_problem():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    for bad in ("tpu", "cuda:x", "cpu:0", "cuda:"):
        with pytest.raises(BatchspecError, match="unknown device"):
            resolve_device(bad)


@no_gpu
def test_cuda_without_a_gpu_is_one_clear_error(capsys, default_model_dir):
    with pytest.raises(BatchspecError, match="sees no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(BatchspecError, match="sees no CUDA GPU"):
        load_model(default_model_dir, device="cuda")
    code, err = run_cli(capsys, "generate", "--prompt", "hi", "--device", "cuda", "--max-tokens", "2")
    assert_clear_error(code, err, "--device cuda", "no CUDA GPU")


def test_weight_only_kernels_stay_on_the_cpu(capsys):
    check_precision_on(torch.device("cpu"), "int8")
    check_precision_on(torch.device("cuda"), "bfloat16")
    for precision in ("int8", "int4"):
        with pytest.raises(BatchspecError, match=f"{precision} weights run on the CPU only"):
            check_precision_on(torch.device("cuda"), precision)
    code, err = run_cli(capsys, "bench", "--device", "cuda", "--num-prompts", "1", "--policies", "ar")
    assert_clear_error(code, err, "--baselines run on the CPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_products_in_fixed_blocks_keep_each_row_its_own(dtype):
    """The blocking and padding of `linear._cuda` (run here on the CPU, where F.linear stands in for cuBLAS): every
    row multiplied in a call of any size equals that row multiplied alone, and the product is F.linear's."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
    block = linear_module.CUDA_BLOCK_ROWS[dtype]
    x = torch.randn(2 * block + 5, 64, generator=gen).to(dtype)
    alone = torch.cat([linear_module._cuda(x[i:i + 1], weight, bias, True) for i in range(len(x))])
    for rows in (1, 2, block - 1, block, block + 1, 2 * block + 5):
        for start in {0, len(x) - rows}:
            assert torch.equal(linear_module._cuda(x[start:start + rows], weight, bias, True),
                               alone[start:start + rows]), (rows, start)
    torch.testing.assert_close(alone.float(), F.linear(x.float(), weight.float(), bias.float()),
                               atol=0.5 if dtype == torch.bfloat16 else 1e-4, rtol=0.05 if dtype == torch.bfloat16
                               else 1e-5)
    assert torch.equal(linear_module._cuda(x, weight, bias, False), F.linear(x, weight, bias))
