"""What the local job takes from the strategy: FedProx's proximal term
(:func:`proximal_term`) and DiLoCo's inner optimizer (:func:`build_inner_optimizer`).
torch is imported on use only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from org_node.strategies.errors import ShapeMismatchError

if TYPE_CHECKING:
    import torch

    from org_node.strategies.configs import DiLoCoConfig

__all__ = ["build_inner_optimizer", "proximal_term"]


def proximal_term(
    model_params: Iterable[torch.Tensor],
    global_params: Iterable[torch.Tensor],
    mu: float,
) -> torch.Tensor:
    """FedProx's proximal term ``mu/2 * sum ||w - w_global||^2`` (Li et al. 2020, eq. 2).

    Add it to the local loss; ``global_params`` are detached from the graph.
    """
    import torch

    model_list = list(model_params)
    global_list = list(global_params)
    if len(model_list) != len(global_list):
        raise ShapeMismatchError(
            f"{len(model_list)} model tensors but {len(global_list)} global tensors"
        )
    if not model_list:
        return torch.zeros(())
    total = torch.zeros((), dtype=model_list[0].dtype, device=model_list[0].device)
    for w, g in zip(model_list, global_list, strict=True):
        total = total + torch.sum((w - g.detach().to(w.dtype)) ** 2)
    return (mu / 2.0) * total


def build_inner_optimizer(
    parameters: Iterable[torch.nn.Parameter], config: DiLoCoConfig
) -> torch.optim.Optimizer:
    """DiLoCo's inner optimizer: AdamW with the configured lr, betas and weight decay."""
    import torch

    return torch.optim.AdamW(parameters, lr=config.inner_lr, weight_decay=config.inner_weight_decay)
