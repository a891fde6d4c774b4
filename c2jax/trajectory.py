"""The plain-data meeting point of sampler, harness and learner.

The sampler never imports the trainer and the trainer never imports the harness: they
exchange `Trajectory` objects (numpy arrays, no JAX state).
Letters: T = tokens in the trajectory, N = MoE layers, K = experts per token (top-k).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class Trajectory:
    """One rollout (or one segment of a self-summarized chain) as token-level arrays."""

    tokens_T: np.ndarray          # int32 token ids, prompt and completion, in order
    loss_mask_T: np.ndarray       # bool, True on tokens the model produced (trained on)
    logprobs_T: np.ndarray        # float32 behaviour logprob of each model token (0 elsewhere)
    versions_T: np.ndarray        # int32 policy version that produced each token (-1 for env)
    expert_ids_TNK: np.ndarray | None = None  # int32 routed experts per token/MoE layer
    reward: float = 0.0
    reward_terms: dict[str, float] = dataclasses.field(default_factory=dict)
    task_id: str = ""
    group_id: str = ""
    finish_reason: str = ""
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        n = len(self.tokens_T)
        for name in ("loss_mask_T", "logprobs_T", "versions_T"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has length {len(getattr(self, name))}, tokens have {n}")
        if self.expert_ids_TNK is not None and self.expert_ids_TNK.shape[0] != n:
            raise ValueError(
                f"Trajectory.expert_ids_TNK has {self.expert_ids_TNK.shape[0]} rows, tokens have {n}")

    @property
    def num_model_tokens(self) -> int:
        return int(np.sum(self.loss_mask_T))
