"""Chained (self-summarized) rollouts -> training sequences.

A self-summarized episode is one rollout made of several generations: segment k's context is
the restart prefix (system + task + summary + carried state) followed by that segment's turns,
and its model tokens are everything the policy sampled in it, the summary that closed it
included (the summary then reappears as *environment* tokens at the start of segment k + 1).
The episode runner already records each segment as its own Trajectory (EpisodeResult.segments),
so each becomes one training sequence with its own context and loss mask. What this module
adds:

  chain_sequences(segments, reward=None, chain_id="")
      -> list[Trajectory]: the segments sharing the chain's reward/reward_terms/group_id and
         tagged with stats chain_id / chain_index / chain_length; token arrays, loss masks,
         behaviour logprobs, policy versions and expert ids are the segment's own (untouched).
  chain_advantages(chain_rewards, group_ids, std_normalize=False)
      -> per-chain advantage (Dr. GRPO: reward - group mean over *chains*; a chain that was
         split into 5 sequences still counts once in its group's mean).
  expand_to_sequences(chains, advantages)
      -> (sequences, per-sequence advantages): every sequence of a chain gets the chain's.
  split_chains(trajectories, num_chains=None)
      -> the chains of a group stored flat (stats chain_index / chain_length).
  groups_to_sequences(groups, weights, std_normalize=False)
      -> (sequences, advantages_B, weights_B, chains): what the RL loop hands the learner.
  token_advantages(seq, advantage) -> float32[T]: advantage on model tokens, 0 elsewhere.
  pack_sequences(seqs, advantages, seq_len, num_rows=None)
      -> packed batch dict; every sequence is its own segment (segment ids 1..n per row,
         positions restart), so attention never crosses sequences of the same chain.

Packed batch (B rows, L = seq_len; aligned with `targets`, like c2jax.data.pipeline):
    inputs int32[B, L], targets int32[B, L], segment_ids int32[B, L] (0 = padding),
    positions int32[B, L], loss_weights float32[B, L] (1 where the target is a model token),
    advantages float32[B, L] (the sequence's advantage where loss_weights = 1, else 0),
    behaviour_logprobs float32[B, L] (sampler logprob of the target), versions int32[B, L]
    (policy version of the target, -1 elsewhere), seq_index int32[B, L] (index into `seqs`,
    -1 on padding), expert_ids int32[B, L, N, K] (router replay for the *input* token, -1 =
    no replay; only when some sequence has expert ids), num_sequences int.

Letters: T = tokens of one sequence, B = packed rows, L = row length, N = MoE layers,
K = experts per token.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from c2jax.trajectory import Trajectory

PAD_ID = 0


def chain_sequences(segments: Sequence[Trajectory], reward: float | None = None, chain_id: str = "",
                    reward_terms: dict | None = None) -> list[Trajectory]:
    """The chain's segments as training sequences sharing its reward (default: the reward and
    reward_terms of the last segment, where the runner and the reward function put them)."""
    if not segments:
        raise ValueError("chain_sequences needs at least one segment")
    last = segments[-1]
    r = float(last.reward if reward is None else reward)
    terms = dict(last.reward_terms if reward_terms is None else reward_terms)
    cid = chain_id or f"{last.task_id}/{last.group_id}"
    out = []
    for k, seg in enumerate(segments):
        stats = dict(seg.stats)
        stats.update(chain_id=cid, chain_index=k, chain_length=len(segments))
        out.append(dataclasses.replace(seg, reward=r, reward_terms=dict(terms), group_id=last.group_id,
                                       stats=stats))
    return out


def chain_advantages(chain_rewards, group_ids, std_normalize: bool = False, std_eps: float = 1e-6) -> np.ndarray:
    """Per-chain Dr. GRPO advantage: reward - mean reward of the chains in the same group
    (optionally / (group std + eps)); `group_advantages_by_id` over the chains. group_ids: any
    hashables, one per chain."""
    from c2jax.rl.advantages import group_advantages_by_id
    r = np.asarray(chain_rewards, np.float64)
    gids = list(group_ids)
    if len(gids) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(gids)} group ids")
    dense = {g: i for i, g in enumerate(dict.fromkeys(gids))}
    ids = np.asarray([dense[g] for g in gids], np.int32)
    return np.asarray(group_advantages_by_id(r, ids, len(dense), std_normalize, std_eps), np.float32)


def expand_to_sequences(chains: Sequence[Sequence[Trajectory]], advantages) -> tuple[list[Trajectory], np.ndarray]:
    """Flatten chains into sequences; each sequence carries its chain's advantage."""
    advantages = np.asarray(advantages, np.float32)
    if len(advantages) != len(chains):
        raise ValueError(f"{len(chains)} chains but {len(advantages)} advantages")
    seqs, adv = [], []
    for chain, a in zip(chains, advantages):
        for s in chain:
            seqs.append(s)
            adv.append(float(a))
    return seqs, np.asarray(adv, np.float32)


