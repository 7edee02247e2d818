"""Compiled optimizer steps, `torch.compile(opt.step)`: SGD, Adam and AdamW in their for-loop and
foreach forms and under an LR scheduler. Every op compiles (dynamo turns `addcmul_` and
`addcdiv_` with a value into `prims.fma`), and the parameters after three steps equal eager's.
(dynamo hands no graph of a `fused=True` step to a backend: it runs ATen's fused kernel.)"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import ferrocore_metrics, is_ferrocore

pytestmark = pytest.mark.skipif(not is_ferrocore(), reason="ferrocore's metrics")

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd momentum nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd for-loop": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-2),
    "adam for-loop": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adamw for-loop": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    "adamw tensor lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-2)),
    # foreach, the default for CUDA parameters: aten._foreach_* ops, decomposed per tensor
    "sgd foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2, foreach=True),
    "adam foreach amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-2, foreach=True),
    "adamw foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "rmsprop foreach": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9, centered=True, foreach=True),
    "adagrad foreach": lambda p: torch.optim.Adagrad(p, lr=1e-2, foreach=True),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("scheduled", [False, True], ids=["", "scheduled"])
def test_a_compiled_optimizer_step_compiles_every_op_and_matches_eager(name, scheduled, request):
    if scheduled and name in ("adamw", "adamw for-loop", "adamw foreach") and \
            os.environ.get("FERROCORE_TEST_DEVICE", "cpu") != "cpu":
        # the changing float lr becomes a 0-d CPU tensor input, and AdamW's decay factor is
        # computed from it on the CPU: CPU ops in a CUDA graph run as ATen calls (H200, torch 2.11)
        request.applymarker(pytest.mark.xfail(reason="CPU scalar ops in a CUDA graph are ATen calls", strict=True))
    torch._dynamo.reset()
    metrics = ferrocore_metrics()
    models = [_model(), _model()]
    opts = [OPTIMIZERS[name](m.parameters()) for m in models]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) if scheduled else None for o in opts]
    x = torch.randn(8, 16)
    for m in models:
        m(x).square().sum().backward()
    metrics.reset()
    steps = [opts[0].step, torch.compile(opts[1].step, backend="ferrocore")]
    for _ in range(3):
        for step, sched in zip(steps, scheds):
            step()
            if sched is not None:
                sched.step()
    total = metrics.total
    assert total["graphs"] >= 1 and total["graph_fallbacks"] == 0, total
    assert total["fallbacks"] == 0, f"ATen fallbacks: {total['fallback_ops']}"
    for want, got in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("foreach", [False, True])
def test_a_compiled_clip_and_step_compiles_every_op_and_matches_eager(foreach):
    # gradient clipping's foreach form: one norm per gradient (aten._foreach_norm), then a scale
    torch._dynamo.reset()
    metrics = ferrocore_metrics()
    models = [_model(), _model()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=foreach) for m in models]
    x = torch.randn(8, 16)
    for m in models:
        (100 * m(x)).square().sum().backward()
    metrics.reset()

    def clip_and_step(model, opt):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
        opt.step()

    clip_and_step(models[0], opts[0])
    torch.compile(clip_and_step, backend="ferrocore")(models[1], opts[1])
    total = metrics.total
    assert total["graphs"] >= 1 and total["fallbacks"] == 0, total.get("fallback_ops")
    for want, got in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
