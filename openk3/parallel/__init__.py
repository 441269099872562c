"""Everything applied to a finished model from outside: activation checkpointing now; FSDP2, expert and context
parallelism with the scale-out issue. `openk3/model` never imports this package."""
