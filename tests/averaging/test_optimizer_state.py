"""Optimizer state made to exist up front, exactly as a fresh optimizer's first step would have it."""

from __future__ import annotations

import copy

import pytest
import torch

from averaging.optimizer_state import (
    FUSED_ON_CPU,
    fused_where_supported,
    materialize_state,
    sanitize_state,
    state_tensors,
)


def model_pair():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    return model, copy.deepcopy(model)


def train(model, optimizer, steps=4):
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 6)).pow(2).sum().backward()
        optimizer.step()


@pytest.mark.parametrize(
    ("make", "options"),
    [
        (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.01}),
        (torch.optim.Adam, {"lr": 0.05, "amsgrad": True}),
        (torch.optim.AdamW, {"lr": 0.05}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
        (torch.optim.Adamax, {}),
        (torch.optim.Adadelta, {}),
        (torch.optim.RAdam, {}),
        (torch.optim.Adagrad, {}),  # (builds its state at construction)
    ],
)
def test_materialized_state_trains_bit_for_bit_like_a_fresh_optimizer(make, options):
    fresh_model, model = model_pair()
    fresh, optimizer = make(fresh_model.parameters(), **options), make(model.parameters(), **options)
    before = [p.detach().clone() for p in model.parameters()]
    assert materialize_state(optimizer)
    assert all(torch.equal(p, old) for p, old in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert state_tensors(optimizer), "the state exists before the first step"
    assert optimizer.param_groups[0]["lr"] == options.get("lr", fresh.param_groups[0]["lr"])
    train(fresh_model, fresh)
    train(model, optimizer)
    for ours, theirs in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert [t.shape for t in state_tensors(optimizer)] == [t.shape for t in state_tensors(fresh)]


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.NAdam(params),  # its fresh state is not all zeros
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5),
    ],
)
def test_optimizers_whose_fresh_state_is_not_zero_are_left_alone(make):
    model, _ = model_pair()
    optimizer = make(model.parameters())
    assert not materialize_state(optimizer)
    assert state_tensors(optimizer) == [] and not optimizer.state


def test_state_tensors_are_the_live_state_in_a_fixed_order():
    model_a, model_b = model_pair()
    a, b = torch.optim.Adam(model_a.parameters()), torch.optim.Adam(model_b.parameters())
    materialize_state(a)
    held = state_tensors(a)
    train(model_a, a, steps=2)
    train(model_b, b, steps=2)  # stepped rather than materialized: the same list, value for value
    listed = state_tensors(b)
    assert len(held) == len(listed) == 3 * len(list(model_a.parameters()))
    for ours, theirs in zip(held, listed, strict=True):  # (exp_avg and exp_avg_sq differ in value)
        assert torch.equal(ours, theirs)


def test_existing_state_is_kept_and_only_missing_state_is_created():
    model, _ = model_pair()
    optimizer = torch.optim.Adam(model.parameters())
    first, *others = model.parameters()
    first.grad = torch.ones_like(first)
    optimizer.step()  # only the first parameter had a gradient (e.g. a resumed checkpoint)
    saved = {key: value.clone() for key, value in optimizer.state[first].items()}
    assert materialize_state(optimizer)
    assert all(torch.equal(optimizer.state[first][key], value) for key, value in saved.items())
    for p in others:
        assert all(not value.any() for value in optimizer.state[p].values())
    assert len(state_tensors(optimizer)) == 3 * (1 + len(others))


def test_sanitize_undoes_impossible_state_that_would_poison_the_next_step():
    model, _ = model_pair()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    materialize_state(optimizer)
    for state in optimizer.state.values():  # finite, so the all-reduce lets it through
        state["exp_avg_sq"].fill_(-1e-3)
        state["step"].fill_(-1.0)
    sanitize_state(optimizer)
    train(model, optimizer, steps=1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_sanitize_keeps_centered_rmsprop_variance_non_negative():
    model, _ = model_pair()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, centered=True)
    materialize_state(optimizer)
    for state in optimizer.state.values():  # mean of squares below the square of the mean
        state["square_avg"].fill_(0.0)
        state["grad_avg"].fill_(1.0)
    sanitize_state(optimizer)
    train(model, optimizer, steps=1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.skipif(not FUSED_ON_CPU, reason="torch before 2.4 has no fused Adam on a CPU")
def test_adam_takes_the_fused_kernel_where_torch_has_one_and_steps_as_the_default_does():
    torch.manual_seed(0)
    start = torch.randn(64, 8)
    grads = [torch.randn(64, 8) for _ in range(5)]
    results = []
    for build in (fused_where_supported, lambda cls, params, **o: cls(params, **o)):
        param = torch.nn.Parameter(start.clone())
        optimizer = build(torch.optim.AdamW, [param], lr=1e-2, weight_decay=0.01)
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        results.append((optimizer.defaults.get("fused"), param.detach()))
    (fused, stepped), (default, expected) = results
    assert fused is True and not default
    assert torch.allclose(stepped, expected, atol=1e-6)


def test_parameters_without_a_fused_kernel_get_the_default_adam():
    complex_param = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    optimizer = fused_where_supported(torch.optim.Adam, [complex_param], lr=0.1)
    complex_param.grad = torch.ones(3, dtype=torch.complex64)
    optimizer.step()  # (the fused kernel refuses complex parameters only here)
    assert not optimizer.defaults.get("fused") and complex_param.abs().sum() > 0


@pytest.mark.skipif(not FUSED_ON_CPU, reason="torch before 2.4 has no fused Adam on a CPU")
def test_an_optimizer_keeps_its_kernel_across_a_checkpoint_saved_with_the_other():
    param = torch.nn.Parameter(torch.zeros(8))
    saved = torch.nn.Parameter(torch.zeros(8))
    plain = torch.optim.Adam([saved], lr=0.1)
    saved.grad = torch.ones(8)
    plain.step()
    fused = fused_where_supported(torch.optim.Adam, [param], lr=0.1)
    fused.load_state_dict(plain.state_dict())  # (saved before the kernel was taken)
    assert fused.param_groups[0]["fused"] is True
    param.grad = torch.ones(8)
    fused.step()  # the loaded step count where the fused kernel keeps it
    step = fused.state[param]["step"]
    assert step.item() == 2 and (step.device, step.dtype) == (param.device, torch.float32)
    fused_state = fused.state_dict()
    # parameters given as groups: no fused kernel chosen
    fallback = fused_where_supported(torch.optim.Adam, [{"params": [torch.nn.Parameter(torch.zeros(8))]}], lr=0.1)
    fallback.load_state_dict(fused_state)  # (where torch has no kernel, a fused step would fail)
    assert not fallback.param_groups[0]["fused"]
