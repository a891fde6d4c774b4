"""Config loading (ml_collections `get_config(arg)` files), CLI overrides and validation.

A config file defines `get_config(arg: str | None) -> ConfigDict`. Every field has a default
with a one-line comment; presets override only what differs. Validation runs before anything
compiles and names the offending field.

This module is low in the layers (docs/ARCHITECTURE.md): it defines the sections every layer
reads (model, mesh, train) and imports nothing above it. The sections that belong to higher
layers (data, eval, rl) register themselves here when their module is imported
(`register_section` in c2jax.data.config, c2jax.evals.config, c2jax.rl.config);
`import c2jax.sections` imports them all, and entry points (the CLI, c2jax.pipeline, scripts,
tests/conftest.py) do so before they build a config. `default_config()` and `validate()` raise a
ConfigError saying so when one of SECTIONS is not registered.
"""
from __future__ import annotations

import ast
import importlib.util
import math
import os
from typing import Any, Callable, Sequence

import ml_collections

from c2jax.errors import ConfigError  # also importable from here, as before


def model_defaults() -> ml_collections.ConfigDict:
    """Defaults of `config.model` (a tiny Qwen3-MoE-shaped CPU model)."""
    m = ml_collections.ConfigDict()
    m.name = "tiny"                    # preset name, for logs
    m.vocab_size = 512                 # vocabulary size (embedding rows)
    m.hidden_size = 64                 # model width D
    m.num_layers = 2                   # decoder layers
    m.first_k_dense = 0                # leading layers with a dense MLP instead of MoE
    m.intermediate_size = 128          # dense SwiGLU width
    m.moe_intermediate_size = 32       # per-expert SwiGLU width
    m.num_experts = 8                  # routed experts (0 = dense model)
    m.num_experts_per_tok = 2          # top-k
    m.num_shared_experts = 0           # always-on shared experts (width moe_intermediate_size each)
    m.router = "softmax"               # "softmax" (Qwen3) or "sigmoid" (DeepSeek-V3/Kimi)
    m.norm_topk_prob = True            # renormalize the chosen k weights to sum to 1
    m.routed_scaling_factor = 1.0      # multiplies the combine weights (2.827 for Kimi K2)
    m.n_group = 1                      # expert groups for group-limited routing
    m.topk_group = 1                   # groups kept per token
    m.router_bias = False              # aux-loss-free per-expert selection bias (sigmoid router)
    m.bias_update_rate = 1e-3          # step size of the aux-loss-free bias update (0 = off)
    m.load_balance_loss_weight = 0.0   # Switch-style load-balance loss weight
    m.router_z_loss_weight = 0.0       # router z-loss weight
    m.moe_dispatch = "dropless"        # training forwards: "dropless" or "capacity" (drops past capacity; logged)
    m.capacity_factor = 2.0            # capacity per expert = factor * tokens * k / experts (moe_dispatch="capacity")
    m.replay_threshold = 0.0           # router replay: forced experts scoring < thr * own k-th score are replaced (0 = never)
    m.attention = "gqa"                # "gqa" (Qwen3) or "mla" (DeepSeek-V3/Kimi)
    m.num_heads = 4                    # query heads
    m.num_kv_heads = 2                 # GQA key/value heads
    m.head_dim = 16                    # GQA head dim
    m.qk_norm = True                   # GQA: RMSNorm on q and k per head (Qwen3)
    m.attention_bias = False           # GQA: bias on q/k/v projections
    m.q_lora_rank = 0                  # MLA: query compression rank (0 = direct projection)
    m.kv_lora_rank = 32                # MLA: key/value latent dim C (cached)
    m.qk_nope_head_dim = 16            # MLA: per-head q/k dims without position
    m.qk_rope_head_dim = 8             # MLA: per-head q/k dims with RoPE (k part shared, cached)
    m.v_head_dim = 16                  # MLA: per-head value dim
    m.rope_interleave = True           # MLA: RoPE on interleaved pairs (DeepSeek layout)
    m.rope_theta = 10000.0             # RoPE base
    m.rope_scaling = "none"            # "none" or "yarn"
    m.yarn_factor = 1.0                # YaRN context extension factor
    m.yarn_original_max_position = 4096  # YaRN pre-extension context
    m.yarn_beta_fast = 32.0            # YaRN ramp parameter
    m.yarn_beta_slow = 1.0             # YaRN ramp parameter
    m.yarn_mscale = 1.0                # YaRN mscale
    m.yarn_mscale_all_dim = 0.0        # YaRN mscale_all_dim (DeepSeek: also scales the softmax)
    m.max_position_embeddings = 4096   # longest supported position
    m.rms_norm_eps = 1e-6              # RMSNorm epsilon
    m.tie_embeddings = False           # share the input embedding with the output head
    m.num_mtp_layers = 0               # multi-token-prediction heads (DeepSeek-V3 style)
    m.init_std = 0.02                  # normal init std
    m.dtype = "float32"                # compute dtype ("bfloat16" on accelerators)
    m.param_dtype = "float32"          # master weight dtype
    m.quant = "none"                   # expert matmul quantization: none, int8, mxfp8, nvfp4
    m.kernels = kernels_defaults()     # implementation per op (c2jax.ops): "auto" or a registered name
    # grouped-matmul tiles of the Mosaic gmm / tgmm: "auto" (pallas_kernels.gmm.tpu.choose_tiling per
    # call shape) or "TM,TK,TN" for every call (clamped to each operand)
    m.gmm_tiling = "auto"
    m.head_chunks = 1                  # training's output head + loss over the sequence in this many chunks, each rematerialized
    m.remat = "none"                   # what a layer keeps for backward: REMAT_POLICIES (c2jax.ops.remat)
    m.scan_unroll = 1                  # layers per iteration of the layer scan (>= the layer count: no loop)
    return m


