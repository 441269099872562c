"""Single-device K3 math. Never imports torch.distributed; parallelism and serving reach in through swap points."""
