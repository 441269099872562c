"""Agentic RL: rollouts through the serving engine, trainer-side log-probs, losses and corrections."""