# model.remat: what each decoder layer keeps for the backward pass (c2jax.ops.remat says what each saves)
REMAT_POLICIES = ("none", "full", "save_qkv_proj", "save_attention", "save_matmuls", "save_matmuls_attention",
                  "save_dots")

# The ops the model calls through c2jax.ops, each chosen by model.kernels.<op>.
KERNEL_OPS = ("attention", "decode_attention", "mla_cache_attention", "experts", "matmul", "norm", "token_nll",
              "head_grad")


def kernels_defaults() -> ml_collections.ConfigDict:
    """model.kernels: "auto" (c2jax.ops' table for the target) or an implementation name per op;
    `python -m c2jax.ops` lists the names."""
    k = ml_collections.ConfigDict()
    for op in KERNEL_OPS:
        k[op] = "auto"
    return k


def mesh_defaults() -> ml_collections.ConfigDict:
    """Defaults of `config.mesh`: named axes, their sizes and the logical->mesh rules."""
    m = ml_collections.ConfigDict()
    m.axes = ("data", "fsdp", "context", "expert")  # mesh axis names
    m.shape = (-1, 1, 1, 1)            # sizes; one -1 takes the remaining devices
    m.cp_impl = "allgather"            # GQA context parallelism: "allgather" K/V or "ring" (ppermute); MLA always gathers latents
    m.attention_chunk = 0              # CP attention: local queries in chunks of this many, each rematerialized (0 = one block)
    m.ep_capacity_factor = 0.0         # EP all-to-all rows per peer = factor * local assignments / EP size (0 = dropless worst case)
    m.ep_token_chunks = 1              # EP: dispatch the local tokens in this many chunks, each rematerialized (capacity per chunk)
    # EP exchange: "capacity" sends factor * A / W rows to every peer (padded; an assignment past
    # its peer's share is dropped; MXFP8 rows when model.quant is set); "ragged" sends only the
    # routed rows (ragged all-to-all) into receive buffers of factor * A rows (0: W * T * min(K, E / W), dropless),
    # dropping only what overflows a receiver; rows travel in the model dtype
    m.ep_exchange = "capacity"
    # logical axis name -> mesh axes (None = replicated); used for params and activations.
    # Expert weights [E, D, F]: E over `experts` (the EP group) then `expert_fsdp`, D over
    # `expert_embed`, F over `expert_mlp`; the last three are FSDP storage, gathered inside the MoE.
    # FSDP on E (`expert_fsdp`) keeps every local block's minor dim whole (D / n would be padded
    # to the TPU's 128-lane tiles once it is under 128 wide)
    m.rules = (
        ("batch", ("data", "fsdp", "expert")),
        ("length", "context"),
        ("embed", "fsdp"),
        ("heads", None), ("kv_heads", None), ("head_dim", None), ("kv_latent", None),
        ("q_latent", None), ("mlp", None), ("vocab", None), ("layers", None),
        ("experts", "expert"), ("expert_fsdp", None), ("expert_embed", None), ("expert_mlp", None),
    )
    return m


