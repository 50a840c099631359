"""Federated training quality: fedweave against Flower, centralized training, and DiLoCo.

Run ``python -m bench.training [--quick] [--json PATH]``. Rows:

* ``fed_acc_vs_flower_fedavg[task=T]`` — held-out accuracy after R rounds with 4
  non-IID orgs (Dirichlet label skew, ``alpha = 0.5``), fedweave FedAvg ÷ Flower FedAvg.
  fedweave's round goes through the real secure aggregation: each org packs
  ``[w * delta, w]`` (:func:`org_node.strategies.pack_weighted`), quantizes it with
  :class:`secure_agg.codec.FixedPointCodec` into the 32-bit ring, the masked-sum
  protocol (:func:`secure_agg.protocol.run_round`: X25519 pairwise masks, Shamir-shared
  seeds) yields the ring sum, and every node decodes it and runs
  :class:`org_node.strategies.FedAvg`. Flower's branch runs the same clients (same
  partitions, seeds, local steps, batches) and aggregates with Flower's own
  ``FedAvg.aggregate_fit``. The clients are plain Flower ``NumPyClient`` objects, which
  fedweave drives through :class:`org_node.trainers.flower.FlowerTrainer`. Target >= 0.99.
* ``fed_acc_vs_centralized[task=T]`` — the same fedweave accuracy ÷ one model trained
  on the union of the orgs' data for as many SGD steps as one org made (report).
* ``diloco_sync_reduction[task=T]`` — communication rounds that per-step
  synchronization (data-parallel AdamW over the orgs, one exchange per step) needs for
  its final held-out loss, ÷ the rounds DiLoCo (H inner AdamW steps, outer Nesterov)
  needs to reach that loss (report; Douillard et al. 2023). With the label skew of
  ``alpha = 0.5`` a large H drifts: on digits, H=5 reaches the 300-step loss in about
  70 rounds, H=10 not within 150; the row's value is 0 when DiLoCo never gets there.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvg as FlowerFedAvg

from bench.common import Report, run_main
from org_node.strategies import (
    DiLoCo,
    DiLoCoConfig,
    FedAvg,
    build_inner_optimizer,
    pack_weighted,
    params_shapes,
    unpack_weighted,
)
from org_node.tasks import Task, load_state, load_task, model_state
from org_node.tasks.partition import dirichlet_partition, iid_partition
from org_node.trainers.flower import FlowerTrainer
from secure_agg.codec import FixedPointCodec
from secure_agg.keys import RoundContext
from secure_agg.protocol import ProtocolConfig, run_round

__all__ = ["FedSetup", "TaskClient", "main"]

N_ORGS = 4
ALPHA = 0.5
WEIGHT_SCALE = 1024.0
"""Public constant dividing example counts, so the weight coordinate stays in the codec's range."""


@dataclass(frozen=True)
class FedSetup:
    """One federated comparison.

    task: bundled task name. rounds: communication rounds. local_steps: SGD steps per
    org per round. batch_size, lr: of the local SGD. seed: partitions, init, batches.
    """

    task: str
    rounds: int
    local_steps: int
    batch_size: int = 32
    lr: float = 0.05
    seed: int = 0


def _to_params(state: dict[str, np.ndarray], keys: Sequence[str]) -> list[np.ndarray]:
    return [state[k] for k in keys]


def _to_state(params: Sequence[np.ndarray], keys: Sequence[str]) -> dict[str, np.ndarray]:
    return {k: np.asarray(p, dtype=np.float32) for k, p in zip(keys, params, strict=True)}


