"""ParallelDims: how a run splits over ranks, and the one named DeviceMesh that carries it.

    dp  data parallel: ranks see different sequences; dense parameters FSDP2-sharded
    ep  expert parallel: ranks see different sequences too, and own E / ep experts each (parallel/ep.py)
    cp  context parallel: ranks hold contiguous shards of the same sequences (parallel/cp.py)

The product is the world size. `--batch-size` stays the global batch, so every layout trains on the same data for a
given seed; each rank takes batch / (dp * ep) sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    dp: int = 1
    ep: int = 1
    cp: int = 1

    def validate(self, world_size: int) -> None:
        for name in ("dp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.dp * self.ep * self.cp != world_size:
            raise ValueError(f"--dp {self.dp} x --ep {self.ep} x --cp {self.cp} must equal the world size {world_size}")

    @property
    def data_ranks(self) -> int:
        """Ranks that see different sequences (dense gradients are averaged over them)."""
        return self.dp * self.ep

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        return init_device_mesh(device_type, (self.dp, self.ep, self.cp), mesh_dim_names=("dp", "ep", "cp"))