def default_config() -> ml_collections.ConfigDict:
    """The full default config; presets and stage configs override parts of it."""
    c = ml_collections.ConfigDict()
    c.seed = 0                         # global seed (init, data order, sampling)
    c.model = model_defaults()
    c.mesh = mesh_defaults()
    t = ml_collections.ConfigDict()
    t.steps = 20                       # optimizer steps
    t.batch_size = 8                   # global batch (sequences)
    t.seq_len = 128                    # tokens per packed row
    t.lr = 3e-3                        # peak learning rate
    t.warmup_steps = 5                 # linear warmup
    t.min_lr_ratio = 0.1               # cosine decays to lr * min_lr_ratio
    t.b1 = 0.9                         # Adam beta1
    t.b2 = 0.95                        # Adam beta2
    t.adam_eps = 1e-8                  # Adam epsilon (larger damps steps on parameters whose gradients are tiny or noise)
    t.weight_decay = 0.1               # decoupled weight decay (not on norms/biases/embeddings? see train.optimizer)
    t.grad_clip = 1.0                  # global-norm clip (0 = off)
    t.optimizer = "auto"               # AdamW implementation (c2jax.ops.optimizer): "auto", "optax_adamw", "cpu_fused_adamw"
    t.grad_accum = 1                   # microbatches per step
    t.z_loss = 0.0                     # output logit z-loss weight
    t.mtp_loss_weight = 0.3            # MTP self-distillation weight (when num_mtp_layers > 0)
    t.max_bad_steps = 5                # stop after this many non-finite steps in a row
    t.log_every = 1                    # metrics every N steps
    t.eval_every = 10                  # held-out eval every N steps
    t.checkpoint_every = 10            # checkpoint every N steps
    t.keep_checkpoints = 3             # checkpoints kept
    t.init_from = ""                   # run dir (its latest checkpoint) or HF dir to start from ("" = random init)
    t.stage = "cpt"                    # "cpt" (packed corpus), "extend" (longer context), "sft" (chats)
    t.eval_batches = 8                 # held-out batches per eval (0 = whole held-out split)
    t.peak_flops = 0.0                 # per-device peak FLOP/s for MFU (0 = measure an XLA matmul)
    t.async_checkpoint = True          # orbax async saves
    c.train = t
    for name in _section_order():
        c[name] = _SECTIONS[name][0]()
    return c


# ----------------------------------------------------------------------------- sections of higher layers

# The sections a full config has beyond model / mesh / train, in the order default_config() adds
# them (a run's config.json keeps it); each is registered by the module that owns it
# (c2jax.data.config, c2jax.evals.config, c2jax.rl.config). validate() checks rl before data.
SECTIONS = ("data", "eval", "rl")
_VALIDATION_ORDER = ("rl", "data", "eval")
_SECTIONS: dict[str, tuple[Callable[[], ml_collections.ConfigDict], Callable | None]] = {}


def register_section(name: str, defaults_fn: Callable[[], ml_collections.ConfigDict],
                     validate_fn: Callable[[ml_collections.ConfigDict, ml_collections.ConfigDict], None] | None = None
                     ) -> None:
    """Make `cfg.<name>` part of default_config() (from defaults_fn()) and of validate()
    (validate_fn(cfg.<name>, cfg), raising ConfigError naming the field). Called once at import
    by the module that owns the section; registering a name again replaces it."""
    _SECTIONS[name] = (defaults_fn, validate_fn)


def _section_order() -> list[str]:
    missing = [n for n in SECTIONS if n not in _SECTIONS]
    if missing:
        raise ConfigError(f"config section(s) {missing} are not registered: `import c2jax.sections` (it imports "
                          f"c2jax.data.config, c2jax.evals.config and c2jax.rl.config) before building or "
                          f"validating a config")
    return list(SECTIONS) + [n for n in _SECTIONS if n not in SECTIONS]


# ----------------------------------------------------------------------------- loading


def call_config_file(spec: str):
    """Import `path/to/file.py[:arg]` and return `get_config(arg)` (or `get_config()` when no arg
    is given). A path that itself contains ':' is taken whole when that file exists."""
    path, arg = spec, None
    if ":" in spec and not os.path.exists(spec):
        path, _, arg = spec.partition(":")
    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_c2jax_cfg_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"{e.filename or path}:{e.lineno}: syntax error: {e.msg}; fix the config file") from None
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} defines no get_config(arg)")
    return module.get_config(arg) if arg else module.get_config()


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """Load `path/to/file.py[:arg]` by calling its `get_config(arg)`."""
    cfg = call_config_file(spec)
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"{spec}: get_config must return an ml_collections.ConfigDict")
    return cfg