def split_chains(trajectories: Sequence[Trajectory], num_chains: int | None = None) -> list[list[Trajectory]]:
    """A group's flat list of segments (as the orchestrator stores it) back into chains, using
    stats chain_index / chain_length (a trajectory without them is a chain of one)."""
    chains: list[list[Trajectory]] = []
    cur: list[Trajectory] = []
    for i, t in enumerate(trajectories):
        k, n = int(t.stats.get("chain_index", 0)), int(t.stats.get("chain_length", 1))
        if k != len(cur) or not 0 <= k < n:
            raise ValueError(f"trajectory {i} ({t.task_id}) is segment {k} of {n}, expected segment {len(cur)}")
        cur.append(t)
        if len(cur) == n:
            chains.append(cur)
            cur = []
    if cur:
        raise ValueError(f"the last chain has {len(cur)} of {cur[0].stats.get('chain_length')} segments")
    if num_chains is not None and len(chains) != num_chains:
        raise ValueError(f"{len(chains)} chains but {num_chains} rewards")
    return chains


def groups_to_sequences(groups, weights, std_normalize: bool = False, std_eps: float = 1e-6,
                        negative_scale: float = 1.0):
    """Learner inputs from finished groups (c2jax.rl.store.FinishedGroup, equal sizes G):
    -> (sequences, advantages_B, weights_B, chains). Dr. GRPO advantage per attempt (group mean
    over the G chains, each chain once, however many segments it has), then every sequence of a
    chain carries its chain's advantage and its group's weight. Without chains (every attempt
    one trajectory) this is exactly the per-trajectory group advantage. negative_scale scales
    the advantages below zero (`group_advantages`)."""
    from c2jax.rl.advantages import group_advantages
    per_group = [split_chains(g.trajectories, len(g.rewards)) for g in groups]
    rewards_PG = np.asarray([g.rewards for g in groups], np.float32)
    adv = np.asarray(group_advantages(rewards_PG, std_normalize, std_eps, negative_scale)).reshape(-1)
    chains = [c for cs in per_group for c in cs]
    seqs, adv_B = expand_to_sequences(chains, adv)
    w_chain = np.repeat(np.asarray(weights, np.float32), [len(cs) for cs in per_group])
    _, w_B = expand_to_sequences(chains, w_chain)
    return seqs, adv_B, w_B, chains


def token_advantages(seq: Trajectory, advantage: float) -> np.ndarray:
    """float32[T]: `advantage` on the sequence's model tokens, 0 on environment tokens."""
    return np.where(seq.loss_mask_T, np.float32(advantage), np.float32(0.0)).astype(np.float32)


