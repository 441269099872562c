"""Training: config, optimizer param groups, quantile balancing of the router bias, losses, checkpoints, metrics
and the train loop. May import model, ops, parallel, data, config and utils; never serve or rl."""
