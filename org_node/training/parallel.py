"""``ParallelDims``: the one object that owns the job's parallel layout.

Degrees multiply to the world size: ``dp_replicate * dp_shard * tp * pp == world_size``
(``dp_shard = -1`` takes whatever is left). :meth:`ParallelDims.build_mesh` builds one
``DeviceMesh`` with the named axes ``("pp", "dp_replicate", "dp_shard", "tp")``, outermost
first: tensor-parallel ranks are neighbours (on one host, the fastest links), pipeline
stages are farthest apart. Every axis is present, degree 1 included, so
``mesh["tp"]`` always works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

from org_node.training.errors import SpecError

__all__ = ["MESH_AXES", "ParallelDims"]

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the four parallel axes and the world size they must fill.

    dp_replicate: replicas holding a full copy (or a full HSDP group) each.
    dp_shard: ranks sharding parameters within a replica (FSDP2); -1 infers it.
    tp: tensor-parallel degree.
    pp: pipeline stages.
    world_size: number of ranks.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(name, f"expected an integer >= 1, got {value!r}")
        if not isinstance(self.dp_shard, int) or self.dp_shard == 0 or self.dp_shard < -1:
            raise SpecError("dp_shard", f"expected -1 or an integer >= 1, got {self.dp_shard!r}")
        others = self.dp_replicate * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise SpecError(
                    "dp_shard",
                    f"cannot infer: world size {self.world_size} is not a multiple of "
                    f"dp_replicate*tp*pp={others}",
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        product = others * self.dp_shard
        if product != self.world_size:
            raise SpecError(
                "world_size",
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * tp({self.tp}) "
                f"* pp({self.pp}) = {product}, but the world size is {self.world_size}",
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ddp_only(self) -> bool:
        """Plain replication and nothing else: the job uses DDP, as torchtitan does."""
        return self.dp_replicate_enabled and self.dp_shard == 1 and self.tp == 1 and self.pp == 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh shape in the order of :data:`MESH_AXES`."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh with named axes; the process group must match ``world_size``."""
        from torch.distributed.device_mesh import init_device_mesh  # in the ranks only

        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis (row-major over :data:`MESH_AXES`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        coords: dict[str, int] = {}
        rest = rank
        for axis, size in reversed(list(zip(MESH_AXES, self.shape, strict=True))):
            rest, coords[axis] = divmod(rest, size)
        return {axis: coords[axis] for axis in MESH_AXES}

    def dp_rank(self, rank: int) -> int:
        """Index of the rank's data shard among the ``dp`` data-parallel groups."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]
