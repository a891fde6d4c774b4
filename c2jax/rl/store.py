"""Durable group store: every finished group is written (atomically) with the policy version
it started on, before the learner may consume it; the learner checkpoint records which group
indices it has consumed. After a crash the run restores the checkpoint, reloads finished
but unconsumed groups from here, and requeues the admitted-but-unfinished ones, so no group is
lost or trained twice. An admissions ledger (append-only JSONL) pins which task each group
index was assigned.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from c2jax.trajectory import Trajectory


@dataclasses.dataclass
class FinishedGroup:
    index: int                      # admission index (= the prompt's slot in the run's stream)
    task_id: str
    suite: str
    start_version: int              # policy version the group started on
    trajectories: list[Trajectory]
    rewards: list[float]
    passed: list[bool]
    attempt: int = 0                # how many times the group was requeued before finishing
    end_version: int = 0            # newest policy version among its tokens

    @property
    def hardness(self) -> float:
        """Turns + thinking tokens / 100, mean over attempts (for the curriculum; a chain of
        segments counts once, by its last segment, whose stats cover the whole episode)."""
        vals = [float(t.stats.get("turns", 1)) + float(t.stats.get("thinking_tokens", 0)) / 100.0
                for t in self.trajectories
                if int(t.stats.get("chain_index", 0)) == int(t.stats.get("chain_length", 1)) - 1]
        return float(np.mean(vals)) if vals else 0.0


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        try:
            json.dumps(v)
            out[k] = v
        except (TypeError, ValueError):
            out[k] = str(v)
    return out


class GroupStore:
    """workdir/groups/g{index:08d}.npz (+ .json); atomic writes (tmp + rename)."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.ledger_path = os.path.join(directory, "admissions.jsonl")

    def _base(self, index: int) -> str:
        return os.path.join(self.directory, f"g{index:08d}")

    def put(self, g: FinishedGroup) -> None:
        arrays = {}
        for j, t in enumerate(g.trajectories):
            arrays[f"{j}_tokens"] = t.tokens_T
            arrays[f"{j}_mask"] = t.loss_mask_T
            arrays[f"{j}_logprobs"] = t.logprobs_T
            arrays[f"{j}_versions"] = t.versions_T
            if t.expert_ids_TNK is not None:
                arrays[f"{j}_experts"] = t.expert_ids_TNK
        meta = {"index": g.index, "task_id": g.task_id, "suite": g.suite, "start_version": g.start_version,
                "end_version": g.end_version, "rewards": list(map(float, g.rewards)),
                "passed": list(map(bool, g.passed)), "attempt": g.attempt,
                "trajectories": [{"reward": float(t.reward), "reward_terms": _jsonable(t.reward_terms),
                                  "task_id": t.task_id, "group_id": t.group_id, "finish_reason": t.finish_reason,
                                  "stats": _jsonable(t.stats)} for t in g.trajectories]}
        base = self._base(g.index)
        with open(base + ".npz.tmp", "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(base + ".npz.tmp", base + ".npz")
        with open(base + ".json.tmp", "w") as f:  # the json is the commit marker: written last
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(base + ".json.tmp", base + ".json")

    def get(self, index: int) -> FinishedGroup | None:
        base = self._base(index)
        if not os.path.exists(base + ".json"):
            return None
        with open(base + ".json") as f:
            meta = json.load(f)
        with np.load(base + ".npz") as z:
            trajs = []
            for j, tm in enumerate(meta["trajectories"]):
                trajs.append(Trajectory(
                    tokens_T=z[f"{j}_tokens"], loss_mask_T=z[f"{j}_mask"], logprobs_T=z[f"{j}_logprobs"],
                    versions_T=z[f"{j}_versions"],
                    expert_ids_TNK=z[f"{j}_experts"] if f"{j}_experts" in z.files else None,
                    reward=tm["reward"], reward_terms=tm["reward_terms"], task_id=tm["task_id"],
                    group_id=tm["group_id"], finish_reason=tm["finish_reason"], stats=tm["stats"]))
        return FinishedGroup(index=meta["index"], task_id=meta["task_id"], suite=meta["suite"],
                             start_version=meta["start_version"], trajectories=trajs, rewards=meta["rewards"],
                             passed=meta["passed"], attempt=meta["attempt"], end_version=meta["end_version"])

    def indices(self) -> list[int]:
        return sorted(int(f[1:9]) for f in os.listdir(self.directory) if f.startswith("g") and f.endswith(".json"))

    # -- admissions ledger
    def record_admission(self, index: int, suite: str, task_pos: int) -> None:
        with open(self.ledger_path, "a") as f:
            f.write(json.dumps({"index": index, "suite": suite, "pos": task_pos}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def admissions(self) -> dict[int, tuple[str, int]]:
        if not os.path.exists(self.ledger_path):
            return {}
        out = {}
        with open(self.ledger_path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:  # a torn last line after a crash
                    continue
                out[int(d["index"])] = (d["suite"], int(d["pos"]))
        return out
