"""Strategies against their reference formulas and against Flower's own strategies."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAdagrad as FlwrFedAdagrad
from flwr.server.strategy import FedAdam as FlwrFedAdam
from flwr.server.strategy import FedAvg as FlwrFedAvg
from flwr.server.strategy import FedAvgM as FlwrFedAvgM
from flwr.server.strategy import FedYogi as FlwrFedYogi
from hypothesis import given, settings
from hypothesis import strategies as st

from org_node.strategies import (
    STRATEGIES,
    DiLoCo,
    DiLoCoConfig,
    EmptyAggregateError,
    FedAdagrad,
    FedAdagradConfig,
    FedAdam,
    FedAdamConfig,
    FedAvg,
    FedAvgM,
    FedAvgMConfig,
    FedProx,
    FedProxConfig,
    FedYogi,
    FedYogiConfig,
    ShapeMismatchError,
    StateMismatchError,
    StrategyConfigError,
    build_inner_optimizer,
    make_strategy,
    pack_weighted,
    params_shapes,
    proximal_term,
    state_from_bytes,
    state_to_bytes,
    unpack_weighted,
)
from org_node.training.spec import LocalJobSpec

SHAPES = [(3, 4), (4,), (2, 2, 2)]


def _model(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.normal(size=s) for s in SHAPES]


def _clients(
    rng: np.random.Generator, global_params: list[np.ndarray], n: int = 4
) -> list[tuple[list[np.ndarray], int]]:
    """Local models (global + noise) with integer example counts, as Flower sees them."""
    out = []
    for _ in range(n):
        local = [p + rng.normal(scale=0.1, size=p.shape) for p in global_params]
        out.append((local, int(rng.integers(5, 200))))
    return out


def _secure_sum(
    global_params: list[np.ndarray], clients: list[tuple[list[np.ndarray], int]]
) -> tuple[list[np.ndarray], float]:
    """What the secure sum yields: the sum of the packed vectors, unpacked."""
    total = sum(
        pack_weighted([lp - gp for lp, gp in zip(local, global_params, strict=True)], w)
        for local, w in clients
    )
    assert isinstance(total, np.ndarray)
    return unpack_weighted(total, params_shapes(global_params))


class _Proxy:
    cid = "c"


def _flower_step(
    strategy: Any, server_round: int, clients: list[tuple[list[np.ndarray], int]]
) -> list[np.ndarray]:
    results = [
        (
            _Proxy(),
            FitRes(Status(Code.OK, ""), ndarrays_to_parameters(local), n, {}),
        )
        for local, n in clients
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params, _ = strategy.aggregate_fit(server_round, results, [])
    return parameters_to_ndarrays(params)


def _assert_close(a: list[np.ndarray], b: list[np.ndarray], rtol: float = 1e-9) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-12)


# --------------------------------------------------------------------------- packing


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=5),
    st.integers(0, 2**31 - 1),
)
def test_pack_unpack_sum_is_weighted_sum(weights: list[float], seed: int) -> None:
    rng = np.random.default_rng(seed)
    updates = [_model(rng) for _ in weights]
    total = sum(pack_weighted(u, w) for u, w in zip(updates, weights, strict=True))
    summed, total_w = unpack_weighted(np.asarray(total), SHAPES)
    assert total_w == pytest.approx(sum(weights))
    for i in range(len(SHAPES)):
        expected = sum(w * u[i] for u, w in zip(updates, weights, strict=True))
        np.testing.assert_allclose(summed[i], expected, rtol=1e-9, atol=1e-9)


def test_pack_layout_and_errors() -> None:
    vec = pack_weighted([np.array([1.0, 2.0]), np.array([[3.0]])], 2.0)
    assert vec.dtype == np.float64
    assert vec.tolist() == [2.0, 4.0, 6.0, 2.0]
    with pytest.raises(ShapeMismatchError, match="needs 4"):
        unpack_weighted(vec[:-1], [(2,), (1, 1)])
    with pytest.raises(StrategyConfigError, match="weight"):
        pack_weighted([np.zeros(2)], -1.0)
    with pytest.raises(StrategyConfigError, match="weight"):
        pack_weighted([np.zeros(2)], float("nan"))


# --------------------------------------------------------------------------- against Flower


def test_fedavg_matches_flower_fedavg() -> None:
    rng = np.random.default_rng(0)
    x = _model(rng)
    clients = _clients(rng, x)
    summed, w = _secure_sum(x, clients)
    ours = FedAvg().step(x, summed, w)
    theirs = _flower_step(FlwrFedAvg(), 1, clients)
    _assert_close(ours, theirs)


def test_fedprox_aggregates_as_fedavg_and_exports_mu() -> None:
    rng = np.random.default_rng(1)
    x = _model(rng)
    clients = _clients(rng, x)
    summed, w = _secure_sum(x, clients)
    strat = FedProx(FedProxConfig(mu=0.3))
    _assert_close(strat.step(x, summed, w), FedAvg().step(x, summed, w), rtol=0)
    assert strat.local_config() == {"prox_mu": 0.3}


@pytest.mark.parametrize(
    ("ours_factory", "flower_factory"),
    [
        (
            lambda: FedAdam(FedAdamConfig(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3)),
            lambda init: FlwrFedAdam(
                initial_parameters=init, eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3
            ),
        ),
        (
            lambda: FedYogi(FedYogiConfig(eta=0.02, beta_1=0.8, beta_2=0.95, tau=1e-3)),
            lambda init: FlwrFedYogi(
                initial_parameters=init, eta=0.02, beta_1=0.8, beta_2=0.95, tau=1e-3
            ),
        ),
        (
            lambda: FedAdagrad(FedAdagradConfig(eta=0.1, tau=1e-3)),
            lambda init: FlwrFedAdagrad(initial_parameters=init, eta=0.1, tau=1e-3),
        ),
        (
            lambda: FedAvgM(FedAvgMConfig(server_lr=0.8, momentum=0.7)),
            lambda init: FlwrFedAvgM(
                initial_parameters=init, server_learning_rate=0.8, server_momentum=0.7
            ),
        ),
    ],
    ids=["fedadam", "fedyogi", "fedadagrad", "fedavgm"],
)
def test_server_optimizers_match_flower_over_rounds(ours_factory: Any, flower_factory: Any) -> None:
    rng = np.random.default_rng(2)
    x = _model(rng)
    ours = ours_factory()
    flower = flower_factory(ndarrays_to_parameters(x))
    ours_x = x
    for t in range(1, 5):
        clients = _clients(rng, ours_x)
        summed, w = _secure_sum(ours_x, clients)
        ours_x = ours.step(ours_x, summed, w)
        # Flower's FedAdam scales eta by sqrt(1-b2^(r+1))/(1-b1^(r+1)); passing the
        # 0-based round makes that Kingma & Ba's correction at step t, which ours uses.
        server_round = t - 1 if isinstance(ours, FedAdam) else t
        flower_x = _flower_step(flower, server_round, clients)
        _assert_close(ours_x, flower_x, rtol=1e-8)
    assert ours.round == 4


# --------------------------------------------------------------------------- reference formulas


def test_fedadam_formula_by_hand() -> None:
    """Two rounds of Reddi et al. Algorithm 2 (FedAdam) written out on scalars."""
    cfg = FedAdamConfig(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3, bias_correction=False)
    strat = FedAdam(cfg)
    x = [np.array([1.0])]
    d1, d2 = 0.5, -0.2
    x1 = strat.step(x, [np.array([d1 * 3.0])], 3.0)
    m1, v1 = 0.1 * d1, 0.01 * d1**2
    assert x1[0][0] == pytest.approx(1.0 + 0.1 * m1 / (np.sqrt(v1) + 1e-3), rel=1e-12)
    x2 = strat.step(x1, [np.array([d2 * 2.0])], 2.0)
    m2, v2 = 0.9 * m1 + 0.1 * d2, 0.99 * v1 + 0.01 * d2**2
    assert x2[0][0] == pytest.approx(x1[0][0] + 0.1 * m2 / (np.sqrt(v2) + 1e-3), rel=1e-12)


def test_fedyogi_and_adagrad_second_moment_by_hand() -> None:
    d = 0.3
    yogi = FedYogi(FedYogiConfig(eta=1.0, beta_1=0.0, beta_2=0.9, tau=0.0 + 1e-9))
    yogi.step([np.array([0.0])], [np.array([d])], 1.0)
    assert yogi.v is not None
    # v0 = 0: v1 = 0 - (1-b2) d^2 sign(0 - d^2) = (1-b2) d^2
    assert yogi.v[0][0] == pytest.approx(0.1 * d * d)
    ada = FedAdagrad(FedAdagradConfig(eta=1.0, tau=1e-9))
    ada.step([np.array([0.0])], [np.array([d])], 1.0)
    ada.step([np.array([0.0])], [np.array([2 * d])], 1.0)
    assert ada.v is not None
    assert ada.v[0][0] == pytest.approx(d * d + 4 * d * d)


def test_diloco_outer_step_is_torch_nesterov_sgd_on_pseudo_gradient() -> None:
    """Douillard et al. Algorithm 1: outer Nesterov SGD on x - mean(local models)."""
    rng = np.random.default_rng(3)
    cfg = DiLoCoConfig(outer_lr=0.7, outer_momentum=0.9, inner_steps=10)
    strat = DiLoCo(cfg)
    x = _model(rng)
    ref = [torch.tensor(p.copy(), dtype=torch.float64, requires_grad=True) for p in x]
    opt = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        clients = _clients(rng, x)
        summed, w = _secure_sum(x, clients)
        mean_local = [
            sum(n * local[i] for local, n in clients) / sum(n for _, n in clients)
            for i in range(len(x))
        ]
        for p, xi, ml in zip(ref, x, mean_local, strict=True):
            p.grad = torch.from_numpy(xi - ml)
        opt.step()
        x = strat.step(x, summed, w)
        _assert_close(x, [p.detach().numpy() for p in ref], rtol=1e-10)
    assert strat.local_config()["local_steps"] == 10
    assert strat.local_config()["optimizer"] == "adamw"


def test_fedavgm_nesterov_matches_torch() -> None:
    x = [np.array([1.0, -2.0])]
    ref = torch.tensor(x[0].copy(), requires_grad=True)
    opt = torch.optim.SGD([ref], lr=0.5, momentum=0.8, nesterov=True)
    strat = FedAvgM(FedAvgMConfig(server_lr=0.5, momentum=0.8, nesterov=True))
    for delta in ([0.1, 0.2], [-0.3, 0.05], [0.2, 0.2]):
        ref.grad = -torch.tensor(delta, dtype=torch.float64)
        opt.step()
        x = strat.step(x, [np.array(delta) * 7.0], 7.0)
        np.testing.assert_allclose(x[0], ref.detach().numpy(), rtol=1e-12)


def test_step_packed_equals_unpack_then_step() -> None:
    rng = np.random.default_rng(5)
    x = _model(rng)
    clients = _clients(rng, x)
    vec = np.sum(
        [pack_weighted([lp - gp for lp, gp in zip(loc, x, strict=True)], w) for loc, w in clients],
        axis=0,
    )
    a, b = FedAdam(), FedAdam()
    summed, weight = unpack_weighted(vec, params_shapes(x))
    for pa, pb in zip(a.step_packed(x, vec), b.step(x, summed, weight), strict=True):
        assert pa.tobytes() == pb.tobytes()
    with pytest.raises(ShapeMismatchError):
        a.step_packed(x, vec[:-2])


def test_fedavg_server_lr_and_dtype_preserved() -> None:
    x = [np.array([1.0, 2.0], dtype=np.float32)]
    out = FedAvg(make_strategy("fedavg", {"server_lr": 0.5}).config).step(
        x, [np.array([2.0, 4.0])], 2.0
    )
    assert out[0].dtype == np.float32
    np.testing.assert_array_equal(out[0], np.array([1.5, 3.0], dtype=np.float32))
    assert x[0].tolist() == [1.0, 2.0]  # input not modified


# --------------------------------------------------------------------------- determinism and state


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_state_round_trip_gives_bit_identical_continuation(name: str) -> None:
    rng = np.random.default_rng(4)
    x = _model(rng)
    a = make_strategy(name)
    rounds = [_secure_sum(x, _clients(rng, x)) for _ in range(4)]
    xa = x
    for summed, w in rounds[:2]:
        xa = a.step(xa, summed, w)
    b = make_strategy(name)
    b.load_state_dict(state_from_bytes(state_to_bytes(a.state_dict())))
    assert b.round == 2
    xb = [p.copy() for p in xa]
    for summed, w in rounds[2:]:
        xa = a.step(xa, summed, w)
        xb = b.step(xb, summed, w)
    for pa, pb in zip(xa, xb, strict=True):
        assert pa.tobytes() == pb.tobytes()
    assert state_to_bytes(a.state_dict()) == state_to_bytes(b.state_dict())


def test_state_refuses_other_strategy_or_config() -> None:
    state = FedAdam().state_dict()
    with pytest.raises(StateMismatchError, match="fedadam"):
        FedYogi().load_state_dict(state)
    with pytest.raises(StateMismatchError, match="config"):
        FedAdam(FedAdamConfig(eta=0.5)).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="not a strategy state"):
        state_from_bytes(b"garbage")


# --------------------------------------------------------------------------- validation


def test_config_validation_and_unknown_keys() -> None:
    with pytest.raises(StrategyConfigError, match="unknown FedAdamConfig keys"):
        make_strategy("fedadam", {"eta": 0.1, "betta": 0.9})
    with pytest.raises(StrategyConfigError, match="unknown strategy"):
        make_strategy("fedsgd")
    with pytest.raises(StrategyConfigError, match="beta_1"):
        FedAdamConfig(beta_1=1.0)
    with pytest.raises(StrategyConfigError, match="inner_steps"):
        DiLoCoConfig(inner_steps=0)
    with pytest.raises(StrategyConfigError, match="mu"):
        FedProxConfig(mu=-1.0)
    with pytest.raises(StrategyConfigError, match="takes a FedAvgConfig"):
        FedAvg(FedAdamConfig())


def test_step_rejects_empty_round_and_bad_shapes() -> None:
    x = [np.zeros(3)]
    with pytest.raises(EmptyAggregateError):
        FedAvg().step(x, [np.zeros(3)], 0.0)
    with pytest.raises(ShapeMismatchError, match="tensor 0"):
        FedAvg().step(x, [np.zeros(4)], 1.0)
    with pytest.raises(ShapeMismatchError, match="1 parameter tensors but 2"):
        FedAvg().step(x, [np.zeros(3), np.zeros(1)], 1.0)


# --------------------------------------------------------------------------- local-job helpers


def test_proximal_term_value_and_gradient() -> None:
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    g = torch.tensor([0.0, 1.0])
    term = proximal_term([w], [g], mu=0.5)
    assert term.item() == pytest.approx(0.25 * (1.0 + 1.0))
    term.backward()  # type: ignore[no-untyped-call]
    assert w.grad is not None
    assert w.grad.tolist() == pytest.approx([0.5, 0.5])  # mu * (w - g)


def test_inner_optimizer_is_configured_adamw() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_inner_optimizer([p], DiLoCoConfig(inner_lr=1e-3, inner_weight_decay=0.05))
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.05
    assert tuple(group["betas"]) == (0.9, 0.999)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_local_config_keys_are_local_job_spec_fields(name: str) -> None:
    """What a strategy asks of the local job can be applied to its spec as is."""
    spec = LocalJobSpec(task="tabular")
    updated = dataclasses.replace(spec, **make_strategy(name).local_config())
    assert isinstance(updated, LocalJobSpec)
    if name == "fedprox":
        assert updated.prox_mu == FedProxConfig().mu
    if name == "diloco":
        assert updated.optimizer == "adamw"
        assert updated.local_steps == DiLoCoConfig().inner_steps
