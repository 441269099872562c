"""Multi-process training: `torchrun --nproc-per-node N -m openk3.train --dp A --ep B --cp C ...` (or
`k3 train --nproc N ...`), with A x B x C = N. The other flags mean what they mean in one process: `--batch-size` is
the global batch, and every process draws the same global batches from the same seed, then keeps its share. So
every layout trains on the same data.

`DistributedTrainer` is the single-process `Trainer` with its hooks filled in:
- the model is parallelized after it is built (parallel/parallelize.py: EP, CP, FSDP2 over the data ranks);
- a micro-batch's rows are split over the dp x ep ranks, and its positions over the cp ranks (ContextParallel.shard);
- every rank's loss is its labelled tokens' summed cross-entropy over the global count. Backward scales it by the
  world size because FSDP2 averages; the logged loss is the all-reduced sum;
- quantile-balancing histograms are all-reduced over all ranks (all hold distinct tokens), so the biases agree;
- the gradient norm for clipping sums the FSDP shards over every rank and the expert shards over the ep ranks;
- checkpoints hold the gathered model in the official format (rank 0) and the optimizer as a DCP folder (every
  rank); evaluation runs the same batches on every rank, with context parallelism switched off.
`--resume` continues a run at any layout, including one process: the optimizer is saved through DCP.

NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from openk3.parallel.checkpoint import export_pretrained, save_optimizer
from openk3.parallel.cp import ContextParallel
from openk3.parallel.dims import ParallelDims
from openk3.parallel.parallelize import expert_parameters, parallelize, sync_expert_grads
from openk3.train.checkpoint import CHECKPOINTS, latest_checkpoint, publish_checkpoint, remove_temporaries
from openk3.train.config import TrainConfig
from openk3.train.trainer import Trainer


class DistributedTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, log=print):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.dims = ParallelDims(cfg.dp, cfg.ep, cfg.cp)
        self.dims.validate(self.world)
        if self.rank != 0:
            cfg.progress = False
        super().__init__(cfg, log=log if self.rank == 0 else (lambda *args, **kwargs: None))

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def _parallelize(self) -> None:
        self.mesh = self.dims.build_mesh(self.device.type)
        self.cp = ContextParallel(self.mesh["cp"].get_group()) if self.dims.cp > 1 else None
        parallelize(self.model, self.mesh, self.dims, self.cp)
        coords = self.mesh.get_coordinate()
        self.data_rank = coords[0] * self.dims.ep + coords[1]  # which share of the rows this rank takes

    def _layout(self):
        return self.mesh, self.dims

    def _load_trainer_state(self, ckpt: str) -> dict:
        if not os.path.isdir(os.path.join(ckpt, "optimizer-dcp")):
            raise ValueError(f"{ckpt} has no optimizer-dcp folder; resume a one-process checkpoint in one process")
        return super()._load_trainer_state(ckpt)

    def _data_group(self):
        return dist.group.WORLD

    def _writes_run_files(self) -> bool:
        return self.rank == 0

    def _local_batch(self, b):
        rows = b.input_ids.shape[0]
        share = rows // self.dims.data_ranks
        if share * self.dims.data_ranks != rows:
            raise ValueError(f"a micro-batch of {rows} rows does not split over dp x ep = {self.dims.data_ranks} ranks")
        sl = slice(self.data_rank * share, (self.data_rank + 1) * share)
        ids, labels, doc_lens = b.input_ids[sl].to(self.device), b.labels[sl].to(self.device), b.doc_lens[sl]
        if self.cp is None:
            from openk3.model.batch import ForwardBatch

            fb = ForwardBatch.from_rows(ids, doc_lens)
        else:
            fb = self.cp.shard(ids, doc_lens)
            start, n = self.cp.layout.start, self.cp.layout.lengths[self.cp.rank]
            labels = labels[:, start : start + n]
        return fb, labels, float(self.world)

    def _global_loss(self, local: float) -> float:
        total = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(total)
        return float(total)

    @torch.no_grad()
    def _clip_gradients(self) -> float:
        sync_expert_grads(self.model, self.mesh, self.dims)
        experts = {id(p) for p in expert_parameters(self.model)}
        dense_sq = torch.zeros((), dtype=torch.float64)
        expert_sq = torch.zeros((), dtype=torch.float64)
        plain_sq = torch.zeros((), dtype=torch.float64)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        for p in self.model.parameters():
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                dense_sq += p.grad.to_local().double().pow(2).sum()
            elif id(p) in experts:
                expert_sq += p.grad.double().pow(2).sum()
            else:
                plain_sq += p.grad.double().pow(2).sum()  # replicated, identical on every rank
        dist.all_reduce(dense_sq)  # FSDP2 shards span every rank
        if self.dims.ep > 1:
            dist.all_reduce(expert_sq, group=self.mesh["ep"].get_group())
        norm = float((dense_sq + expert_sq + plain_sq).sqrt())
        coef = self.cfg.grad_clip / (norm + 1e-6)
        if coef < 1:
            for g in grads:
                g.mul_(coef)
        return norm

    # ---- evaluation and checkpoints ----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        swapped = []
        if self.cp is not None:  # evaluation runs whole sequences on every rank
            for m in self.model.modules():
                if getattr(m, "context_parallel", None) is not None:
                    swapped.append((m, m.context_parallel))
                    m.context_parallel = None
        try:
            return super().evaluate()
        finally:
            for m, fn in swapped:
                m.context_parallel = fn

    def save(self) -> str:
        """checkpoints/step-N: the gathered model in the official format with its tokenizer (rank 0), the optimizer
        as a DCP folder (every rank its shards; loads at any layout, one process included) and the trainer state."""
        root = os.path.join(self.run_dir, CHECKPOINTS)
        name = f"step-{self.step:08d}"
        tmp = os.path.join(root, f".tmp-{name}")
        if self.rank == 0:
            remove_temporaries(root)  # leftovers of killed saves: never published checkpoints
        dist.barrier()
        export_pretrained(self.model, tmp, self.mesh, self.dims)  # every rank joins the gathers
        save_optimizer(self.model, self.optimizer, os.path.join(tmp, "optimizer-dcp"), self.mesh, self.dims)
        if self.rank == 0:
            self.data.tokenizer.save(tmp)
            state = {**self._trainer_state(), "step": self.step, "world_size": self.world, "layout": vars(self.dims)}
            with open(os.path.join(tmp, "trainer_state.json"), "w", encoding="utf-8") as f:
                json.dump(state, f, indent=1)
            publish_checkpoint(root, tmp, name, self.cfg.keep_checkpoints)
        dist.barrier()
        return latest_checkpoint(self.run_dir)  # the folder rank 0 published, on every rank

    def _append_metrics(self, row: dict) -> None:
        if self.rank == 0:
            super()._append_metrics(row)

    def _truncate_metrics(self, step: int) -> None:
        if self.rank == 0:
            super()._truncate_metrics(step)
