"""The `rl` config section: the RL objective (losses.default_rl_loss_config) plus the
orchestrator, weight sync, durability and evaluation fields.

    cfg.rl = rl_defaults()       # what c2jax.config.default_config() attaches (registered below)
    validate_rl(cfg.rl)          # raises ConfigError naming the bad field
"""
from __future__ import annotations

import ml_collections

from c2jax.config import register_section
from c2jax.errors import ConfigError
from c2jax.rl.losses import default_rl_loss_config, validate_rl_loss_config

BACKENDS = ("threads", "ray")
STALE_POLICIES = ("drop", "reweight", "keep")
ENVS = ("harness", "toy")
SUMMARY_METHODS = ("none", "self", "prompt", "truncate")  # c2jax.agent.summarize.METHODS


# rl.speculative / eval.speculative: the Sampler's speculative= choices (c2jax.sampling.engine
# checks the same names; the config layer does not import the sampler)
SPECULATIVE_MODES = ("auto", "mtp", "none")


def rl_defaults() -> ml_collections.ConfigDict:
    """Every RL field with its default; values the report does not state say so."""
    c = default_rl_loss_config()
    # --- behaviour terms graded from each episode's end state and tool calls (c2jax.rl.rewards
    # behaviour_stats; reward -= weight x stat, each stat in [0, 1]); the report states no values ---
    c.behaviour_weights.eager_edits = 0.25  # a question-only task's files edited (or an edit tool called)
    c.behaviour_weights.protected_paths = 0.25  # a protected path (tests/) changed
    c.behaviour_weights.debug_prints = 0.1  # debug prints / breakpoints added to Python code
    c.behaviour_weights.new_lint = 0.1  # ruff findings added to touched files (n findings: n / (1 + n))
    c.behaviour_weights.missing_final_message = 0.1  # the episode ended without a final message
    # --- rollouts ---
    c.env = "harness"  # "harness" (agent episodes on task suites) | "toy" (token bandit; tests/benchmarks)
    c.suites = ("synthetic:1",)  # training task suites (c2jax.tasks.load_suite names)
    c.suite_weights = ()  # sampling weight per suite (empty = equal)
    c.eval_suites = ()  # held-out suites for pass@1 / best-of-K (empty = same as suites)
    c.num_train_tasks = 0  # distinct training prompts (0 = steps * prompts_per_step; each used once)
    # seed of the training-task pool (-1 = the run's seed). Set it apart from the seed an SFT stage's
    # transcripts came from, so RL trains on tasks SFT never showed solved (the demo: SFT seed 0, RL 1)
    c.task_seed = -1
    c.group_size = 4  # attempts per prompt (G)
    c.prompts_per_step = 2  # groups per learner step (P)
    c.steps = 10  # learner steps (policy versions published)
    c.staleness = 1  # max versions between a group's start version and the learner's (0 = synchronous)
    c.stale_policy = "drop"  # groups over the bound (after restarts): "drop" | "reweight" | "keep"
    c.stale_decay = 0.5  # reweight: advantages x decay^(excess staleness)
    c.temperature = 1.0  # sampling temperature (the learner scores logits / temperature too)
    c.max_new_tokens = 128  # per assistant message
    c.max_turns = 4  # assistant messages per episode
    c.max_total_tokens = 768  # context budget of an episode (sampler max_len = this + 1)
    c.list_tools_in_system = False  # append the tool JSON specs to the system prompt
    c.system_prompt = ""  # episode system prompt ("" = the harness default, c2jax.agent.runner)
    c.env_workers = 8  # concurrent episodes (threads)
    c.sampler_slots = 8  # sampler cache slots (concurrent sequences)
    c.sampler_chunk = 16  # decode steps per on-device loop
    c.sampler_decode_devices = 1  # split each decode step over this many devices (CPU: host devices, see Sampler)
    # the sampler's own mesh, one size per mesh.axes entry (() = one device): batch over the data
    # axes, experts over the expert axes, by mesh.rules; the learner takes mesh.shape over the
    # devices before it (c2jax.rl.roles)
    c.sampler_mesh_shape = ()
    # MTP speculative decoding in rollouts: "auto" (on where the model has MTP heads and one
    # device decodes with the scanned model, e.g. an accelerator; see Sampler), "mtp", "none". Exact:
    # tokens, logprobs and expert ids are the target model's either way
    c.speculative = "auto"
    # the learner's MTP self-distillation (weight train.mtp_loss_weight) trains the MTP heads only:
    # False detaches their inputs (trunk states, embeddings) and the output head from it, so the
    # policy's gradient is the RL objective's alone; True lets it reach the policy as in CPT
    c.mtp_into_policy = False
    # --- self-summarization (harness env; c2jax.agent.summarize, c2jax.rl.chains) ---
    c.summary_method = "none"  # "none" (full context) | "self" | "prompt" (compaction call) | "truncate"
    c.summary_trigger_tokens = 512  # compact when the current segment holds this many tokens
    c.context_window = 0  # tokens one segment may hold (sampler max_len = this + 1); 0 = max_total_tokens
    c.max_summaries = 4  # compactions per episode (then the context grows until the window ends it)
    c.max_summary_tokens = 128  # generated tokens per summary (thinking included)
    c.curriculum_strength = 0.0  # later in training upsample harder suites by (1 + s * progress * hardness)
    # --- learner ---
    c.router_replay = True  # force the sampler's recorded experts (gate scores still from the learner)
    # Drop rows whose advantage is exactly 0 before the learner (all-equal groups; below-mean attempts
    # under negative_advantage_scale 0): they add nothing to the gradient, and the loss keeps the whole
    # batch's normalizer, so the update is unchanged. Needs kl_coef 0 (the KL penalty makes every
    # row's advantage nonzero). Learner metrics and the MTP heads' distillation then see the kept rows.
    c.skip_zero_advantage_rows = False
    c.noreplay_metrics = True  # one more no-gradient forward per step: the logprob mismatch without router replay
    c.replay_threshold = 0.0  # copied to model.replay_threshold: replace forced experts scoring < thr * own k-th
    c.length_bucket = 64  # learner batch padded length is a multiple of this (few compiles)
    c.micro_batch_rows = 0  # learner rows per forward/backward (gradients summed over micro-batches); 0 = all
    c.data_shards = 1  # learner batch is ordered so each data shard gets a balanced token count
    # --- weight sync ---
    c.delta_full_every = 10  # publish a full snapshot every N versions, lossless deltas in between
    c.sync_dtype = "float32"  # dtype of the sampler's copy of the weights ("float32" | "bfloat16")
    c.log_delta = True  # measure delta vs full size at every publish (threads backend too)
    # --- durability / logging ---
    c.checkpoint_every = 1  # learner checkpoint every N steps (groups are checkpointed as they finish)
    c.keep_checkpoints = 3  # learner checkpoints kept
    c.eval_every = 0  # held-out pass@1 / best-of-K every N steps (0 = only at the start and end; <0 = never)
    c.eval_tasks = 8  # held-out tasks per eval
    c.eval_k = 4  # attempts per held-out task (best-of-K)
    c.eval_temperature = 1.0  # sampling temperature of the eval attempts
    c.worker_restarts = 100  # give up after this many sampler/env worker restarts
    c.backend = "threads"  # "threads" (one process) | "ray" (actors; needs `pip install ray`)
    c.ray_address = ""  # backend=ray: a cluster to join ("auto", "ray://host:10001", ...); "" = start a local one
    c.ray_num_cpus = 2  # CPUs of the local cluster (ray_address ""); the learner and each sampler take 1
    c.ray_samplers = 1  # sampler actors (each a SamplerService; an episode's group is pinned to one)
    c.ray_env_actors = 2  # environment-worker actors (rl.env_workers concurrent episodes spread over them)
    c.ray_learner_gpus = 0.0  # GPUs reserved by the learner actor
    c.ray_sampler_gpus = 0.0  # GPUs reserved by each sampler actor
    c.ray_host_devices = 0  # CPU hosts: XLA host devices per learner / sampler actor (0 = the process's own)
    c.toy_target = 7  # toy env: the rewarded token id
    c.toy_prompt_len = 8  # toy env: prompt length
    c.toy_latency_s = 0.0  # toy env: seconds of simulated tool / VM latency per episode (benchmarks)
    c.toy_latency_sigma = 0.0  # toy env: > 0 draws the latency lognormal (mean toy_latency_s, this log-std)
    return c


