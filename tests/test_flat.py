"""Flat parameters: torch parameters and gradients alias two flat buffers; the numpy SGD
optimizer follows torch.optim.SGD."""

from __future__ import annotations

import numpy as np
import pytest

from algorithms.flat import flatten
from algorithms.optim import SGD
from collectives import ArgumentError

torch = pytest.importorskip("torch")


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def concat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def aliases(tensor, flat) -> bool:
    start = flat.data_ptr()
    end = start + flat.numel() * flat.element_size()
    return start <= tensor.data_ptr() < end


def test_parameters_and_gradients_alias_the_flat_buffers() -> None:
    model = small_model()
    before = concat(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = flatten(model, opt)
    assert flat.size == sum(p.numel() for p in model.parameters()) == 26
    assert torch.equal(flat.params, before)  # values kept, in parameters() order
    assert all(aliases(p, flat.params) and aliases(p.grad, flat.grads) for p in model.parameters())
    flat.param_data[0] = 42.0  # the numpy view, as the collectives see it
    assert next(model.parameters()).detach().reshape(-1)[0].item() == 42.0
    model(torch.ones(5, 3, dtype=torch.float64)).sum().backward()
    assert torch.equal(flat.grads, concat(p.grad for p in model.parameters()))
    assert np.array_equal(flat.grad_data, flat.grads.numpy())


def test_momentum_step_matches_an_unflattened_model() -> None:
    model, ref = small_model(), small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    flat = flatten(model, opt)
    x = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(5, 3)
    for _ in range(4):
        flat.zero_grad()
        ref_opt.zero_grad()
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        opt.step()
        ref_opt.step()
    assert torch.allclose(flat.params, concat(ref.parameters()), rtol=0, atol=1e-14)
    assert all(aliases(p, flat.params) for p in model.parameters())


def test_grads_set_to_none_are_collected_back() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = flatten(model, opt)
    opt.zero_grad()  # set_to_none=True: the aliasing is gone
    model[0](torch.ones(2, 3, dtype=torch.float64)).sum().backward()  # model[2] gets no gradient
    expected = torch.cat([model[0].weight.grad.reshape(-1), model[0].bias.grad.reshape(-1), torch.zeros(10)])
    flat.collect_grads()
    assert torch.equal(flat.grads, expected.double())
    assert all(aliases(p.grad, flat.grads) for p in model.parameters())


def test_numpy_model_is_its_own_flat_buffer() -> None:
    x = np.arange(6.0).reshape(2, 3)
    opt = SGD(x, lr=0.5)
    flat = flatten(x, opt)
    assert np.shares_memory(flat.params, x) and np.shares_memory(flat.grads, opt.grad)
    opt.grad[:] = 1.0
    opt.step()
    assert np.array_equal(x, np.arange(6.0).reshape(2, 3) - 0.5)


@pytest.mark.parametrize(
    "momentum,dampening,nesterov,weight_decay",
    [
        (0.0, 0.0, False, 0.0),
        (0.9, 0.0, False, 0.0),
        (0.9, 0.1, False, 0.01),
        (0.8, 0.0, True, 0.0),
        (0.8, 0.0, True, 0.05),
    ],
)
def test_numpy_sgd_follows_torch_sgd(momentum: float, dampening: float, nesterov: bool, weight_decay: float) -> None:
    rng = np.random.default_rng(1)
    start = rng.standard_normal(7)
    x = start.copy()
    opt = SGD(x, lr=0.1, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay)
    p = torch.nn.Parameter(torch.tensor(start))
    ref = torch.optim.SGD(
        [p], lr=0.1, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay
    )
    for step in range(5):
        grad = rng.standard_normal(7)
        opt.grad[:] = grad
        p.grad = torch.tensor(grad)
        if step == 3:  # a schedule changes the learning rate between steps
            opt.lr = ref.param_groups[0]["lr"] = 0.03
        opt.step()
        ref.step()
    assert np.allclose(x, p.detach().numpy(), rtol=0, atol=1e-14)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (torch.nn.Linear(2, 2), None), "optimizer must hold exactly"),
        (lambda: (np.zeros(3), None), "algorithms.optim.SGD"),
        (lambda: (np.zeros(3), SGD(np.zeros(3), lr=0.1)), "same array"),
        (lambda: ([1.0, 2.0], None), "torch.nn.Module or a numpy array"),
    ],
)
def test_flatten_rejects(make, match: str) -> None:
    model, opt = make()
    if opt is None and isinstance(model, torch.nn.Module):
        opt = torch.optim.SGD(list(model.parameters())[:1], lr=0.1)
    with pytest.raises(ArgumentError, match=match):
        flatten(model, opt)


def test_flatten_rejects_mixed_dtypes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(ArgumentError, match="one dtype"):
        flatten(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_sgd_rejects_bad_hyper_parameters() -> None:
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(np.zeros(2), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match=">= 0"):
        SGD(np.zeros(2), lr=-1.0)
    with pytest.raises(TypeError, match="floating-point"):
        SGD(np.zeros(2, np.int64), lr=0.1)


def test_float_buffers_join_the_state_after_the_parameters() -> None:
    """BatchNorm's running statistics are re-pointed into the flat state, after the
    parameters; its int64 counter stays local; training mode updates them in place."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    bn = model[1]
    mean0, var0 = bn.running_mean.clone(), bn.running_var.clone()
    flat = flatten(model, torch.optim.SGD(model.parameters(), lr=0.1))
    n = sum(p.numel() for p in model.parameters())
    assert flat.has_buffers and flat.state.numel() == n + 8 and flat.params.data_ptr() == flat.state.data_ptr()
    assert torch.equal(flat.state[n:], torch.cat([mean0, var0]))
    assert dict(model.named_buffers())["1.running_mean"] is bn.running_mean and aliases(bn.running_var, flat.state)
    assert not aliases(bn.num_batches_tracked, flat.state)
    model(torch.randn(5, 3, dtype=torch.float64))  # training mode: the statistics move, inside the state
    assert not torch.equal(flat.state[n : n + 4], mean0) and torch.equal(flat.state[n : n + 4], bn.running_mean)
    assert np.array_equal(flat.state_data, flat.state.numpy())


def test_without_buffers_the_state_is_the_parameters() -> None:
    model = small_model()
    flat = flatten(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not flat.has_buffers and flat.state is flat.params and flat.state_data is flat.param_data
    x = np.zeros(4)
    numpy_flat = flatten(x, SGD(x, lr=0.1))
    assert numpy_flat.state is numpy_flat.params and not numpy_flat.has_buffers