class TaskClient(NumPyClient):
    """A Flower client for one org: local SGD on its partition of a bundled task.

    Batches are drawn from a generator seeded by ``(seed, org, round)``, so the same
    client called with the same global model and round returns the same model.
    """

    def __init__(self, task: Task, indices: np.ndarray, org: int, setup: FedSetup) -> None:
        self.task, self.org, self.setup = task, org, setup
        data = task.build_data()
        idx = torch.as_tensor(indices, dtype=torch.long)
        self.x, self.y = data.inputs[idx], data.targets[idx]
        self.model = task.build_model(setup.seed)
        self.keys = list(model_state(self.model))

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return _to_params(model_state(self.model), self.keys)

    def fit(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        load_state(self.model, _to_state(parameters, self.keys))
        opt = torch.optim.SGD(self.model.parameters(), lr=self.setup.lr)
        gen = torch.Generator().manual_seed(
            (self.setup.seed * 1_000_003 + self.org * 10_007 + int(config["round"])) & 0x7FFFFFFF
        )
        self.model.train()
        loss = torch.zeros(())
        for _ in range(self.setup.local_steps):
            batch = torch.randint(0, len(self.y), (self.setup.batch_size,), generator=gen)
            opt.zero_grad()
            loss = self.task.loss(self.model(self.x[batch]), self.y[batch])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        return self.get_parameters({}), len(self.y), {"loss": float(loss.detach())}

    def evaluate(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[float, int, dict[str, Any]]:
        load_state(self.model, _to_state(parameters, self.keys))
        self.model.eval()
        with torch.no_grad():
            out = self.model(self.x)
            loss = float(self.task.loss(out, self.y))
        return loss, len(self.y), self.task.metrics(out, self.y)


def _held_out(task: Task, state: dict[str, np.ndarray]) -> dict[str, float]:
    model = task.build_model(0)
    load_state(model, state)
    data = task.build_data()
    model.eval()
    with torch.no_grad():
        out = model(data.eval_inputs)
        result = {"loss": float(task.loss(out, data.eval_targets))}
        result.update(task.metrics(out, data.eval_targets))
    return result


def _partitions(task: Task, seed: int) -> list[np.ndarray]:
    data = task.build_data()
    if data.labels is None:
        return iid_partition(len(data), N_ORGS, seed=seed)
    return dirichlet_partition(data.labels, N_ORGS, ALPHA, seed=seed, min_size=20)


def _secure_sum(
    vectors: list[np.ndarray], codec: FixedPointCodec, rnd: int, seed: int
) -> np.ndarray:
    """The float sum of the orgs' vectors, through quantization and the masked-sum protocol."""
    orgs = tuple(f"org{i}" for i in range(len(vectors)))
    encoded = {
        org: codec.encode(vec, np.random.default_rng([seed, rnd, i]))
        for i, (org, vec) in enumerate(zip(orgs, vectors, strict=True))
    }
    config = ProtocolConfig(
        ctx=RoundContext(federation="bench", run="fedavg", round=rnd),
        participants=orgs,
        threshold=len(orgs) // 2 + 1,
        vector_length=vectors[0].size,
        bits=codec.bits,
    )
    return codec.decode(run_round(config, encoded, seed=seed + rnd))


def run_fedweave_vs_flower(setup: FedSetup) -> dict[str, float]:
    """Held-out accuracy of fedweave FedAvg (secure sum) and Flower FedAvg, same clients."""
    task = load_task(setup.task)
    parts = _partitions(task, setup.seed)
    ours_clients = [TaskClient(task, p, i, setup) for i, p in enumerate(parts)]
    flower_clients = [TaskClient(task, p, i, setup) for i, p in enumerate(parts)]
    trainers = [FlowerTrainer(c) for c in ours_clients]
    keys = ours_clients[0].keys
    init = ours_clients[0].get_parameters({})
    codec = FixedPointCodec(bits=32, clip=8.0, max_summands=N_ORGS)
    strategy = FedAvg()
    flower = FlowerFedAvg(fit_metrics_aggregation_fn=lambda metrics: {})

    ours = [p.copy() for p in init]
    theirs = [p.copy() for p in init]
    for rnd in range(1, setup.rounds + 1):
        cfg = {"round": rnd}
        outs = [t.fit(ours, cfg) for t in trainers]
        vectors = [pack_weighted(o.update, o.num_examples / WEIGHT_SCALE) for o in outs]
        summed, weight = unpack_weighted(
            _secure_sum(vectors, codec, rnd, setup.seed), params_shapes(ours)
        )
        ours = strategy.step(ours, summed, weight)

        results = []
        for c in flower_clients:
            local, n, metrics = c.fit(theirs, cfg)
            results.append(
                (None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(local), n, metrics))
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            aggregated, _ = flower.aggregate_fit(rnd, results, [])  # type: ignore[arg-type]
        assert aggregated is not None
        theirs = parameters_to_ndarrays(aggregated)

    # centralized: one model on the union, as many steps as one org made
    union = np.sort(np.concatenate(parts))
    central_setup = dataclasses.replace(setup, local_steps=setup.rounds * setup.local_steps)
    central = TaskClient(task, union, 0, central_setup)
    central_params, _, _ = central.fit(init, {"round": 0})
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs, strict=True))
    return {
        "param_gap": gap,
        "fedweave": _held_out(task, _to_state(ours, keys))["accuracy"],
        "flower": _held_out(task, _to_state(theirs, keys))["accuracy"],
        "centralized": _held_out(task, _to_state(central_params, keys))["accuracy"],
    }


# --------------------------------------------------------------------------- DiLoCo


@dataclass(frozen=True)
class DiLoCoSetup:
    """Per-step synchronization for ``sync_steps`` steps against DiLoCo with ``inner_steps``
    per round for at most ``max_rounds`` rounds."""

    task: str
    sync_steps: int
    inner_steps: int
    max_rounds: int
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0


def _batches(n: int, size: int, seed: int, org: int) -> Callable[[], torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + org)
    return lambda: torch.randint(0, n, (size,), generator=gen)


