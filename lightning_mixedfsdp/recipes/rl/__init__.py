"""Reinforcement learning with verifiable rewards: rollouts, rewards and the GRPO family of losses."""
