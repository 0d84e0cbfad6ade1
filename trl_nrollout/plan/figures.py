"""The figures of ``trl-nrollout plan`` as a library: a recipe's options (YAML and overrides) -> the
:class:`~trl_nrollout.plan.layout.RolloutLayout` and, given a model, its :class:`~trl_nrollout.plan.memory.MemoryEstimate`.

The command line (:mod:`trl_nrollout.cli`) only parses arguments and prints; :mod:`trl_nrollout.recipe.hub` uses the same
functions for a recipe's card. Heavy modules (torch, transformers) are imported only for a memory estimate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trl_nrollout.plan.layout import LayoutError, RolloutLayout
from trl_nrollout.plan.readers import PlanError, engine_utilization
from trl_nrollout.plan.recipe_file import RecipeFileError, read_recipe

#: (option, type, help) of every ``plan`` option; each is a flag (``--rollout-tp-size`` or ``--rollout_tp_size``)
#: and a recipe YAML key (``rollout_tp_size``). Flags override the YAML.
PLAN_OPTIONS: list[tuple[str, type, str]] = [
    ("num_processes", int, "World size (accelerate's num_processes). Or give n_gpus_per_node and nnodes."),
    ("n_gpus_per_node", int, "GPUs per node (verl trainer.n_gpus_per_node); world = n_gpus_per_node x nnodes."),
    ("nnodes", int, "Number of nodes (verl trainer.nnodes). Default 1."),
    ("rollout_tp_size", int, "Ranks per vLLM engine (verl rollout.tensor_model_parallel_size). Default 1."),
    ("train_batch_size", int, "Prompts per rollout step (verl data.train_batch_size). Required."),
    ("rollout_n", int, "Samples per prompt (verl rollout.n, TRL num_generations). Required."),
    ("ppo_mini_batch_size", int, "Prompts per optimizer step (verl semantics). Default: train_batch_size."),
    ("ppo_micro_batch_size_per_device", int, "Samples per device per training forward. Default: the whole "
                                             "mini batch of a rank."),
    ("ppo_epochs", int, "Passes over each rollout. Default 1."),
    ("log_prob_micro_batch_size", int, "Old-policy log-prob micro batch, global: divided by the data-parallel "
                                       "size (verl's older normalization)."),
    ("log_prob_micro_batch_size_per_device", int, "Old-policy log-prob micro batch per device."),
    ("ref_log_prob_micro_batch_size", int, "Reference log-prob micro batch, global. Default: as the old pass."),
    ("ref_log_prob_micro_batch_size_per_device", int, "Reference log-prob micro batch per device."),
    ("log_prob_max_token_len_per_device", int, "Token budget per log-prob forward (dynamic micro batches)."),
    ("ref_log_prob_max_token_len_per_device", int, "Token budget per reference forward."),
    ("sequence_parallel_size", int, "Ulysses sequence-parallel size. Default 1."),
    ("adv_estimator", str, "Advantage estimator (grpo, rloo, reinforce_plus_plus, ...). Default grpo."),
    ("model_name_or_path", str, "A builtin: name, local folder or hub id: adds the memory estimate."),
    ("max_prompt_length", int, "Longest prompt in tokens (memory estimate). Default 512."),
    ("max_completion_length", int, "Longest completion in tokens (memory estimate). Default 512."),
    ("dtype", str, "Engine dtype: bfloat16, float16, float32, fp8 or auto (the config's). Default auto."),
    ("max_num_seqs", int, "Sequences an engine runs at once (rollout_max_num_seqs). Default 1024."),
    ("gpu_memory_gib", float, "GPU memory in GiB: checks that weights and KV cache fit."),
    ("gpu_memory_utilization", float, "Fraction of GPU memory vLLM may use (TRL vllm_gpu_memory_utilization). "
                                      "Default: the trainer's, 0.3 on a device shared with a trainer, 0.9 on "
                                      "rollout ranks."),
    ("device", str, "Device profile of --predict / --suggest: h100, h200, a100-40gb, a100-80gb, l40s, a profile "
                    "saved by --calibrate, or a profile JSON file."),
    ("prompt_tokens_mean", float, "Mean prompt length in tokens (--predict). Default: max_prompt_length."),
    ("completion_tokens_mean", float, "Mean completion length in tokens (--predict; the longest is "
                                      "max_completion_length). Default: max_completion_length (an upper bound)."),
    ("rollout_ranks", int, "Processes that only generate (the last ones); the others train. Default 0 "
                           "(colocated: every process trains and generates)."),
    ("rollout_lookahead", int, "With rollout_ranks: steps the engines generate ahead of the trainers (the trainer's "
                               "rollout_lookahead; default 1; 0: synchronous)."),
    ("trainer_sharding", str, "none, zero2, zero3, fsdp or zero3_offload (--predict): sharded parameters are "
                              "gathered per forward and optimizer states split over the ranks; zero3_offload keeps "
                              "the optimizer on the host (ZeRO-Offload). Default: the recipe's accelerate config's, "
                              "else none."),
    ("use_dynamic_bsz", bool, "Token-budgeted update micro batches (verl's name): each optimizer step's samples on a "
                              "rank cut into micro batches of at most ppo_max_token_len_per_device tokens. Default: "
                              "on when ppo_max_token_len_per_device is given."),
    ("ppo_max_token_len_per_device", int, "Tokens per update micro batch per device (prompt + completion; real "
                                          "tokens with padding-free rows). Turns use_dynamic_bsz on. Default with "
                                          "use_dynamic_bsz: from the model's size and the device's memory."),
    ("padding_free", bool, "Padding-free training rows (the trainer's padding_free; --predict). Default true (the "
                           "trainer's default where the model takes a block mask)."),
    ("rollout_partial", bool, "Partial rollouts (the trainer's rollout_partial): each engine keeps (1 + "
                              "rollout_partial_oversample) x its share of groups in flight: their KV cache is "
                              "counted. Default false."),
    ("rollout_partial_oversample", float, "With rollout_partial: extra groups in flight per group of an engine's "
                                          "share. Default 1.0 (the trainer's)."),
    ("lora_r", int, "Train rank-r LoRA adapters (TRL's use_peft / lora_r; --predict, --suggest): frozen base "
                    "weights, the adapters' optimizer states only. A recipe's use_peft: true means its lora_r "
                    "(default 16)."),
    ("rollout_lora_sync", str, "With lora_r: how the adapter reaches the engines (the trainer's rollout_lora_sync; "
                               "--predict): merged (the model's bytes per sync), adapter (the adapter's bytes, "
                               "generation at the device's LoRA slowdown) or auto (the cheaper step). Default auto."),
    ("gradient_checkpointing", bool, "TRL's gradient_checkpointing: the update's activation memory and the default "
                                     "token budget. Default true (TRL's)."),
    ("teacher_model_name_or_path", str, "On-policy distillation's teacher (the trainer's teacher_model_name_or_path; "
                                        "--predict, --suggest): its forward over the sampled tokens (and the "
                                        "old-policy pass it needs) and its weights, held as the reference model's "
                                        "are, are priced."),
]
#: recipe keys a plan reads that have no flag: the trainer (PPO's critic rows), the critic's micro batches, and
#: what --predict needs to know of the loss and the engine's sleep mode
RECIPE_ONLY_KEYS = ("trainer", "critic_ppo_micro_batch_size_per_device", "critic_ppo_max_token_len_per_device",
                    "use_kl_loss", "beta", "vllm_enable_sleep_mode", "use_peft", "teacher_backend",
                    "max_staleness")  # max_staleness: only to refuse its old meaning (the look-ahead)
LAYOUT_KEYS = (
    "num_processes", "n_gpus_per_node", "nnodes", "rollout_tp_size", "train_batch_size", "rollout_n",
    "ppo_mini_batch_size", "ppo_micro_batch_size_per_device", "ppo_epochs", "log_prob_micro_batch_size",
    "log_prob_micro_batch_size_per_device", "ref_log_prob_micro_batch_size",
    "ref_log_prob_micro_batch_size_per_device", "log_prob_max_token_len_per_device",
    "ref_log_prob_max_token_len_per_device", "sequence_parallel_size", "adv_estimator", "ppo_mini_batch_samples",
)
#: TRL's batch fields (a recipe without train_batch_size: the trainer derives the layout from them) and TRL's
#: defaults for them
TRL_BATCH_FIELDS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "steps_per_generation": None,
                    "generation_batch_size": None, "num_iterations": 1}
#: TRL names read from a recipe when the verl-named key is absent.
YAML_ALIASES = {
    "num_generations": "rollout_n",
    "vllm_tensor_parallel_size": "rollout_tp_size",
    "vllm_gpu_memory_utilization": "gpu_memory_utilization",
    "rollout_max_num_seqs": "max_num_seqs",  # the trainer's names of the engine's settings
    "rollout_dtype": "dtype",
}


def parse_bool(text: str | bool) -> bool:
    """A boolean flag's value: true / false, yes / no, on / off, 1 / 0 (any case)."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("true", "yes", "on", "1"):
        return True
    if value in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"{text!r} is not true or false")


