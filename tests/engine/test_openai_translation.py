"""The OpenAI API's plain logic: vLLM's request models as GenerateRequests,
refused fields, engine errors as OpenAI errors, and finishes as OpenAI fields."""

from __future__ import annotations

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from common import errors
from engine_service.openai_api import requests as reqs
from engine_service.openai_api import results
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})


def translate(**body) -> reqs.Translated:
    request = chat(**body)
    return reqs.generate_request(request, reqs.CHAT, request.max_completion_tokens or request.max_tokens)


def test_sampling_and_the_extension_become_the_contracts_fields():
    translated = translate(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop="END",
                           repetition_penalty=1.1, ignore_eos=True, stream=True,
                           stream_options={"include_usage": True},
                           undercurrent={"probes": [{"probe": "g", "failure_policy": "fail_open", "action": "abort"},
                                                    {"probe": "h"}],
                                         "gate_tokens": False, "request_id": "r1",
                                         "extraction_points": [{"name": "p", "tensor_type": "TENSOR_TYPE_MLP_OUT",
                                                                "layers": [1]}]})
    message = translated.request
    sampling = message.sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.seed, list(sampling.stop), sampling.ignore_eos) == (
        7, 5, 3, ["END"], True)
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert [(b.probe, b.failure_policy, b.action) for b in message.probes] == [
        ("g", types_pb.FAILURE_POLICY_FAIL_OPEN, types_pb.PROBE_ACTION_ABORT), ("h", 0, 0)]
    assert message.HasField("gate_tokens") and not message.gate_tokens and message.request_id == "r1"
    assert [(p.name, p.tensor_type, list(p.layers)) for p in message.extraction_points] == [
        ("p", types_pb.TENSOR_TYPE_MLP_OUT, [1])]
    assert translated.stream and translated.include_usage


def test_what_the_body_leaves_out_stays_unset_for_the_engine_to_default():
    message = translate().request
    assert not message.sampling.HasField("temperature") and message.sampling.max_tokens == 0
    assert not message.HasField("gate_tokens") and not message.probes and not message.request_id
    assert translate(max_completion_tokens=9, max_tokens=3).request.sampling.max_tokens == 9
    assert translate(top_k=-1).request.sampling.top_k == 0  # vLLM's "off"


@pytest.mark.parametrize("body, param, text", [
    ({"logprobs": True}, "logprobs", "logprobs: not supported by this engine"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools: not supported"),
    ({"n": 3}, "n", "n: 3; this engine makes one choice per request"),
    ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens: 0; must be at least 1"),
    ({"undercurrent": {"probes": [{"probe": "g", "failure_policy": "sometimes"}]}},
     "undercurrent.probes.0.failure_policy", "Input should be 'fail_closed' or 'fail_open'"),
    ({"undercurrent": {"gate": True}}, "undercurrent.gate", "Extra inputs are not permitted"),
    ({"undercurrent": {"extraction_points": [{"name": "p", "layers": "x"}]}},
     "undercurrent.extraction_points[0]", "undercurrent.extraction_points[0]: Failed to parse layers"),
])
def test_a_field_this_engine_cannot_honour_is_refused_by_name(body, param, text):
    with pytest.raises(reqs.OpenAIError) as err:
        translate(**body)
    assert (err.value.param, err.value.status) == (param, 400) and text in err.value.message, err.value.message


def test_defaults_of_unsupported_fields_are_no_refusal():
    # What SDKs and vLLM send by default: logprobs false, n 1, an empty tool list.
    translate(logprobs=False, n=1, presence_penalty=0.0)


def test_completion_prompts_are_one_text_or_one_list_of_token_ids():
    assert reqs.completion_prompt("hello") == {"text": "hello"}
    assert reqs.completion_prompt(["hello"]) == {"text": "hello"}
    assert list(reqs.completion_prompt([[5, 6]])["token_ids"].ids) == [5, 6]
    for bad in (["a", "b"], [], [[1], [2]]):
        with pytest.raises(reqs.OpenAIError, match="^prompt: give one prompt") as err:
            reqs.completion_prompt(bad)
        assert err.value.param == "prompt"
    request = CompletionRequest.model_validate({"prompt": "x", "echo": True})
    with pytest.raises(reqs.OpenAIError, match="^echo: not supported"):
        reqs.generate_request(request, reqs.COMPLETION, None)


@pytest.mark.parametrize("err, status, kind, param, message", [
    (errors.InvalidArgument("sampling.temperature: -1.0 must be >= 0"), 400, "invalid_request_error",
     "temperature", "temperature: -1.0 must be >= 0"),
    (errors.InvalidArgument("sampling.max_tokens: 900 plus the 3-token prompt exceeds max_model_len 512"), 400,
     "invalid_request_error", "max_tokens", "max_tokens: 900 plus"),
    (errors.InvalidArgument("probes[1].action: OBSERVE would weaken"), 400, "invalid_request_error",
     "undercurrent.probes[1].action", "undercurrent.probes[1].action: OBSERVE would weaken"),
    (errors.InvalidArgument("gate_tokens: false, but"), 400, "invalid_request_error", "undercurrent.gate_tokens",
     "undercurrent.gate_tokens: false, but"),
    (errors.NotFound("probe 'x' is not loaded on any router"), 404, "not_found_error", None, "probe 'x'"),
    (errors.ResourceExhausted("caller 'demo' already runs 64 Generate streams"), 429, "rate_limit_error", None,
     "caller 'demo'"),
    (errors.Unavailable("the engine is shutting down"), 503, "service_unavailable", None, "the engine"),
])
def test_engine_errors_become_openai_errors_naming_the_body_path(err, status, kind, param, message):
    mapped = reqs.from_engine(err)
    assert (mapped.status, mapped.kind, mapped.param) == (status, kind, param)
    assert mapped.message.startswith(message), mapped.message
    assert mapped.body() == {"error": {"message": mapped.message, "type": kind, "param": param, "code": status}}


def finished(reason: int, **kw) -> engine_pb.GenerateFinished:
    return engine_pb.GenerateFinished(finish_reason=reason, prompt_tokens=10, generated_tokens=8, **kw)


@pytest.mark.parametrize("reason, expected", [
    (types_pb.FINISH_REASON_STOP, "stop"), (types_pb.FINISH_REASON_LENGTH, "length"),
    (types_pb.FINISH_REASON_PROBE_ABORT, "content_filter"), (types_pb.FINISH_REASON_ROUTER_UNAVAILABLE, "content_filter"),
    (types_pb.FINISH_REASON_CLIENT_ABORT, "abort"),
])
def test_finish_reasons_follow_openais_convention(reason, expected):
    assert results.finish_reason(finished(reason)) == expected


def test_an_engine_error_is_a_500_not_a_finish():
    with pytest.raises(reqs.OpenAIError) as err:
        results.finish_reason(finished(types_pb.FINISH_REASON_ERROR, message="capture failed"))
    assert err.value.status == 500 and "capture failed" in err.value.message


def test_the_extension_carries_the_verdict_and_the_bindings_in_force():
    done = finished(types_pb.FINISH_REASON_PROBE_ABORT, gated=True, verdict=types_pb.Verdict(
        probe="g", score=2.5, token_position=15, router="10.0.0.1:1", reason="norm over 0"))
    done.bindings.add(probe="g", version="1", digest="sha256:x", failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED,
                      action=types_pb.PROBE_ACTION_ABORT, rows_scored=6, operator_set=True)
    ext = results.finish_extension(done, "r1")
    assert ext["verdict"] == {"request_id": "", "probe": "g", "score": 2.5, "token_position": 15,
                              "reason": "norm over 0", "router": "10.0.0.1:1", "generated_index": 5}
    assert ext["bindings"] == [{"probe": "g", "version": "1", "digest": "sha256:x", "failure_policy": "fail_closed",
                                "action": "abort", "rows_scored": 6, "rows_unprobed": 0, "state_restarts": 0,
                                "message": "", "operator_set": True}]
    assert (ext["request_id"], ext["finish_reason"], ext["gated"]) == ("r1", "PROBE_ABORT", True)
    usage = results.usage(engine_pb.GenerateFinished(prompt_tokens=10, generated_tokens=8, unprobed_tokens=2,
                                              dropped_records=3), received=5)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 5, 15)
    assert usage.model_extra == {"generated_tokens": 8, "unprobed_tokens": 2, "dropped_records": 3}
