"""A second runner fed only the `StepInputs` rank 0 hands its workers (pickled, as they
cross processes) computes rank 0's logits bit for bit every step and ends with rank 0's
KV cache: block copies, adapter slot writes and the forward all travel in the inputs,
and the worker runs them with the same `ModelRunner.run`. A step whose adapter cannot
take a slot still makes its block copies on every rank (its other requests go on)."""

from __future__ import annotations

import pickle

import pytest
import torch

from loraplex.adapters.slots import LoRASlots
from loraplex.platform.kv_cache import allocate_kv_caches
from loraplex.platform.llm import LLM
from loraplex.platform.model_runner import ModelRunner, StepInputs, StepLogits
from loraplex.platform.models.registry import load_model
from loraplex.platform.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
FORKED = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)
SCORED = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)


class Follower:
    """A worker rank without collectives: its own model, KV cache and LoRA slots, run
    from the pickled inputs rank 0 sends (before rank 0 runs them)."""

    def __init__(self, folder, llm: LLM) -> None:
        engine = llm.engine
        config = engine.config
        model, arch = load_model(folder, torch.float32, engine.device, engine.kernel_backend)
        kv_caches = allocate_kv_caches(
            arch, engine.num_blocks, config.cache.block_size, torch.float32, engine.device
        )
        slots = LoRASlots(
            model.lora_targets(),
            config.lora.max_loras,
            config.lora.max_lora_rank,
            engine.kernel_backend,
        )
        self.runner = ModelRunner(model, kv_caches, config.cache.block_size, engine.device, slots)
        self.received: list[StepInputs] = []
        self.logits: list[StepLogits] = []

    def send(self, inputs: StepInputs) -> None:
        inputs = pickle.loads(pickle.dumps(inputs))
        self.received.append(inputs)
        self.runner.write_slots(inputs.slot_writes)
        self.logits.append(self.runner.run(inputs))


@pytest.fixture
def setup(tiny_model_factory, peft_adapter_factory, tmp_path):
    base = tiny_model_factory("llama")
    good = peft_adapter_factory(base, tmp_path / "good", rank=4, seed=5)
    other = peft_adapter_factory(base, tmp_path / "other", rank=8, seed=6)
    return base, good, other


def follow(base) -> tuple[LLM, Follower, list[torch.Tensor]]:
    """An engine whose runner hands every step to a `Follower`, and rank 0's logits."""
    llm = LLM(
        str(base),
        dtype="float32",
        max_model_len=64,
        max_loras=1,
        max_lora_rank=8,
        block_size=4,
        kv_cache_memory_bytes=16 * 2**20,
    )
    follower = Follower(base, llm)
    runner = llm.engine.runner
    runner.workers = follower
    leader_logits: list[torch.Tensor] = []
    sample = runner.sample

    def recording_sample(logits, requests, drafts=None):
        leader_logits.append(logits.clone())
        return sample(logits, requests, drafts)

    runner.sample = recording_sample
    return llm, follower, leader_logits


def assert_same_state(llm: LLM, follower: Follower) -> None:
    for ours, theirs in zip(llm.engine.runner.kv_caches, follower.runner.kv_caches, strict=True):
        assert torch.equal(ours, theirs)


def test_a_follower_runs_every_step_as_rank_0_does(setup):
    base, good, other = setup
    llm, follower, leader_logits = follow(base)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [1, 2, 3, 4, 5, 6], [20, 21]]
    adapters = [None, str(good), str(other), str(good)]
    outputs = llm.generate(prompts, [FORKED, SCORED, GREEDY, FORKED], adapters)
    assert all(o.error is None for o in outputs)
    sampled = [logits.sample for logits in follower.logits if logits.sample is not None]
    assert len(sampled) == len(leader_logits) == len(follower.received)
    for theirs, ours in zip(sampled, leader_logits, strict=True):
        assert torch.equal(theirs, ours)
    # The prompt rows travel too: the follower scores the leader's prompt tokens.
    scores = [logits.prompt for logits in follower.logits if logits.prompt is not None]
    assert [round(v, 5) for s in scores for v in s.logprob.tolist()] == [
        round(entry.logprob, 5) for entry in outputs[1].prompt_logprobs[1:]
    ]
    assert_same_state(llm, follower)
    # The scenario covers what travels besides the tokens: forks' copy-on-write copies
    # and slot writes (one slot for two adapters: written again as they alternate).
    assert sum(len(i.block_copies) for i in follower.received) >= 2
    assert sum(len(i.slot_writes) for i in follower.received) >= 3


def test_a_failed_slot_write_still_sends_the_steps_block_copies(setup, monkeypatch):
    base, good, _ = setup
    clean = LLM(str(base), dtype="float32", max_model_len=64, block_size=4)
    expected = clean.generate([[1, 2, 3, 4, 5]], FORKED)[0]
    llm, follower, _ = follow(base)
    engine = llm.engine
    engine.add_request("forked", [1, 2, 3, 4, 5], FORKED)
    engine.step()
    real_load = LoRASlots.load

    def load(self, adapter, slot):
        if adapter.name == "good":
            raise RuntimeError("slot write failed")
        return real_load(self, adapter, slot)

    monkeypatch.setattr(LoRASlots, "load", load)
    engine.add_request("lora", [7, 8, 9], GREEDY, adapter=str(good))
    failed = engine.step()
    assert [o.request_id for o in failed] == ["lora"] and failed[0].error is not None
    copies_only = follower.received[-1]
    assert copies_only.input_ids.numel() == 0 and copies_only.block_copies
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
    forked = outputs["forked"]
    assert [c.token_ids for c in forked.outputs] == [c.token_ids for c in expected.outputs]
    assert_same_state(llm, follower)
