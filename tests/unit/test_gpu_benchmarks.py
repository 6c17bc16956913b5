"""benchmarks/gpu/step_variants.py's candidates, on the CPU: what a lent GPU's few minutes
measure must compute what the step computes (the GPU sessions are rare; a broken variant
would spend one)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from transformer.gradhelper import Linear

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "step_variants.py"


@pytest.fixture(scope="module")
def variants():
    spec = importlib.util.spec_from_file_location("step_variants", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape", [(37, 12), (3, 5, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bias_product_variant_is_autograds_but_for_the_sums_order(variants, shape, dtype):
    torch.manual_seed(0)
    ours, plain = Linear(12, 7).to(dtype), nn.Linear(12, 7).to(dtype)
    plain.load_state_dict(ours.state_dict())
    x = torch.randn(*shape).to(dtype)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = variants.product_bias_forward(ours, xa), plain(xb)
    node = ya.grad_fn if len(shape) == 2 else ya.grad_fn.next_functions[0][0]  # past the view
    assert type(node).__name__ == "ProductBiasLinearBackward"
    assert torch.equal(ya, yb)
    g = torch.randn_like(yb)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(ours.weight.grad, plain.weight.grad)
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(ours.bias.grad, plain.bias.grad, rtol=tol, atol=tol)
    with torch.no_grad():  # inference: the plain layer
        assert variants.product_bias_forward(ours, x).grad_fn is None


@pytest.mark.parametrize(
    "args",
    [["--presets", "nope"], ["--tokens", "10"], ["--device", "tpu"], ["--variants", "head,x"],
     ["--rounds", "0"]],
)  # fmt: skip
def test_step_variants_refuses_bad_arguments_before_building_anything(
    variants, args, monkeypatch, capsys
):
    monkeypatch.setattr("sys.argv", ["step_variants.py", *args])
    monkeypatch.setattr(variants, "bias_sums", lambda *a: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        variants.main()
    assert e.value.code == 2 and "step_variants.py: error: " in capsys.readouterr().err


@pytest.mark.parametrize("norm_first", [False, True])
def test_the_fused_norm_variant_is_the_sub_layers_post_norm(variants, norm_first, monkeypatch):
    # What torch.compile gets is LayerNorm(x + Dropout(f)); here run eagerly (compiling takes
    # seconds), without dropout so that the two are comparable bit for bit.
    from transformer.model import _Residual

    monkeypatch.setattr(variants, "COMPILED_POST_NORM", variants.post_norm)
    torch.manual_seed(0)
    residual = _Residual(16, 0.0, norm_first).train()
    with torch.no_grad():
        residual.norm.weight.uniform_(0.5, 1.5)
        residual.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 5, 16, requires_grad=True)
    sub = nn.Linear(16, 16)
    got = variants.fused_norm_forward(residual, x, sub)
    assert torch.equal(got, variants.PLAIN_RESIDUAL(residual, x, sub))
    residual.eval()  # not training: the plain sub-layer, never the compiled function
    monkeypatch.setattr(variants, "COMPILED_POST_NORM", lambda *a: pytest.fail("compiled"))
    variants.fused_norm_forward(residual, x, sub)