def run_diloco(setup: DiLoCoSetup) -> dict[str, float]:
    """Rounds each approach needs; see the module docstring."""
    task = load_task(setup.task)
    data = task.build_data()
    parts = _partitions(task, setup.seed)
    shards = [(data.inputs[torch.as_tensor(p)], data.targets[torch.as_tensor(p)]) for p in parts]
    sizes = np.array([len(p) for p in parts], dtype=np.float64)
    weights = sizes / sizes.sum()

    # per-step synchronization: every step, average the orgs' gradients, one AdamW step
    torch.manual_seed(setup.seed)
    model = task.build_model(setup.seed)
    keys = list(model_state(model))
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
    draws = [_batches(len(y), setup.batch_size, setup.seed, i) for i, (_, y) in enumerate(shards)]
    for _ in range(setup.sync_steps):
        grads: list[torch.Tensor] | None = None
        for w, (x, y), draw in zip(weights, shards, draws, strict=True):
            b = draw()
            model.zero_grad()
            task.loss(model(x[b]), y[b]).backward()  # type: ignore[no-untyped-call]
            g = [
                float(w) * p.grad.detach().clone() for p in model.parameters() if p.grad is not None
            ]
            grads = g if grads is None else [a + c for a, c in zip(grads, g, strict=True)]
        assert grads is not None
        for p, avg in zip(model.parameters(), grads, strict=True):
            p.grad = avg
        opt.step()
    target = _held_out(task, model_state(model))["loss"]

    # DiLoCo: H inner AdamW steps per org (state kept per org), outer Nesterov
    cfg = DiLoCoConfig(
        outer_lr=0.7,
        outer_momentum=0.9,
        inner_steps=setup.inner_steps,
        inner_lr=setup.lr,
        inner_weight_decay=0.0,
    )
    strategy = DiLoCo(cfg)
    workers = [task.build_model(setup.seed) for _ in shards]
    inner = [build_inner_optimizer(m.parameters(), cfg) for m in workers]
    draws = [_batches(len(y), setup.batch_size, setup.seed, i) for i, (_, y) in enumerate(shards)]
    global_params = _to_params(model_state(task.build_model(setup.seed)), keys)
    needed = float("nan")
    loss = float("inf")
    for rnd in range(1, setup.max_rounds + 1):
        total: np.ndarray | None = None
        for w, m, o, (x, y), draw in zip(sizes, workers, inner, shards, draws, strict=True):
            load_state(m, _to_state(global_params, keys))
            for _ in range(setup.inner_steps):
                b = draw()
                o.zero_grad()
                task.loss(m(x[b]), y[b]).backward()  # type: ignore[no-untyped-call]
                o.step()
            local = _to_params(model_state(m), keys)
            delta = [
                lp.astype(np.float64) - gp for lp, gp in zip(local, global_params, strict=True)
            ]
            vec = pack_weighted(delta, float(w) / WEIGHT_SCALE)
            total = vec if total is None else total + vec
        assert total is not None
        summed, weight = unpack_weighted(total, params_shapes(global_params))
        global_params = strategy.step(global_params, summed, weight)
        loss = _held_out(task, _to_state(global_params, keys))["loss"]
        if loss <= target:
            needed = float(rnd)
            break
    return {
        "sync_rounds": float(setup.sync_steps),
        "diloco_rounds": needed,
        "target_loss": target,
        "diloco_loss": loss,
    }


# --------------------------------------------------------------------------- main


def body(report: Report) -> None:
    quick = report.quick
    for task, rounds, steps in (
        (("breast_cancer", 10, 10), ("digits", 10, 10))
        if quick
        else (
            ("breast_cancer", 30, 20),
            ("digits", 40, 20),
        )
    ):
        setup = FedSetup(
            task=task, rounds=rounds, local_steps=steps, lr=0.05 if task == "breast_cancer" else 0.1
        )
        acc = run_fedweave_vs_flower(setup)
        note = f"{N_ORGS} orgs, Dirichlet alpha={ALPHA}, R={rounds}, {steps} local SGD steps"
        report.add(
            f"fed_acc_vs_flower_fedavg[task={task}]",
            acc["fedweave"],
            "accuracy",
            acc["flower"],
            target=">= 0.99",
            note=note
            + "; fedweave through 32-bit codec + masked sum; "
            + f"max |param difference| {acc['param_gap']:.2e}",
        )
        report.add(
            f"fed_acc_vs_centralized[task={task}]",
            acc["fedweave"],
            "accuracy",
            acc["centralized"],
            note=note + f"; centralized: {rounds * steps} steps on the union",
        )
    dsetup = (
        DiLoCoSetup(task="digits", sync_steps=120, inner_steps=10, max_rounds=40)
        if quick
        else DiLoCoSetup(task="digits", sync_steps=300, inner_steps=5, max_rounds=150)
    )
    res = run_diloco(dsetup)
    reached = not np.isnan(res["diloco_rounds"])
    report.add(
        f"diloco_sync_reduction[task={dsetup.task}]",
        res["sync_rounds"] / res["diloco_rounds"] if reached else 0.0,
        "x",
        note=(
            f"per-step sync: {dsetup.sync_steps} exchanges to held-out loss {res['target_loss']:.4f}; "
            + (
                f"DiLoCo (H={dsetup.inner_steps}) reached it in {int(res['diloco_rounds'])} rounds"
                if reached
                else f"DiLoCo did not reach it in {dsetup.max_rounds} rounds (loss {res['diloco_loss']:.4f})"
            )
        ),
    )


def main(argv: Sequence[str] | None = None) -> Report:
    torch.set_num_threads(1)
    return run_main("training", body, argv, description=__doc__ or "")


if __name__ == "__main__":
    main(sys.argv[1:])