def plan_options_of(recipe: dict[str, Any]) -> dict[str, Any]:
    """The options of a recipe (:func:`~trl_nrollout.plan.recipe_file.read_recipe`) that a plan reads, under
    their plan names (TRL's spellings mapped onto ours)."""
    known = {name for name, _, _ in PLAN_OPTIONS} | set(RECIPE_ONLY_KEYS) | set(TRL_BATCH_FIELDS)
    values = {k: v for k, v in recipe.items() if k in known}
    for alias, name in YAML_ALIASES.items():
        if alias in recipe and name not in values:
            values[name] = recipe[alias]
    return values


def plan_values(config: str | Path | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options of a plan: the recipe's (``config``: a local path; the command line resolves an ``hf://``
    reference through the Hub cache first), overridden by the non-None ``overrides`` (the flags given)."""
    try:
        recipe = read_recipe(config) if config is not None else {}
    except RecipeFileError as err:
        raise PlanError(str(err)) from None
    values = plan_options_of(recipe)
    if recipe.get("trainer") == "distill":  # one completion per prompt (TRL's), no group baseline: the config's layout
        values.setdefault("rollout_n", 1)
        values.setdefault("adv_estimator", "reinforce_plus_plus")
    launch = recipe.get("accelerate_config")
    if launch and values.get("trainer_sharding") is None and config is not None:
        sharding = sharding_of(Path(config).parent / str(launch))
        if sharding is not None:
            values["trainer_sharding"] = sharding
    for name, _, _ in PLAN_OPTIONS:
        if (overrides or {}).get(name) is not None:
            values[name] = overrides[name]
    return trl_batch_values(values)


def pool_factor(values: dict[str, Any]) -> float:
    """Groups an engine keeps in flight per group of its share: ``1 + rollout_partial_oversample`` (default 1.0, the
    trainer's) with ``rollout_partial``, else 1."""
    if not values.get("rollout_partial"):
        return 1.0
    extra = values.get("rollout_partial_oversample")
    extra = 1.0 if extra is None else float(extra)
    if not extra >= 0:
        raise PlanError(f"rollout_partial_oversample={extra!r} must be >= 0 (extra groups in flight per group of an "
                        "engine's share; the default is 1.0).")
    return 1.0 + extra


def sharding_of(accelerate_config: str | Path) -> str | None:
    """The trainer sharding an accelerate config launches (``none``, ``zero2``, ``zero3``, ``zero3_offload`` or
    ``fsdp``), or None where
    the file cannot be read (the plan then assumes none, as without a recipe)."""
    import yaml

    try:
        data = yaml.safe_load(Path(accelerate_config).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    kind = str(data.get("distributed_type", "")).upper()
    if kind == "DEEPSPEED":
        ds = data.get("deepspeed_config") or {}
        stage = int(ds.get("zero_stage", 0) or 0)
        if stage == 3 and str(ds.get("offload_optimizer_device", "none")).lower() == "cpu":
            return "zero3_offload"
        return "zero3" if stage == 3 else "zero2" if stage == 2 else "none"
    if kind == "FSDP":
        return "fsdp"
    return "none"


def n_values(text: str | None) -> tuple[int, ...]:
    from trl_nrollout.plan.memory import DEFAULT_N_VALUES

    if text is None:
        return DEFAULT_N_VALUES
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise PlanError(f"--n-values={text!r} must be comma-separated positive integers, e.g. 1,4,8,12,16.") from None
    if not values or min(values) < 1:
        raise PlanError(f"--n-values={text!r} must be comma-separated positive integers, e.g. 1,4,8,12,16.")
    return values


def split_rollout_ranks(values: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]], dict] | None:
    """With ``rollout_ranks``: the trainers' plan options (their processes, no engine among them), the rows that
    describe the rollout ranks, and those figures as JSON; None without rollout ranks. Raises :class:`PlanError`
    for a split that cannot work (:func:`~trl_nrollout.rollout.bridge.roles_refusal`), with its fix."""
    from trl_nrollout.plan.roles import lookahead_spelling_refusal, roles_refusal

    r = values.get("rollout_ranks") or 0
    if not r:
        if (values.get("rollout_ranks") or 0) < 0:
            raise PlanError(roles_refusal(1, r, 1))
        return None
    nnodes = values.get("nnodes") or 1
    world = values.get("num_processes") or ((values.get("n_gpus_per_node") or 1) * nnodes)
    local = values.get("n_gpus_per_node") or max(1, world // nnodes)
    tp = values.get("rollout_tp_size") or 1
    why = roles_refusal(world, r, local, tp)
    if why:
        raise PlanError(why)
    trainers = world - r
    engines = r // tp
    prompts = values.get("train_batch_size") or 0
    n = values.get("rollout_n") or 0
    if (why := lookahead_spelling_refusal(r, values.get("max_staleness"), values.get("rollout_lookahead"))):
        raise PlanError(why)
    ahead = values.get("rollout_lookahead")
    ahead = 1 if ahead is None else ahead
    engine_ranks = [list(range(trainers + e * tp, trainers + (e + 1) * tp)) for e in range(engines)]
    trainer_values = {**values, "num_processes": trainers, "rollout_tp_size": 1,
                      "nnodes": 1 if world == local else nnodes - r // local, "n_gpus_per_node": None}
    rows = [
        ("launch", f"{world} processes = {trainers} trainers (global ranks 0..{trainers - 1}) + {r} rollout ranks "
                   f"(global ranks {trainers}..{world - 1})"),
        ("rollout engines", f"{r} rollout ranks / rollout_tp_size={tp} = {engines}; ranks "
                            + ", ".join("(" + ",".join(map(str, e)) + ")" for e in engine_ranks[:8])
                            + (" ..." if engines > 8 else "")),
        ("prompts per engine", f"{prompts} / {engines} = {prompts / engines:g} ({prompts * n} samples per step in "
                               "all; whole groups per engine)"),
        ("generation", "synchronous (rollout_lookahead=0): the trainers wait for each step's samples" if ahead == 0
         else f"{ahead} step(s) ahead (rollout_lookahead={ahead}): step k+{ahead}'s samples are generated "
              f"while the trainers train step k, by a policy {ahead} optimizer step(s) older"),
        ("weights", "trainer rank 0 -> every rollout rank after each optimizer step, over torch.distributed "
                    "(gloo), from a thread while the trainers go on"),
    ]
    figures = {"processes": world, "trainers": trainers, "rollout_ranks": r, "rollout_tp_size": tp,
               "engines": engines, "engine_ranks": engine_ranks, "rollout_lookahead": ahead,
               "cross_node": world > local}
    return trainer_values, rows, figures


def trl_batch_values(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the verl-named layout a recipe of TRL's batch fields trains with, derived as the trainer's
    config derives it (``NRolloutConfig._derive_verl_fields``): where ``train_batch_size`` is not set and TRL's
    fields (``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``steps_per_generation``,
    ``generation_batch_size``, ``num_iterations``; ``num_generations`` is read as ``rollout_n``) are, with TRL's
    defaults for the others. A :class:`PlanError` where TRL's own rule fails (groups split)."""
    if values.get("train_batch_size") is not None or not any(values.get(k) is not None for k in TRL_BATCH_FIELDS):
        return values
    trl = {k: values.get(k) if values.get(k) is not None else default for k, default in TRL_BATCH_FIELDS.items()}
    world = values.get("num_processes") or (values.get("n_gpus_per_node") or 1) * (values.get("nnodes") or 1)
    n = values.get("rollout_n") or 8  # TRL's num_generations default
    micro = trl["per_device_train_batch_size"]
    steps = trl["steps_per_generation"] or trl["gradient_accumulation_steps"]
    samples = trl["generation_batch_size"] or micro * world * steps
    if samples % n:
        raise PlanError(f"generation_batch_size={samples} samples (per_device_train_batch_size={micro} x {world} "
                        f"processes x steps_per_generation {steps}) is not divisible by num_generations={n}: groups "
                        "would be split (TRL's rule too); use a per_device_train_batch_size or steps_per_generation "
                        f"that makes it a multiple of {n}, or set train_batch_size (prompts) instead.")
    mini = micro * world * trl["gradient_accumulation_steps"]
    out = {**values, "rollout_n": n, "train_batch_size": samples // n, "ppo_micro_batch_size_per_device": micro,
           "ppo_epochs": trl["num_iterations"]}
    if mini % n or samples % mini:  # an optimizer step holding part of a group, or spanning two rollouts
        out.update(ppo_mini_batch_size=None, ppo_mini_batch_samples=mini)
    else:
        out["ppo_mini_batch_size"] = mini // n
    return out


def build_layout(values: dict[str, Any]) -> RolloutLayout:
    """The :class:`RolloutLayout` of ``plan`` options (raises :class:`PlanError` for a missing required one); a
    recipe of TRL's batch fields is read as the trainer reads it (:func:`trl_batch_values`)."""
    values = trl_batch_values(values)
    missing = [k for k in ("train_batch_size", "rollout_n") if values.get(k) is None]
    if missing:
        raise PlanError(" and ".join(
            f"{k} is required: pass --{k.replace('_', '-')} or set {k} in the --config YAML" for k in missing
        ) + " (or TRL's per_device_train_batch_size / gradient_accumulation_steps / num_generations in the YAML).")
    return RolloutLayout.build(**{k: values[k] for k in LAYOUT_KEYS if values.get(k) is not None})


def build_memory(values: dict[str, Any], layout: RolloutLayout, n_values: tuple[int, ...]):
    """The :class:`~trl_nrollout.plan.memory.MemoryEstimate` of ``plan`` options (loads the model's config)."""
    from trl_nrollout.plan import memory

    dtype = values.get("dtype")
    if dtype not in (None, "auto"):
        try:
            memory.dtype_bytes(dtype)
        except ValueError as err:
            raise PlanError(str(err)) from None
    notes = []
    lengths = {}
    for key, default in [("max_prompt_length", memory.DEFAULT_MAX_PROMPT_LENGTH),
                         ("max_completion_length", memory.DEFAULT_MAX_COMPLETION_LENGTH)]:
        value = values.get(key)
        if value is None:
            notes.append(f"{key} not set: {default} assumed.")
            value = default
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PlanError(f"{key}={value!r} must be a non-negative integer.")
        lengths[key] = value
    max_num_seqs = values.get("max_num_seqs")
    max_num_seqs = memory.DEFAULT_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise PlanError(f"max_num_seqs={max_num_seqs!r} must be a positive integer (the default is 1024).")
    gib = values.get("gpu_memory_gib")
    util = engine_utilization(values, rollout_ranks=bool(values.get("rollout_ranks")))
    if gib is None and values.get("gpu_memory_utilization") is None:
        util = None

    from trl_nrollout.plan.models import KNOWN_CONFIGS, model_dims

    name = values["model_name_or_path"]
    if name in KNOWN_CONFIGS:  # offline and without torch: the config and the parameter count are known
        shape = memory.ModelShape.from_config_dict(KNOWN_CONFIGS[name], dtype=dtype, name=name,
                                                   num_parameters=model_dims(name).num_parameters)
    else:
        shape = memory.load_model_shape(name, dtype=dtype)
    memory.check_model_fits_layout(shape, layout)
    if shape.num_parameters is None:
        notes.append("parameter count unavailable (transformers could not build this architecture): no weights "
                     "figure.")
    factor = pool_factor(values)
    if factor > 1:
        notes.append(f"rollout_partial: each engine keeps {factor:g} x its share of groups in flight (1 + "
                     "rollout_partial_oversample); the KV figures count them.")
    return memory.estimate_memory(
        shape, layout, pool_factor=factor, max_prompt_length=lengths["max_prompt_length"],
        max_completion_length=lengths["max_completion_length"], max_num_seqs=max_num_seqs, n_values=n_values,
        gpu_memory_gib=gib, gpu_memory_utilization=util, notes=notes,
    )


def check_token_budgets(values: dict[str, Any]) -> None:
    """A log-prob token budget must hold one whole sequence (checked when both lengths are given)."""
    prompt, completion = values.get("max_prompt_length"), values.get("max_completion_length")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return
    seq_len = prompt + completion
    for key in ("log_prob_max_token_len_per_device", "ref_log_prob_max_token_len_per_device"):
        budget = values.get(key)
        if isinstance(budget, int) and budget < seq_len:
            raise LayoutError(
                f"{key}={budget} is smaller than one sequence (max_prompt_length + max_completion_length = "
                f"{seq_len} tokens), so a long sample fits in no forward; use {key} {seq_len} or more "
                f"({2 * seq_len} is usual).",
                option=key, value=budget, rule="token_budget_fits_sequence", fixes=[{key: seq_len}],
            )


def critic_rows(values: dict[str, Any], layout: RolloutLayout) -> list[tuple[str, str]]:
    """PPO's critic in the plan (a recipe with ``trainer: ppo`` or ``adv_estimator: gae``): its micro batches in
    the value pass and in the update, as :class:`~trl_nrollout.trainer.ppo.NRolloutPPOTrainer` cuts them. Empty otherwise."""
    if values.get("trainer") != "ppo" and layout.adv_estimator != "gae":
        return []
    micro = values.get("critic_ppo_micro_batch_size_per_device")
    budget = values.get("critic_ppo_max_token_len_per_device")
    policy = layout.ppo_micro_batch_size_per_device
    if micro is not None and policy % micro:
        raise PlanError(f"critic_ppo_micro_batch_size_per_device={micro} must divide the policy's micro batch "
                        f"({policy} sequences per device); use a divisor of {policy}.")
    if budget is not None:
        both = f"dynamic, <= {budget} tokens per forward" + (f" (at most {micro} sequences)" if micro else "")
        return [("critic value micro batch", both), ("critic update micro batch", both)]
    value_micro = micro or layout.old_log_prob.per_device
    update_micro = micro or policy
    per_rank = layout.samples_per_rank
    return [
        ("critic value micro batch", f"{value_micro} sequences per device per forward; {per_rank} / {value_micro} "
                                     f"-> {-(-per_rank // value_micro)} forwards per pass"),
        ("critic update micro batch", f"{update_micro} sequences per device per forward; policy micro {policy} / "
                                      f"{update_micro} -> {policy // update_micro} critic forwards per micro step"),
    ]