def _parse_value(text: str, current: Any, key: str) -> Any:
    if isinstance(current, bool):
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(f"--config.{key}={text!r}: expected a boolean (true/false)")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"--config.{key}={text!r}: expected an integer") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"--config.{key}={text!r}: expected a number") from None
    if isinstance(current, str):
        return text
    if isinstance(current, (tuple, list)) or current is None:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            if current is None:
                return text
            raise ConfigError(f"--config.{key}={text!r}: expected a Python literal tuple") from None
        return tuple(value) if isinstance(value, list) else value
    raise ConfigError(f"--config.{key}: cannot override a field of type {type(current).__name__}")


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: dict[str, Any] | Sequence[str]) -> None:
    """Apply `key=value` strings (CLI) or a dict of dotted keys to cfg, in place."""
    items = overrides.items() if isinstance(overrides, dict) else (_split_override(o) for o in overrides)
    for key, value in items:
        node = cfg
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
                raise ConfigError(f"unknown config key {key!r}: no section {'.'.join(parts[:i + 1])!r}")
            node = node[part]
        leaf = parts[-1]
        if leaf not in node:
            near = [k for k in node.keys() if k[:3] == leaf[:3]]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")
        current = node[leaf]
        if isinstance(value, str) and not isinstance(current, str):
            value = _parse_value(value, current, key)
        elif isinstance(current, bool) != isinstance(value, bool) and current is not None:
            raise ConfigError(f"config key {key!r}: expected {type(current).__name__}, got {value!r}")
        elif isinstance(current, float) and isinstance(value, int):
            value = float(value)
        with node.ignore_type():
            node[leaf] = value


def _split_override(text: str) -> tuple[str, str]:
    if text.startswith("--"):
        text = text[2:]
    if text.startswith("config."):
        text = text[len("config."):]
    key, eq, value = text.partition("=")
    if not eq:
        raise ConfigError(f"override {text!r} must look like --config.section.key=value")
    return key, value


def load_config(spec: str | None, overrides: dict[str, Any] | Sequence[str] = (),
                validate_devices: int | None = None) -> ml_collections.ConfigDict:
    """Load a config file (or the defaults when spec is None), apply overrides, validate."""
    cfg = load_config_file(spec) if spec else default_config()
    apply_overrides(cfg, overrides)
    validate(cfg, num_devices=validate_devices)
    return cfg


def merge_into_defaults(updates: dict[str, Any], base: ml_collections.ConfigDict | None = None
                        ) -> ml_collections.ConfigDict:
    """Defaults with dotted-key updates applied; what preset files call."""
    cfg = base if base is not None else default_config()
    apply_overrides(cfg, updates)
    return cfg


# ----------------------------------------------------------------------------- validation

_TYPES = {
    "model": model_defaults(),
    "mesh": mesh_defaults(),
}


