"""The toy twin: name a word, submit it. Small enough for a random tiny model to learn on CPU."""

from envs.toy.twin import ToyConfig, ToyTwin, toy_reward

__all__ = ["ToyConfig", "ToyTwin", "toy_reward"]