def pack_sequences(seqs: Sequence[Trajectory], advantages, seq_len: int, num_rows: int | None = None,
                   pad_id: int = PAD_ID) -> dict:
    """First-fit packing, one segment per sequence (see the module docstring for the arrays).

    A sequence longer than seq_len is an error: with self-summarization every generation's
    context stays under the trigger, so raise seq_len rather than cut a sequence silently."""
    advantages = np.asarray(advantages, np.float32)
    if len(advantages) != len(seqs):
        raise ValueError(f"{len(seqs)} sequences but {len(advantages)} advantages")
    L = int(seq_len)
    rows: list[list[int]] = []
    fill: list[int] = []
    for i, s in enumerate(seqs):
        n = len(s.tokens_T)
        if n > L:
            raise ValueError(f"sequence {i} ({s.task_id}, chain index {s.stats.get('chain_index')}) has {n} "
                             f"tokens > seq_len={L}; raise seq_len or lower the summary trigger")
        for r, f in enumerate(fill):
            if f + n <= L:
                rows[r].append(i)
                fill[r] += n
                break
        else:
            rows.append([i])
            fill.append(n)
    B = len(rows) if num_rows is None else int(num_rows)
    if len(rows) > B:
        raise ValueError(f"{len(seqs)} sequences need {len(rows)} rows of {L} tokens; num_rows={num_rows}")
    nk = next((s.expert_ids_TNK.shape[1:] for s in seqs if s.expert_ids_TNK is not None), None)
    out = {"inputs": np.full((B, L), pad_id, np.int32), "targets": np.full((B, L), pad_id, np.int32),
           "segment_ids": np.zeros((B, L), np.int32), "positions": np.zeros((B, L), np.int32),
           "loss_weights": np.zeros((B, L), np.float32), "advantages": np.zeros((B, L), np.float32),
           "behaviour_logprobs": np.zeros((B, L), np.float32), "versions": np.full((B, L), -1, np.int32),
           "seq_index": np.full((B, L), -1, np.int32)}
    if nk is not None:
        out["expert_ids"] = np.full((B, L, *nk), -1, np.int32)
    for r, members in enumerate(rows):
        pos = 0
        for seg_no, i in enumerate(members, start=1):
            s = seqs[i]
            n = len(s.tokens_T)
            sl = slice(pos, pos + n)
            tgt = slice(pos, pos + n - 1)   # position t predicts token t + 1 of the same sequence
            out["inputs"][r, sl] = s.tokens_T
            out["targets"][r, tgt] = s.tokens_T[1:]
            out["segment_ids"][r, sl] = seg_no
            out["positions"][r, sl] = np.arange(n)
            m = s.loss_mask_T[1:].astype(np.float32)
            out["loss_weights"][r, tgt] = m
            out["advantages"][r, tgt] = m * advantages[i]
            out["behaviour_logprobs"][r, tgt] = np.where(s.loss_mask_T[1:], s.logprobs_T[1:], 0.0)
            out["versions"][r, tgt] = np.where(s.loss_mask_T[1:], s.versions_T[1:], -1)
            out["seq_index"][r, sl] = i
            if nk is not None and s.expert_ids_TNK is not None and s.expert_ids_TNK.shape[1:] == nk:
                out["expert_ids"][r, sl] = s.expert_ids_TNK
            pos += n
    out["num_sequences"] = len(seqs)
    return out


def chains_to_batch(chains: Sequence[Sequence[Trajectory]], chain_rewards, group_ids, seq_len: int,
                    num_rows: int | None = None, std_normalize: bool = False) -> dict:
    """The whole path for a learner: per-chain advantages -> split -> packed batch.

    chains: one list of segment Trajectories per rollout (EpisodeResult.segments)."""
    adv = chain_advantages(chain_rewards, group_ids, std_normalize)
    chains = [chain_sequences(c, reward=float(r), chain_id=f"chain{i}")
              for i, (c, r) in enumerate(zip(chains, chain_rewards))]
    seqs, seq_adv = expand_to_sequences(chains, adv)
    batch = pack_sequences(seqs, seq_adv, seq_len, num_rows)
    batch["chain_advantages"] = adv
    return batch