def _check_types(section: str, got: ml_collections.ConfigDict, ref: ml_collections.ConfigDict):
    for key in got.keys():
        if key not in ref:
            raise ConfigError(f"unknown config key '{section}.{key}'")
        want, value = ref[key], got[key]
        if isinstance(want, bool):
            ok = isinstance(value, bool)
        elif isinstance(want, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(want, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif isinstance(want, str):
            ok = isinstance(value, str)
        elif isinstance(want, tuple):
            ok = isinstance(value, (tuple, list))
        else:
            ok = True
        if not ok:
            raise ConfigError(f"config key '{section}.{key}' must be {type(want).__name__}, got {value!r}")


def _check_kernels(m) -> None:
    kernels = m.get("kernels", None)
    if kernels is None:
        return
    unknown = sorted(set(kernels.keys()) - set(KERNEL_OPS))
    if unknown:
        raise ConfigError(f"model.kernels has unknown ops {unknown}; the ops are {list(KERNEL_OPS)}")
    for op in KERNEL_OPS:
        if not isinstance(kernels.get(op, "auto"), str):
            raise ConfigError(f"model.kernels.{op} must be 'auto' or an implementation name (a string), "
                              f"got {kernels.get(op)!r}")


def _choice(section: str, key: str, value: str, options: Sequence[str]):
    if value not in options:
        raise ConfigError(f"config key '{section}.{key}' = {value!r}; choose one of {list(options)}")


def gmm_tiling_of(m) -> tuple[int, int, int] | None:
    """model.gmm_tiling as the grouped matmuls take it: None ("auto": chosen per call shape) or
    (tm, tk, tn); ConfigError for anything else."""
    s = str(m.get("gmm_tiling", "auto")) if hasattr(m, "get") else "auto"
    if s == "auto":
        return None
    try:
        tiles = tuple(int(x) for x in s.split(","))
    except ValueError:
        tiles = ()
    if len(tiles) != 3 or tiles[0] < 8 or tiles[0] % 8 or any(t < 128 or t % 128 for t in tiles[1:]):
        raise ConfigError(f"model.gmm_tiling={s!r}: 'auto' or 'TM,TK,TN' with TM a multiple of 8 and TK, TN "
                          "multiples of 128 (the TPU's sublane and lane tiles)")
    return tiles


def validate_model(m: ml_collections.ConfigDict) -> None:
    """Check a model config for consistency; raise ConfigError naming the field."""
    _check_types("model", m, model_defaults())
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads"):
        if m[key] <= 0:
            raise ConfigError(f"model.{key} must be positive, got {m[key]}")
    _choice("model", "router", m.router, ("softmax", "sigmoid"))
    _choice("model", "attention", m.attention, ("gqa", "mla"))
    _choice("model", "moe_dispatch", m.moe_dispatch, ("dropless", "capacity"))
    _choice("model", "rope_scaling", m.rope_scaling, ("none", "yarn"))
    _choice("model", "dtype", m.dtype, ("float32", "bfloat16", "float16"))
    _choice("model", "param_dtype", m.param_dtype, ("float32", "bfloat16"))
    _choice("model", "quant", m.quant, ("none", "int8", "mxfp8", "nvfp4"))
    _check_kernels(m)
    gmm_tiling_of(m)
    _choice("model", "remat", m.remat, REMAT_POLICIES)
    if m.scan_unroll < 1:
        raise ConfigError(f"model.scan_unroll must be >= 1, got {m.scan_unroll}")
    if m.get("head_chunks", 1) < 1:
        raise ConfigError(f"model.head_chunks must be >= 1 (1 = the whole sequence at once), got {m.head_chunks}")
    if not 0 <= m.first_k_dense <= m.num_layers:
        raise ConfigError(f"model.first_k_dense={m.first_k_dense} must be in [0, num_layers={m.num_layers}]")
    if m.num_experts < 0:
        raise ConfigError(f"model.num_experts must be >= 0, got {m.num_experts}")
    if m.num_experts > 0:
        if not 1 <= m.num_experts_per_tok <= m.num_experts:
            raise ConfigError(f"model.num_experts_per_tok={m.num_experts_per_tok} must be in "
                              f"[1, num_experts={m.num_experts}] (top-k > experts)")
        if m.num_experts % m.n_group:
            raise ConfigError(f"model.n_group={m.n_group} must divide model.num_experts={m.num_experts}")
        if not 1 <= m.topk_group <= m.n_group:
            raise ConfigError(f"model.topk_group={m.topk_group} must be in [1, n_group={m.n_group}]")
        if m.n_group > 1 and m.num_experts // m.n_group < 2:
            raise ConfigError("model.n_group too large: group-limited routing needs >= 2 experts per group")
        if m.n_group > 1 and m.num_experts_per_tok > m.topk_group * (m.num_experts // m.n_group):
            raise ConfigError(f"model.num_experts_per_tok={m.num_experts_per_tok} exceeds the experts in "
                              f"topk_group={m.topk_group} groups")
        if m.moe_intermediate_size <= 0:
            raise ConfigError("model.moe_intermediate_size must be positive for an MoE model")
        if m.capacity_factor <= 0:
            raise ConfigError("model.capacity_factor must be positive")
        if m.router_bias and m.router != "sigmoid":
            raise ConfigError("model.router_bias (aux-loss-free balancing) needs model.router='sigmoid'")
    if m.attention == "gqa":
        if m.num_kv_heads <= 0 or m.num_heads % m.num_kv_heads:
            raise ConfigError(f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}")
        if m.head_dim % 2:
            raise ConfigError(f"model.head_dim={m.head_dim} must be even for RoPE")
    else:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if m[key] <= 0:
                raise ConfigError(f"model.{key} must be positive for MLA, got {m[key]}")
        if m.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if m.q_lora_rank < 0:
            raise ConfigError("model.q_lora_rank must be >= 0 (0 = no query compression)")
    if m.rope_scaling == "yarn":
        if m.yarn_factor < 1.0:
            raise ConfigError(f"model.yarn_factor={m.yarn_factor} must be >= 1")
        if m.yarn_original_max_position <= 0:
            raise ConfigError("model.yarn_original_max_position must be positive")
    if m.num_mtp_layers < 0:
        raise ConfigError("model.num_mtp_layers must be >= 0")


def mesh_shape(mesh_cfg: ml_collections.ConfigDict, num_devices: int) -> tuple[int, ...]:
    """Resolve the mesh shape (one -1 allowed) for num_devices; raise ConfigError if impossible."""
    axes, shape = tuple(mesh_cfg.axes), tuple(mesh_cfg.shape)
    if len(axes) != len(shape):
        raise ConfigError(f"mesh.axes has {len(axes)} names but mesh.shape has {len(shape)} sizes")
    if len(set(axes)) != len(axes):
        raise ConfigError(f"mesh.axes has duplicate names: {axes}")
    if sum(1 for s in shape if s == -1) > 1:
        raise ConfigError("mesh.shape may contain at most one -1")
    if any(s == 0 or s < -1 for s in shape):
        raise ConfigError(f"mesh.shape entries must be positive or -1, got {shape}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ConfigError(f"mesh.shape {shape}: fixed axes ({known}) do not divide the {num_devices} devices")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ConfigError(f"mesh.shape {shape} (product {math.prod(shape)}) does not match the device "
                          f"count {num_devices}; set --config.mesh.shape so the product is {num_devices}")
    return shape


def validate_mesh(mesh_cfg: ml_collections.ConfigDict, model_cfg, num_devices: int | None) -> None:
    """Check mesh axes, rules and (when num_devices is given) shape against the model."""
    _check_types("mesh", mesh_cfg, mesh_defaults())
    if "ep_exchange" in mesh_cfg:
        _choice("mesh", "ep_exchange", mesh_cfg.ep_exchange, ("capacity", "ragged"))
    axes = set(mesh_cfg.axes)
    for rule in mesh_cfg.rules:
        if len(rule) != 2:
            raise ConfigError(f"mesh.rules entry {rule!r} must be (logical_name, mesh_axes)")
        if rule[0] == "expert_weights":
            raise ConfigError("mesh.rules may not name 'expert_weights': it is derived from the 'experts' "
                              "(EP group) and 'expert_fsdp' rules; set those instead")
        targets = rule[1] if isinstance(rule[1], (tuple, list)) else (rule[1],)
        for t in targets:
            if t is not None and t not in axes:
                raise ConfigError(f"mesh.rules maps {rule[0]!r} to unknown mesh axis {t!r}; axes are {sorted(axes)}")
    if num_devices is None:
        return
    shape = dict(zip(mesh_cfg.axes, mesh_shape(mesh_cfg, num_devices)))
    if model_cfg.num_experts > 0 and "expert" in shape and model_cfg.num_experts % shape["expert"]:
        raise ConfigError(f"model.num_experts={model_cfg.num_experts} is not divisible by the expert "
                          f"axis size {shape['expert']}; change mesh.shape or model.num_experts")


def validate(cfg: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Validate a whole config before anything compiles."""
    validate_model(cfg.model)
    if "mesh" in cfg:
        validate_mesh(cfg.mesh, cfg.model, num_devices)
    if any(name in cfg for name in SECTIONS):
        order = _section_order()
        for name in sorted(order, key=lambda n: _VALIDATION_ORDER.index(n) if n in _VALIDATION_ORDER else len(order)):
            check = _SECTIONS[name][1]
            if name in cfg and check is not None:
                check(cfg[name], cfg)
    if "train" in cfg:
        t = cfg.train
        if "stage" in t:
            _choice("train", "stage", t.stage, ("cpt", "extend", "sft"))
        for key in ("steps", "batch_size", "seq_len", "grad_accum"):
            if key in t and t[key] <= 0:
                raise ConfigError(f"train.{key} must be positive, got {t[key]}")
        if "grad_accum" in t and t.batch_size % t.grad_accum:
            raise ConfigError(f"train.batch_size={t.batch_size} must be divisible by train.grad_accum={t.grad_accum}")
        if "seq_len" in t and t.seq_len > cfg.model.max_position_embeddings:
            raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings="
                              f"{cfg.model.max_position_embeddings}")
        if "lr" in t and t.lr <= 0:
            raise ConfigError(f"train.lr must be positive, got {t.lr}")
        if "adam_eps" in t and not t.adam_eps > 0:
            raise ConfigError(f"train.adam_eps must be positive, got {t.adam_eps}")
        if "optimizer" in t:
            _choice("train", "optimizer", t.optimizer, ("auto", "optax_adamw", "cpu_fused_adamw"))
