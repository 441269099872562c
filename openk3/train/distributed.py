"""`Layout`: how one process's share of a training run is laid out, the only part of the trainer that knows ranks.
One process is a world of 1 (no mesh, nothing applied); `torchrun --nproc-per-node N -m openk3.train --dp A --ep B
--cp C ...` (or `k3 train --nproc N ...`) is a world of N = A x B x C. The other flags mean what they mean in one
process: `--batch-size` is the global batch, and every process draws the same global batches from the same seed,
then keeps its share, so every layout trains on the same data.

What the layout decides, and what it is in a world of 1:
- `parallelize`: EP, CP and FSDP2 over the data ranks (parallel/parallelize.py) | nothing;
- `local_batch`: a micro-batch's rows split over the dp x ep ranks, its positions over the cp ranks
  (ContextParallel.shard); every rank's loss is its labelled tokens' summed cross-entropy over the global count,
  and backward scales it by the world size because FSDP2 averages | the whole micro-batch, factor 1;
- `local_tokens`: the same cut along the positions for a TokenBatch of packed sequences that a driver shared out
  over the data ranks itself (`k3 rl`, `k3 distill`: every cp rank of a data rank passes the same batches) | itself;
- `sum_over_ranks`: the logged loss is the all-reduced sum | itself;
- `data_group`: quantile-balancing histograms are all-reduced over all ranks (all hold distinct tokens), so the
  biases agree | None;
- `clip_gradients`: the norm sums the FSDP shards over every rank and the expert shards over the ep ranks, in
  fp64 | torch's clip_grad_norm_.
Evaluation runs the same whole batches on every rank in every layout: its ForwardBatches carry no context-parallel
shard layout, so the layers run unsharded.
Checkpoints (train/checkpoint.py) take the mesh from here: every rank writes its own shards with DCP.

NCCL on CUDA, gloo on CPU (train/__main__.py starts the process group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from openk3.model.batch import ForwardBatch
from openk3.parallel.checkpoint import full_tensors
from openk3.parallel.dims import ParallelDims
from openk3.parallel.parallelize import expert_parameters, parallelize, sync_expert_grads
from openk3.parallel.watchdog import bound_subgroup_timeouts, collective_watchdog  # re-exported: rl launches too
from openk3.train.batch import TokenBatch

__all__ = ["Layout", "bound_subgroup_timeouts", "collective_watchdog"]

CP_PADDING_PER_RANK = 16  # positions per cp rank of a padding micro-batch: more than any conv halo (W - 1)


class Layout:
    def __init__(self, dims: ParallelDims, device: str | torch.device, in_group: bool | None = None):
        """The layout `dims` over this process group, or a world of 1 without one (`in_group` False: one process
        even where a group is initialized, for tools that save from one process). Builds the mesh."""
        if in_group is None:
            in_group = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if in_group else 1
        self.rank = dist.get_rank() if in_group else 0
        dims.validate(self.world)
        self.dims, self.device = dims, torch.device(device)
        self.mesh = dims.build_mesh(self.device.type) if self.world > 1 else None
        self.cp = None
        if dims.cp > 1:
            from openk3.parallel.cp import ContextParallel

            self.cp = ContextParallel(self.mesh["cp"].get_group())
        coords = self.mesh.get_coordinate() if self.mesh is not None else (0, 0, 0)
        self.data_rank = coords[0] * dims.ep + coords[1]  # which share of the rows this rank takes
        self.cp_rank = coords[2]  # which piece of them: the cp ranks of one data rank hold the same rows

    @classmethod
    def of(cls, dp: int | None, ep: int, cp: int, device: str | torch.device) -> Layout:
        """dp x ep x cp over this process group (a world of 1 without one); dp None: the ranks ep and cp leave."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return cls(ParallelDims(dp if dp is not None else max(world // (ep * cp), 1), ep, cp), device)

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> Layout:
        """A world of 1."""
        return cls(ParallelDims(), device, in_group=False)

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's files (train_config.json, metrics.jsonl, checkpoint metadata)."""
        return self.rank == 0

    @property
    def data_group(self):
        """The process group whose ranks hold distinct tokens (quantile-balancing statistics are summed over it)."""
        return dist.group.WORLD if self.world > 1 else None

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def parallelize(self, model) -> None:
        """Apply this layout to the built model (before the optimizer sees its parameters)."""
        if self.mesh is not None:
            parallelize(model, self.mesh, self.dims, self.cp)

    def local_batch(self, b):
        """This process's ForwardBatch and labels of micro-batch `b`, and the factor on its loss before backward."""
        rows = b.input_ids.shape[0]
        share = rows // self.dims.data_ranks
        if share * self.dims.data_ranks != rows:
            raise ValueError(f"a micro-batch of {rows} rows does not split over dp x ep = {self.dims.data_ranks} ranks")
        sl = slice(self.data_rank * share, (self.data_rank + 1) * share)
        ids, labels, doc_lens = b.input_ids[sl].to(self.device), b.labels[sl].to(self.device), b.doc_lens[sl]
        if self.cp is None:
            return ForwardBatch.from_rows(ids, doc_lens), labels, float(self.world)
        fb = self.cp.shard(ids, doc_lens)
        shard = fb.context_parallel  # the ShardLayout this batch carries: where this rank's positions sit
        start, n = shard.start, shard.lengths[self.cp.rank]
        return fb, labels[:, start : start + n], float(self.world)

    @property
    def is_data_leader(self) -> bool:
        """Whether this rank speaks for its data rank's rows when every rank's rows are gathered (the first of its
        cp ranks: the others hold the same rows)."""
        return self.cp_rank == 0

    def local_tokens(self, mb: TokenBatch) -> TokenBatch:
        """This rank's part of a TokenBatch that holds its data rank's rows whole: the batch itself, or its piece
        along the positions over the cp ranks (TokenBatch.context_shard). Batches the layout already cut (`prebuilt`)
        or that feed the model themselves (vision, one process) pass through."""
        if self.cp is None or mb.prebuilt is not None or mb.model_inputs is not None:
            return mb
        if mb.padding:  # enough positions for every rank's conv halo
            mb = TokenBatch.padding_batch(CP_PADDING_PER_RANK * self.dims.cp)
        return mb.context_shard(self.cp, self.device)

    def whole_positions(self, x_T: torch.Tensor, local: TokenBatch) -> torch.Tensor:
        """Per-position values of `local` (from `local_tokens`) for the whole batch: gathered over the cp ranks."""
        if local.context_parallel is None:
            return x_T
        return self.cp.gather_positions(x_T, local.context_parallel.lengths)

    def full_tensors(self, model):
        """(name, whole tensor) of `model` laid out here, one at a time (parallel/checkpoint.py full_tensors)."""
        return full_tensors(model, self.mesh, self.dims)

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    @torch.no_grad()
    def clip_gradients(self, model, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to `max_norm`; returns the norm before clipping, on the device (no sync)."""
        if self.mesh is None:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        sync_expert_grads(model, self.mesh, self.dims)
        experts = {id(p) for p in expert_parameters(model)}
        dense_sq, expert_sq, plain_sq = (torch.zeros((), dtype=torch.float64, device=self.device) for _ in range(3))
        grads = []
        for p in model.parameters():
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                local = p.grad.to_local()
                dense_sq += local.double().pow(2).sum()
                grads.append(local)
            elif id(p) in experts:
                expert_sq += p.grad.double().pow(2).sum()
                grads.append(p.grad)
            else:
                plain_sq += p.grad.double().pow(2).sum()  # replicated, identical on every rank
                grads.append(p.grad)
        dist.all_reduce(dense_sq)  # FSDP2 shards span every rank
        if self.dims.ep > 1:
            dist.all_reduce(expert_sq, group=self.mesh["ep"].get_group())
        norm = (dense_sq + expert_sq + plain_sq).sqrt()
        # A factor of exactly 1 below the limit leaves the gradients bit for bit, with no host sync to decide.
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm
