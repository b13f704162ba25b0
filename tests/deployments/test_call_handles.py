"""The ingress's kept `generate` handles: one per (base model, model id), the newest
`capacity` of them, each streaming from the model deployment as a new handle would."""

from __future__ import annotations

from loraplex.deployments.call_handles import GenerateHandles
from loraplex.deployments.wire import GenerateCall, StreamStep
from loraplex.platform.request import SamplingParams


def test_a_kept_handle_is_reused_streams_and_the_oldest_id_goes_past_capacity(model_server):
    handles = GenerateHandles({"tiny": model_server}, capacity=2)
    base = handles("tiny", "")
    assert handles("tiny", "") is base, "the same id gets the same handle"
    assert base.handle_options.stream and base.handle_options.multiplexed_model_id == ""
    call = GenerateCall("kept-handle-1", SamplingParams(max_tokens=2, ignore_eos=True), [1, 2, 3])
    steps = list(base.remote(call))
    assert all(isinstance(step, StreamStep) for step in steps), steps
    assert sum(d.num_new_tokens for step in steps for d in step.deltas) == 2

    other = handles("tiny", "acme/x@1")
    assert other.handle_options.multiplexed_model_id == "acme/x@1"
    handles("tiny", "")  # the base model's id is now the newest
    handles("tiny", "acme/y@1")  # past capacity: the oldest, acme/x@1, goes
    assert handles("tiny", "") is base
    assert handles("tiny", "acme/x@1") is not other
