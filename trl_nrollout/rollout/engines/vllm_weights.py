"""Weights into a ``VLLMEngineGroup``'s engine: the policy's weights a bounded bucket at a time through the model
runner's ``reload_weights`` (ZeRO-3 / FSDP gathered collectively, a sleeping engine woken for them), or, with
``rollout_lora_sync="adapter"``, only the LoRA adapter as a new adapter version the engine serves. A mixin of
:class:`~trl_nrollout.rollout.engines.vllm_group.VLLMEngineGroup`."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from trl_nrollout.rollout.engines.weight_sync import (
    adapter_nbytes,
    adapter_tensors,
    engine_has,
    iter_weight_buckets,
)

logger = logging.getLogger(__name__)


class EngineWeights:
    """The weight sync of one rank's engine (see the module docstring)."""

    def _model_runner(self):
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        worker = getattr(worker, "worker", worker)
        return worker.model_runner

    @torch.no_grad()
    def load_weights(self, model: nn.Module, merge_lora: bool = True, version: int = 0) -> dict:
        """Push the training model's weights into this rank's engine, a bounded bucket at a time.

        Every rank of the job must call it (ZeRO-3 / FSDP gather collectively; every TP rank loads the full
        tensors and vLLM keeps its shard). On every platform through one call of the model runner's
        ``reload_weights``, fed whole decoder layers a bucket at a time: it runs the model's ``load_weights`` and then vLLM's post-load processing
        (``process_weights_after_loading``: CPU weight prepacking, MLA / quantized / MoE derived weights), which a
        bare ``model.load_weights`` skips. A sleeping engine wakes its weights first, loads, resets the prefix
        cache (and a vision-language model's encoder cache), and only then wakes its KV cache. Returns bytes, buckets and seconds.
        ``merge_lora=False``: a PEFT model's base weights without its adapter (an engine serving the adapter itself).
        ``version`` (the policy's) tags the samples of engines on rollout ranks; an engine in this process has no use
        for it.
        """
        engine_names = self.parameter_names()

        def buckets():  # gathered when vLLM asks for a bucket's first tensor
            yield from iter_weight_buckets(model, self.weight_bucket_bytes, keep_alias=engine_has(engine_names),
                                           merge_lora=merge_lora)

        return self.load_buckets(buckets())

    def parameter_names(self) -> set[str]:
        """The names of the engine's own parameters (a tied weight is sent under the names the engine's model
        has)."""
        return {n for n, _ in self._model_runner().get_model().named_parameters(remove_duplicate=False)}

    @torch.no_grad()
    def load_buckets(self, buckets) -> dict:
        """Load full weights given as an iterator of buckets (lists of ``(name, tensor)``, whole decoder layers),
        each asked for only when vLLM has loaded the one before. Returns bytes, buckets and seconds."""
        start = time.perf_counter()
        if "weights" in self._asleep:  # weights first, KV cache only after the load: a lower peak (as TRL does)
            self.wake_up(["weights"])
        runner = self._model_runner()
        stats = {"bytes": 0, "buckets": 0, "peak_bucket_bytes": 0}

        def weights():
            for bucket in buckets:
                size = sum(t.numel() * t.element_size() for _, t in bucket)
                stats["bytes"] += size
                stats["peak_bucket_bytes"] = max(stats["peak_bucket_bytes"], size)
                stats["buckets"] += 1
                yield from bucket

        # one reload for the whole model: vLLM's layer-wise reload processes each layer as soon as its tensors are
        # in (buckets never split a layer), and a call per bucket would re-initialise every layer and warn about
        # every layer outside the bucket (thousands of lines per sync on a 7B model)
        runner.reload_weights(weights_iterator=weights())
        if self.cpu:
            stats["moe_layers_prepacked"] = prepack_cpu_moe(runner.get_model())
        self.llm.reset_prefix_cache()
        if getattr(getattr(self.llm.llm_engine, "model_config", None), "is_multimodal_model", False):
            # image features computed by the old vision tower are stale (and the reload emptied the runner's side of
            # the encoder cache, which the scheduler's side must forget too, or the next image is a cache miss)
            self.llm.llm_engine.reset_encoder_cache()
        if self._asleep:
            self.wake_up()
        return {**stats, "seconds": time.perf_counter() - start}

    @torch.no_grad()
    def load_adapter(self, model: nn.Module, version: int = 0) -> dict:
        """Hand the engine the training model's LoRA adapter as a new version (``rollout_lora_sync="adapter"``): only
        the adapter's tensors are gathered (:func:`~trl_nrollout.rollout.engines.weight_sync.adapter_tensors`) and loaded;
        the base weights stay. Every rank of the job calls it (ZeRO-3 / FSDP gather collectively). Returns bytes,
        tensors and seconds."""
        start = time.perf_counter()
        tensors = adapter_tensors(model)
        stats = self.load_adapter_tensors(tensors)
        return {**stats, "seconds": time.perf_counter() - start}

    @torch.no_grad()
    def load_adapter_tensors(self, tensors: dict[str, torch.Tensor]) -> dict:
        """Load an adapter given as PEFT-named tensors (``base_model.model.<module>.lora_A.weight`` ``[r, in]``,
        ``...lora_B.weight`` ``[out, r]``, scaling already folded into ``lora_B``) as a new version, in memory: a
        vLLM ``LoRAModel`` built from the tensors goes straight into this rank's LoRA manager (no file; vLLM's
        request path would load one from ``lora_path``), replacing the previous version, and every following
        request of this engine carries the new version's ``LoRARequest`` (a new ``lora_int_id`` and name, so no
        cached prefix computed under an older adapter is reused). Every TP rank loads the full tensors; vLLM's LoRA
        layers keep their shard. Returns bytes and tensors."""
        if self.lora_rank is None:
            raise RuntimeError("this engine was built without LoRA (lora_rank=None): send full weights with "
                               "load_weights, or build it with lora_rank (rollout_lora_sync='adapter').")
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        if "weights" in self._asleep:  # the LoRA slots live with the weights
            self.wake_up(["weights"])
        manager = self._model_runner().lora_manager
        adapters = manager._adapter_manager
        modules = sorted({name.split(".lora_")[0].split(".")[-1] for name in tensors})
        served = set()
        for module in adapters.supported_lora_modules:
            served.update(adapters.packed_modules_mapping.get(module, [module]))
        unserved = [m for m in modules if m not in served]
        if unserved:
            raise ValueError(f"the adapter targets {unserved}, which vLLM's LoRA does not serve on this model (it "
                             f"serves {sorted(served)}); target those modules only, or set rollout_lora_sync='merged'.")
        rank = max(int(t.shape[0]) for name, t in tensors.items() if name.endswith("lora_A.weight"))
        if rank > self.lora_rank:
            raise ValueError(f"an adapter of rank {rank} reached an engine built for rank {self.lora_rank}.")
        # alpha = r: the engine's scaling is 1, PEFT's scaling is folded into lora_B already
        helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": rank, "target_modules": modules,
                                       "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
        self._adapter_id += 1
        lora = LoRAModel.from_lora_tensors(
            self._adapter_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None))
        for old in list(adapters.list_adapters()):
            adapters.remove_adapter(old)
        adapters.add_adapter(lora)
        adapters.activate_adapter(self._adapter_id)
        self.lora_request = LoRARequest(lora_name=f"trl-nrollout-policy-{self._adapter_id}",
                                        lora_int_id=self._adapter_id, lora_path="trl-nrollout://in-memory")
        self.llm.reset_prefix_cache()
        if self._asleep:
            self.wake_up()
        return {"bytes": adapter_nbytes(tensors), "tensors": len(tensors), "adapter_id": self._adapter_id}


def prepack_cpu_moe(model: nn.Module) -> int:
    """vLLM-CPU's MoE layers run their experts from a prepacked copy of the weights (``CPUExperts``: the grouped-gemm
    layout, made once by ``process_weights_after_loading``); a weight update reloads the plain weights but skips that
    prepack (vLLM 0.32 ``UnquantizedFusedMoEMethod``: "Setup moe kernel only on the first call"), so the experts would
    compute with plain weights read as packed ones (log-probs off by ~1e-2 with the trainer's own weights). Prepack
    them again after each reload; returns the layers prepacked. ``model``: the engine's model."""
    count = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not hasattr(experts, "isa") or not hasattr(layer, "w13_weight"):
            continue  # not a CPU MoE layer
        experts.process_weights_after_loading(layer)
        count += 1
    return count

