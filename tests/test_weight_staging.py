"""Weight versions on rollout ranks (issue 62, item 8): only the first rank of an engine's TP group stages whole
versions (host memory per engine, not per rank); its other ranks hold a few buckets at a time and load the same
weights. One process, one thread per rank, over the real transport of rollout ranks: a real TCPStore (the launcher's
kind), real :class:`~trl_nrollout.rollout.bridge.Bridge` objects, gloo groups (the weights group and the engine's TP
group), trainer rank 0's :class:`~trl_nrollout.rollout.ranks.client.RemoteEngines` and the rollout ranks' own loop
(:func:`~trl_nrollout.rollout.ranks.serve.serve`). The engine is a stand-in that records what vLLM's reload would be
handed (two vLLM engines of one TP group cannot run in one process; the vLLM side of a sync is
tests/test_rollout_ranks.py's launches).

And a trained copy of a tied head (issue 62, item 10): ``modules_to_save=["lm_head"]`` on a model whose head is its
input embeddings is refused (the engine would load the trained head into its embeddings), naming the option, the
value, the tie and the fix; an untied model's, or one copy shared by both names, is accepted."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trl_nrollout.plan.roles import Roles
from trl_nrollout.rollout.bridge import Bridge
from trl_nrollout.rollout.ranks import reader as remote_reader
from trl_nrollout.rollout.ranks.client import RemoteEngines
from trl_nrollout.rollout.ranks.reader import PASSING_BUCKETS, HostBuffers, staging_bound
from trl_nrollout.rollout.ranks.serve import serve
from trl_nrollout.rollout.ranks.state import RankState

TIMEOUT = timedelta(seconds=60)


class RecordingEngine:
    """The engine's side of a weight load as vLLM's reload sees it: it asks for the buckets one by one, keeping the
    last while it asks for the next, and copies every tensor (here into a record of each version). The first load
    starts only once ``hold`` is set (the engine busy with a job while the next version arrives)."""

    def __init__(self, rank: int, tp_ranks: list[int], group, names: set[str], hold: threading.Event) -> None:
        self.rank, self.tp_ranks, self.tp_group = rank, tp_ranks, group
        self.layout = SimpleNamespace(rollout_tp_size=len(tp_ranks))
        self.dtype = "torch.float32"
        self.names, self.hold = names, hold
        self.versions: list[dict[str, torch.Tensor]] = []

    def parameter_names(self) -> set[str]:
        return self.names

    def load_buckets(self, buckets) -> dict:
        if not self.versions:
            assert self.hold.wait(60), "the trainer never sent the second version"
        loaded = {}
        for bucket in buckets:  # (the last bucket stays referenced while the next is asked for, as in vLLM)
            for name, t in bucket:
                loaded[name] = t.clone()
        self.versions.append(loaded)
        return {}

    def close(self) -> None:
        pass


def _tiny_tied_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).float()


def _run_launch(model, versions: int, staleness: int, tp: int, bucket_bytes: int, monkeypatch, busy: bool = True):
    """Trainer rank 0 sends ``versions`` weight versions (each after an update of ``model``) to ``tp`` rollout ranks
    (one engine), ``rollout_lookahead=staleness``; ``busy``: the engine loads the first version only once the second
    has arrived. Returns what each version was, each rank's engine and host buffers."""
    readers: dict[int, HostBuffers] = {}

    class Counted(HostBuffers):  # the reader's own buffers, as each rollout rank made them
        def __init__(self, pin=None):
            super().__init__(pin)
            readers[int(threading.current_thread().name.split("-")[-1])] = self

    monkeypatch.setattr(remote_reader, "HostBuffers", Counted)
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, timeout=TIMEOUT)
    roles = Roles(world=1 + tp, rollout_ranks=tp, local_world=1 + tp)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    hold, sent, engines, errors = threading.Event(), [], {}, []
    if not busy:
        hold.set()

    def connect(rank: int) -> Bridge:
        store = torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True, timeout=TIMEOUT)
        group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("weights/", store), rank, 1 + tp,
                                                   TIMEOUT)
        return Bridge(roles, rank, torch.distributed.PrefixStore("bridge/", store), group, 60.0)

    def trainer() -> None:
        bridge = connect(0)
        try:
            remote = RemoteEngines(bridge, {"lookahead": staleness}, max_model_len=64, bucket_bytes=bucket_bytes)
            for v in range(versions):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01 * (v + 1))
                sent.append({n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)})
                remote.load_weights(model, version=v)
                if v == 1:
                    remote.wait_sent()  # every rollout rank received version 1 (and version 0 is not loaded yet)
                    hold.set()
            remote.close()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)
            hold.set()
        finally:
            bridge.finish()

    def rollout(r: int) -> None:
        bridge = connect(1 + r)
        try:
            store = torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True,
                                               timeout=TIMEOUT)
            tp_group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("tp/", store), r, tp, TIMEOUT)
            engines[r] = RecordingEngine(r, list(range(tp)), tp_group, names, hold)
            serve(bridge, lambda settings: engines[r], RankState())
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
        finally:
            bridge.finish()

    threads = [threading.Thread(target=trainer, name="trainer")]
    threads += [threading.Thread(target=rollout, args=(r,), name=f"rollout-{r}") for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return sent, engines, readers


def test_only_the_first_rank_of_an_engine_stages_whole_versions_and_every_rank_loads_the_same(monkeypatch):
    """One engine of 2 TP ranks, rollout_lookahead=2, the engine busy while the second version arrives: its first rank
    stages exactly two whole versions at once (the bound: rollout_lookahead x a version's bytes), its other rank at
    most 3 buckets (the reader's scratch, the bucket vLLM loads, the next one), far less than a version; and both
    ranks load every version exactly as the trainer sent it (float32, every name the engine has: the tied head
    too). Mutations tried: every rank stages (``holds_versions`` always True) -> rank 1 holds two versions, the
    bound fails; the first rank broadcasts zeros in place of a bucket's data -> rank 1's weights differ."""
    model = _tiny_tied_model()
    sent, engines, buffers = _run_launch(model, versions=4, staleness=2, tp=2, bucket_bytes=1, monkeypatch=monkeypatch)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for r, engine in engines.items():
        assert len(engine.versions) == 4
        for v, (want, got) in enumerate(zip(sent, engine.versions)):
            assert set(got) == names, (r, v)
            assert all(torch.equal(got[n], want[n]) for n in names), (r, v)
    # the version as it travels: each decoder layer its own bucket (bucket_bytes=1), 16-byte aligned float32
    version = sum(-(-p.numel() * 4 // 16) * 16 for _, p in model.named_parameters(remove_duplicate=False))
    layer = sum(-(-p.numel() * 4 // 16) * 16 for n, p in model.named_parameters() if ".layers.0." in n)
    other = version - 4 * layer  # embeddings, norm and the tied head travel together
    bucket = max(layer, other)
    assert buffers[0].peak == 2 * version == staging_bound(2, version, bucket, holds=True)
    assert 0 < buffers[1].peak <= staging_bound(2, version, bucket, holds=False) == PASSING_BUCKETS * bucket < version
    assert buffers[0].live() == 0 and buffers[1].live() <= bucket  # (the reader's scratch only)


def test_one_rank_engines_stage_their_own_versions(monkeypatch):
    """TP 1 (each rank its engine's first): the rank stages whole versions and loads them itself; one version at a
    time with rollout_lookahead=1. Mutation tried: the staged version left in the message and iterated without letting
    each bucket go (``message.get``, a ``for`` loop) -> the loaded version is still held while the next one arrives,
    the peak is two versions and the test fails."""
    model = _tiny_tied_model()
    sent, engines, buffers = _run_launch(model, versions=2, staleness=1, tp=1, bucket_bytes=1 << 20,
                                         monkeypatch=monkeypatch, busy=False)
    got = engines[0].versions
    assert len(got) == 2 and all(torch.equal(got[v][n], sent[v][n]) for v in range(2) for n in sent[v])
    version = sum(-(-p.numel() * 4 // 16) * 16 for _, p in model.named_parameters(remove_duplicate=False))
    assert buffers[0].peak == version  # one bucket of the whole model (1 MiB), one version at a time


# ------------------------------------------------------------------------ a trained copy of a tied head (item 10)
def _peft(model, **lora):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **lora}))


def _builtin_tiny(tiny_model_path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    return model


def test_a_trained_copy_of_a_tied_head_is_refused_naming_the_option_rule_and_fix(tiny_model_path):
    """builtin:tiny-qwen2 ties lm_head to embed_tokens (as Qwen2.5-1.5B does); modules_to_save=["lm_head"] trains a
    copy of the head that the sync would send as ``lm_head.weight``, which vLLM's tied model loads into the shared
    embedding matrix: refused, by the check and by the sync itself, naming the option, its value, the tie and the
    fixes. Mutation tried: the check compares the checkpoint's own tensors (``("tensor", id(p))`` of the original
    parameter in place of the trained copy's) -> no refusal, the test fails."""
    from trl_nrollout.errors import InputError
    from trl_nrollout.rollout.engines.weight_sync import iter_weight_buckets, tied_weights_refusal

    model = _peft(_builtin_tiny(tiny_model_path), modules_to_save=["lm_head"])
    why = tied_weights_refusal(model)
    assert why is not None
    for part in ("modules_to_save=['lm_head']", "ties model.embed_tokens.weight and lm_head.weight",
                 "tie_word_embeddings=True", "input embeddings", "drop 'lm_head' from modules_to_save",
                 "save it with tie_word_embeddings=False", "ensure_weight_tying=True"):
        assert part in why, (part, why)
    with pytest.raises(InputError, match=r"modules_to_save=\['lm_head'\].*tie_word_embeddings=True"):
        next(iter_weight_buckets(model))


def test_a_lora_on_a_tied_head_is_refused_and_a_shared_trained_copy_is_not(tiny_model_path):
    """A LoRA delta merged into the tied head only (target_modules with lm_head) is the same wrong policy: refused
    naming target_modules. PEFT's ensure_weight_tying=True trains one copy shared by embed_tokens and lm_head: the
    engine can hold it, accepted. Mutation tried: refuse every ``modules_to_save`` copy of a head, tied or not (the
    tie check dropped) -> the shared copy is refused, the test fails."""
    from trl_nrollout.rollout.engines.weight_sync import iter_weight_buckets, tied_weights_refusal

    why = tied_weights_refusal(_peft(_builtin_tiny(tiny_model_path), target_modules=["q_proj", "lm_head"]))
    assert why is not None and "target_modules=['lm_head', 'q_proj']" in why and "drop 'lm_head' from target" in why
    shared = _peft(_builtin_tiny(tiny_model_path), modules_to_save=["lm_head"], ensure_weight_tying=True)
    assert tied_weights_refusal(shared) is None
    sent = {n: t for bucket in iter_weight_buckets(shared) for n, t in bucket}
    copy = shared.base_model.model.lm_head.modules_to_save["default"].weight
    # one trained matrix under both names
    assert sent["lm_head.weight"].data_ptr() == sent["model.embed_tokens.weight"].data_ptr() == copy.data_ptr()


def test_a_trained_head_copy_of_an_untied_model_is_accepted_and_sent_as_the_head():
    """An untied model (its own lm_head, as Qwen2.5-7B) with modules_to_save=["lm_head"]: nothing is tied, the sync
    sends the trained copy as ``lm_head.weight`` and the embeddings as they are. Mutation tried: the tie check
    dropped (every copy of a head refused) -> refused here, the test fails."""
    from trl_nrollout.rollout.engines.weight_sync import iter_weight_buckets, tied_weights_refusal

    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    model = _peft(base, modules_to_save=["lm_head"])
    assert tied_weights_refusal(model) is None
    copy = model.base_model.model.lm_head.modules_to_save["default"].weight
    with torch.no_grad():
        copy.add_(1.0)  # trained
    sent = {n: t for bucket in iter_weight_buckets(model) for n, t in bucket}
    assert torch.equal(sent["lm_head.weight"], copy)
    assert torch.equal(sent["model.embed_tokens.weight"], base.model.embed_tokens.weight)
    assert not torch.equal(sent["lm_head.weight"], base.lm_head.original_module.weight)


def test_the_trainer_refuses_a_tied_head_copy_before_the_engine_starts(tmp_path, caplog):
    """The trainer's check (the vLLM engines' merge refusals): rollout_backend='vllm' is an error naming the option,
    before any engine is built; 'auto' generates with the PEFT model itself (the HF engine, which trains and samples
    one policy), after one warning. Mutation tried: the check left out of ``_merge_refusal`` -> 'vllm' starts an
    engine, whose first sync is refused by the sync itself (an error about the engine, not the check): the test
    fails."""
    import logging

    from peft import LoraConfig

    from tests.test_trainer_errors import cfg
    from trl_nrollout.builtin import digits_dataset, digits_reward
    from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

    def build(backend: str):
        args = cfg(tmp_path / backend, train_batch_size=2, rollout_n=4, rollout_backend=backend)
        return NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                   train_dataset=digits_dataset(16),
                                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                          modules_to_save=["lm_head"]))

    # "here: the adapter": the check before the engine; the sync's own refusal would come as "here: InputError: ..."
    with pytest.raises(RuntimeError, match=r"vLLM cannot run .* here: the adapter 'default' sets "
                                           r"modules_to_save=\['lm_head'\].*tie_word_embeddings=True"):
        build("vllm")
    with caplog.at_level(logging.WARNING, logger="trl_nrollout.trainer"):
        trainer = build("auto")
    assert trainer.rollout_backend == "hf"
    assert any("modules_to_save" in r.getMessage() and "using the HF engine" in r.getMessage() for r in caplog.records)