def validate_rl(r, model=None) -> None:
    """Raise ConfigError naming the bad `rl.` field."""
    ref = rl_defaults()
    for key in r.keys():
        if key not in ref:
            raise ConfigError(f"unknown config key 'rl.{key}'")
    try:
        validate_rl_loss_config(r)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for key in ("group_size", "prompts_per_step", "steps", "max_new_tokens", "max_turns", "max_total_tokens",
                "env_workers", "sampler_slots", "sampler_chunk", "sampler_decode_devices", "delta_full_every", "length_bucket",
                "data_shards", "checkpoint_every", "eval_k", "eval_tasks"):
        if int(r[key]) < 1:
            raise ConfigError(f"rl.{key} must be >= 1, got {r[key]}")
    if int(r.micro_batch_rows) < 0:
        raise ConfigError(f"rl.micro_batch_rows must be >= 0 (0 = the whole batch at once), got {r.micro_batch_rows}")
    if int(r.task_seed) < -1:
        raise ConfigError(f"rl.task_seed must be >= 0, or -1 for the run's seed; got {r.task_seed}")
    if r.staleness < 0:
        raise ConfigError(f"rl.staleness must be >= 0 (0 = synchronous), got {r.staleness}")
    if r.backend not in BACKENDS:
        raise ConfigError(f"rl.backend must be one of {BACKENDS}, got {r.backend!r}")
    _validate_ray(r, ConfigError)
    if r.stale_policy not in STALE_POLICIES:
        raise ConfigError(f"rl.stale_policy must be one of {STALE_POLICIES}, got {r.stale_policy!r}")
    if r.env not in ENVS:
        raise ConfigError(f"rl.env must be one of {ENVS}, got {r.env!r}")
    if r.sync_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"rl.sync_dtype must be 'float32' or 'bfloat16', got {r.sync_dtype!r}")
    if r.skip_zero_advantage_rows and r.kl_coef > 0:
        raise ConfigError(f"rl.skip_zero_advantage_rows needs rl.kl_coef=0 (got {r.kl_coef}): the KL penalty "
                          "gives every row a nonzero per-token advantage")
    if r.temperature <= 0:
        raise ConfigError("rl.temperature must be > 0 (the learner divides logits by it)")
    if r.suite_weights and len(r.suite_weights) != len(r.suites):
        raise ConfigError(f"rl.suite_weights has {len(r.suite_weights)} entries for {len(r.suites)} suites")
    if not r.suites:
        raise ConfigError("rl.suites is empty; name at least one task suite (e.g. 'synthetic:1')")
    if r.sampler_slots < r.group_size and r.env == "toy":
        raise ConfigError(f"rl.sampler_slots={r.sampler_slots} must be >= rl.group_size={r.group_size}")
    if tuple(r.sampler_mesh_shape) and int(r.sampler_decode_devices) != 1:
        raise ConfigError("rl.sampler_mesh_shape and rl.sampler_decode_devices > 1 are two layouts of the sampler; "
                          "set one of them")
    if r.speculative not in SPECULATIVE_MODES:
        raise ConfigError(f"rl.speculative must be one of {SPECULATIVE_MODES}, got {r.speculative!r}")
    if r.speculative == "mtp" and tuple(r.sampler_mesh_shape):
        raise ConfigError("rl.speculative='mtp' runs the sampler on one device; with rl.sampler_mesh_shape use "
                          "'auto' or 'none'")
    if r.speculative == "mtp" and model is not None and not int(model.num_mtp_layers):
        raise ConfigError("rl.speculative='mtp' needs a model with MTP heads (model.num_mtp_layers >= 1)")
    if r.toy_latency_s < 0 or r.toy_latency_sigma < 0:
        raise ConfigError("rl.toy_latency_s and rl.toy_latency_sigma must be >= 0")
    if r.replay_threshold < 0:
        raise ConfigError("rl.replay_threshold must be >= 0 (0 = never replace replayed experts)")
    _validate_behaviour_weights(r, ConfigError)
    _validate_summary(r, model, ConfigError)
    if model is not None and context_window(r) + 1 > model.max_position_embeddings:
        name = "context_window" if r.context_window else "max_total_tokens"
        raise ConfigError(f"rl.{name}={context_window(r)} exceeds model.max_position_embeddings"
                          f"={model.max_position_embeddings} (the sampler needs {name} + 1 positions)")


