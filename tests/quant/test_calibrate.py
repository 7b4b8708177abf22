"""The calibrators' bookkeeping on a small Llama: which Linears share a recorded input, and GPTQ rounding Linears
that share one as one matrix."""

import pytest
import torch

from hfaccel.quant import quantize_rtn
from hfaccel.quant.calibrate import (
    _apply_gptq,
    _first_layer_inputs,
    _quantizable,
    _record,
    _Recorder,
    decoder_layers,
    gptq_quantize,
)
from tests.helpers import quant_llama


def _first_layer_records(model, **keep):
    layers = decoder_layers(model)
    hidden, kwargs = _first_layer_inputs(model, layers, torch.randint(0, 100, (2, 9)))
    linears = _quantizable(layers[0], 64, ("lm_head",))
    return layers[0], linears, _record(layers[0], linears, hidden, kwargs, **keep)


def test_linears_fed_the_same_input_share_one_recorder():
    _, _, records = _first_layer_records(quant_llama(), keep_samples=True, keep_hessian=True)
    attention, mlp = "self_attn.", "mlp."
    assert records[attention + "q_proj"] is records[attention + "k_proj"] is records[attention + "v_proj"]
    assert records[mlp + "gate_proj"] is records[mlp + "up_proj"]
    distinct = {id(r) for r in records.values()}
    assert len(distinct) == 4  # q/k/v, o, gate/up, down
    for recorder in records.values():
        x = torch.cat(recorder.samples)  # [2 * 9, K]
        assert x.shape[0] == 18 and recorder.count == 18
        torch.testing.assert_close(recorder.hessian, 2 * x.t() @ x / 18, rtol=1e-5, atol=1e-5)


def test_a_linear_called_twice_records_both_inputs():
    linear = torch.nn.Linear(64, 8)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.other = linear, torch.nn.Linear(64, 8)

        def forward(self, x):
            return self.proj(x) + self.proj(x * 2) + self.other(x)

    layer, x = Twice(), torch.randn(5, 64)
    linears = {"proj": layer.proj, "other": layer.other}
    records = _record(layer, linears, x, {}, keep_samples=False, keep_hessian=True)
    both = torch.cat([x, 2 * x])  # [10, 64]
    assert records["proj"].count == 10 and records["other"].count == 5
    torch.testing.assert_close(records["proj"].hessian, 2 * both.t() @ both / 10, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(records["other"].hessian, 2 * x.t() @ x / 5, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_rounds_linears_sharing_an_input_as_each_alone(act_order):
    torch.manual_seed(0)
    k, group = 192, 64  # two blocks of 128 columns: the second sees the first's lazy update
    x = torch.randn(300, k) * torch.rand(k) * 3
    hessian = 2 * x.t() @ x / 300
    weights = [torch.randn(40, k) * 0.02, torch.randn(24, k) * 0.02]
    together = gptq_quantize(weights, hessian, group, act_order=act_order)
    for weight, joint in zip(weights, together):
        (alone,) = gptq_quantize([weight], hessian, group, act_order=act_order)
        assert torch.equal(joint.values(), alone.values())
        assert torch.equal(joint.scales, alone.scales) and torch.equal(joint.zeros, alone.zeros)
        assert (joint.g_idx is None) == (not act_order)
        gptq, rtn = (q.dequantize() - weight for q in (joint, quantize_rtn(weight, group)))  # [N, K] each
        assert ((gptq @ hessian) * gptq).sum() < ((rtn @ hessian) * rtn).sum()  # the output error it minimises


def test_gptq_keeps_a_linear_that_saw_no_tokens_and_warns():
    model = quant_llama()
    layer, linears, records = _first_layer_records(model, keep_samples=False, keep_hessian=True)
    records = {**records, "mlp.down_proj": _Recorder()}
    with pytest.warns(UserWarning, match="mlp.down_proj saw no calibration tokens"):
        _apply_gptq(layer, linears, records, 64)
    assert type(layer.mlp.down_proj) is torch.nn.Linear
    assert type(layer.self_attn.q_proj) is not torch.nn.Linear