def _validate_behaviour_weights(r, ConfigError) -> None:
    from c2jax.rl.rewards import BEHAVIOUR_KEYS, GRADED_KEYS
    for key, w in r.behaviour_weights.items():
        if key not in BEHAVIOUR_KEYS + GRADED_KEYS:
            raise ConfigError(f"unknown config key 'rl.behaviour_weights.{key}'; the harness reports "
                              f"{BEHAVIOUR_KEYS + GRADED_KEYS}")
        if not (isinstance(w, (int, float)) and 0 <= float(w) < float("inf")):
            raise ConfigError(f"rl.behaviour_weights.{key} must be a finite number >= 0 (0 = off), got {w!r}")


def _validate_ray(r, ConfigError) -> None:
    if int(r.get("ray_host_devices", 0)) < 0:
        raise ConfigError(f"rl.ray_host_devices must be >= 0 (0 = the process's own devices), got {r.ray_host_devices}")
    for key in ("ray_samplers", "ray_env_actors", "ray_num_cpus"):
        if int(r[key]) < 1:
            raise ConfigError(f"rl.{key} must be >= 1, got {r[key]}")
    for key in ("ray_learner_gpus", "ray_sampler_gpus"):
        if float(r[key]) < 0:
            raise ConfigError(f"rl.{key} must be >= 0, got {r[key]}")
    if not isinstance(r.ray_address, str):
        raise ConfigError(f"rl.ray_address must be a string (\"\" = a local cluster), got {r.ray_address!r}")
    if r.backend == "ray" and not r.ray_address and r.ray_num_cpus < 1 + r.ray_samplers:
        raise ConfigError(f"rl.ray_num_cpus={r.ray_num_cpus} cannot hold the learner and rl.ray_samplers="
                          f"{r.ray_samplers} sampler actors (1 CPU each): raise it to {1 + r.ray_samplers}")


def context_window(r) -> int:
    """Tokens one generation's context may hold: rl.context_window, else rl.max_total_tokens."""
    return int(r.context_window or r.max_total_tokens)


def summaries_on(r) -> bool:
    return r.env == "harness" and r.summary_method != "none"


def _validate_summary(r, model, ConfigError) -> None:
    if r.summary_method not in SUMMARY_METHODS:
        raise ConfigError(f"rl.summary_method must be one of {SUMMARY_METHODS}, got {r.summary_method!r}")
    if r.context_window < 0:
        raise ConfigError(f"rl.context_window must be >= 0 (0 = rl.max_total_tokens), got {r.context_window}")
    if r.context_window > r.max_total_tokens:
        raise ConfigError(f"rl.context_window={r.context_window} exceeds rl.max_total_tokens={r.max_total_tokens} "
                          "(the budget of the whole chain)")
    if r.summary_method == "none":
        return
    if r.env != "harness":
        raise ConfigError(f"rl.summary_method={r.summary_method!r} needs rl.env='harness' (got {r.env!r})")
    for key in ("summary_trigger_tokens", "max_summaries", "max_summary_tokens"):
        if int(r[key]) < 1:
            raise ConfigError(f"rl.{key} must be >= 1 with rl.summary_method={r.summary_method!r}, got {r[key]}")
    w = context_window(r)
    if r.summary_trigger_tokens >= w:
        raise ConfigError(f"rl.summary_trigger_tokens={r.summary_trigger_tokens} must be < the context window "
                          f"({w}; rl.context_window, else rl.max_total_tokens): the summary is written in the room "
                          "above the trigger")
    if r.sampler_slots < r.env_workers:
        raise ConfigError(f"rl.sampler_slots={r.sampler_slots} must be >= rl.env_workers={r.env_workers} with "
                          "summaries on: each episode keeps its cache slot so the summary decodes on the live cache")


register_section("rl", rl_defaults, lambda r, cfg: validate_rl(r, cfg.model))
