"""The OpenAI-compatible API through the official `openai` package, against one
real engine process (TLS, client tokens, an operator guards file) and one real
router process, compared with the gRPC API of the same engine.

The guards: every caller gets the observer (fail_open, observe), so every
answer carries scores; the caller `other` also gets the guard (fail_closed,
abort, gated), which fires at generated index MIN_TOKENS - 1 of any request.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import openai
import pytest

from common.probe_format.files import write_probe
from tests.conftest import REPO
from tests.e2e import node_live
from tests.e2e.test_gating import norm_probe
from tools import stack
from tools.dev_security import DevSecurity
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc
from undercurrent.v1 import types_pb2 as types_pb

pytestmark = pytest.mark.vllm

GUARD = "always_fires"  # fires once MIN_TOKENS generated rows were seen
OBSERVER = "observer"
MIN_TOKENS = 6
LONG = 480  # tokens: most of the engine's max_model_len (512)
MODEL = "tiny-llama"
TEMPLATE = REPO / "deploy" / "chat-template.jinja"  # what compose.yaml serves the embedded model with
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
RENDERED = "system: Be brief.\nuser: The quick brown fox\nassistant:"
GUARDS = {
    "default": [{"probe": OBSERVER, "failure_policy": "fail_open", "action": "observe"}],
    "callers": {"other": [{"probe": GUARD, "failure_policy": "fail_closed", "action": "abort",
                           "gate_tokens": True}]},
}
CLIENT_ABORTS = 'undercurrent_engine_requests_finished_total{reason="CLIENT_ABORT"}'
TOKENS = "undercurrent_engine_tokens_generated_total"
VLLM_TOKENS = "vllm:generation_tokens_total"


@pytest.fixture(scope="module")
async def served(tiny_llama_path, tmp_path_factory):
    """(engine service, its OpenAI base URL, its metrics port), with one router."""
    directory = tmp_path_factory.mktemp("openai")
    for manifest in (norm_probe(GUARD, layer=1, action="abort", threshold=0.0, min_tokens=MIN_TOKENS),
                     norm_probe(OBSERVER, layer=2, action="observe", threshold=1e9)):
        write_probe(directory / "probes" / manifest["name"], manifest)
    (directory / "guards.json").write_text(json.dumps(GUARDS))
    router = stack.router(stack.free_port(), directory / "probes")
    openai_port, metrics_port = stack.free_port(), stack.free_port()
    engine = stack.engine(
        tiny_llama_path, router.address, "--openai-port", str(openai_port), "--metrics-port", str(metrics_port),
        "--guards-file", str(directory / "guards.json"), "--chat-template", str(TEMPLATE),
        "--served-model-name", MODEL, "--max-num-seqs", "8", log_stats=True)
    try:
        router.start()
        engine.start()
        await engine.wait_health(timeout=600)  # a loaded 2-core host starts vLLM slowly
        async with stack.channel(engine.address) as channel:
            await stack.wait_for_probe(engine_pb_grpc.EngineServiceStub(channel), GUARD)
        yield engine, f"https://127.0.0.1:{openai_port}/v1", metrics_port
    finally:
        engine.kill()
        router.kill()


def client(base_url: str, token: str | None = None, **kw) -> openai.AsyncOpenAI:
    """The official client, trusting the development CA, as caller `demo` unless given another token."""
    dev = DevSecurity.ensure()
    return openai.AsyncOpenAI(base_url=base_url, api_key=token or dev.client_token, max_retries=0,
                              http_client=httpx.AsyncClient(verify=str(dev.ca)), **kw)


@pytest.fixture
async def demo(served):
    async with client(served[1]) as c:
        yield c


@pytest.fixture
async def other(served):
    async with client(served[1], DevSecurity.ensure().other_client_token) as c:
        yield c


@pytest.fixture
async def engine(served):
    async with stack.channel(served[0].address) as channel:
        yield engine_pb_grpc.EngineServiceStub(channel)


def grpc_request(rid: str, ids: list[int] | None = None, text: str = "", max_tokens: int = 12,
                 gate: bool | None = None, *probes: tuple[str, int]) -> engine_pb.GenerateRequest:
    message = engine_pb.GenerateRequest(request_id=rid, sampling=engine_pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True), gate_tokens=gate)
    if ids is not None:
        message.token_ids.ids.extend(ids)
    else:
        message.text = text
    for probe, policy in probes:
        message.probes.add(probe=probe, failure_policy=policy)
    return message


def extension(obj) -> dict:
    """The `undercurrent` object of an SDK response or chunk."""
    return obj.model_extra["undercurrent"]


def chat_prompt_ids(path: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(RENDERED)["input_ids"]


SAMPLING = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


async def test_models_lists_the_served_model(demo):
    models = await demo.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_a_chat_completion_renders_the_template_and_matches_the_grpc_answer(demo, engine, tiny_llama_path):
    answer = await demo.chat.completions.create(model=MODEL, messages=MESSAGES, **SAMPLING)
    ids = chat_prompt_ids(tiny_llama_path)
    same = await stack.generate(engine, grpc_request("chat-grpc", ids))
    choice = answer.choices[0]
    assert (choice.finish_reason, choice.message.role, choice.message.content) == ("length", "assistant", same.text)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), 12)
    assert answer.usage.model_extra["unprobed_tokens"] == 0 and answer.usage.model_extra["generated_tokens"] == 12
    ext = extension(answer)
    # The default guard is in force on a request that named none, and scored every generated row.
    assert [(b["probe"], b["operator_set"], b["failure_policy"], b["action"]) for b in ext["bindings"]] == [
        (OBSERVER, True, "fail_open", "observe")]
    assert ext["finish_reason"] == "LENGTH" and not ext["gated"] and "verdict" not in ext
    scored = sorted(p for event in ext["scores"] for p in event["token_positions"])
    assert scored == list(range(len(ids), len(ids) + 11))  # the last token is never fed back: it has no row


async def test_a_streamed_chat_sends_the_same_text_in_chunks_then_scores_finish_and_usage(demo):
    whole = await demo.chat.completions.create(model=MODEL, messages=MESSAGES, **SAMPLING)
    stream = await demo.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True}, **SAMPLING)
    chunks = [chunk async for chunk in stream]
    with_choice = [c for c in chunks if c.choices]
    assert with_choice[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choice) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in with_choice][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choice[:-1])
    score_chunks = [c for c in chunks if not c.choices and c.model_extra.get("undercurrent")]
    assert {s["probe"] for c in score_chunks for s in extension(c)["scores"]} == {OBSERVER}
    assert extension(with_choice[-1])["bindings"][0]["probe"] == OBSERVER
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1


async def test_completions_streamed_and_not_match_the_grpc_answer(demo, engine):
    prompt = "Once upon a time"
    same = await stack.generate(engine, grpc_request("cmpl-grpc", text=prompt))
    whole = await demo.completions.create(model=MODEL, prompt=prompt, **SAMPLING)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (same.text, "length")
    assert whole.usage.prompt_tokens == same.finished.prompt_tokens
    stream = await demo.completions.create(model=MODEL, prompt=prompt, stream=True, **SAMPLING)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == same.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def guard_request(gate: bool = True) -> dict:
    return {"undercurrent": {"probes": [{"probe": GUARD, "failure_policy": "fail_closed", "action": "abort"}],
                             "gate_tokens": gate}, "ignore_eos": True}


async def test_a_probe_abort_ends_the_choice_content_filter_with_the_verdict_and_no_token_past_it(demo, engine):
    """Bound in extra_body and gated: the stream shows exactly the tokens before
    the trigger, as gRPC does for the same request."""
    prompt = "A gated request"
    stream = await demo.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stream=True,
                                           stream_options={"include_usage": True}, extra_body=guard_request())
    chunks = [c async for c in stream]
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "content_filter"
    ext = extension(last)
    verdict = ext["verdict"]
    usage = chunks[-1].usage
    assert (verdict["probe"], verdict["generated_index"]) == (GUARD, MIN_TOKENS - 1)
    assert verdict["token_position"] == usage.prompt_tokens + MIN_TOKENS - 1 and verdict["router"]
    assert verdict["score"] >= 0.0 and ext["gated"] and ext["finish_reason"] == "PROBE_ABORT"
    assert usage.completion_tokens == MIN_TOKENS - 1  # no token at or after the trigger
    assert usage.model_extra["generated_tokens"] >= MIN_TOKENS
    grpc_side = await stack.generate(engine, grpc_request("gated-grpc", None, prompt, 40, True,
                                                          (GUARD, types_pb.FAILURE_POLICY_FAIL_CLOSED)))
    assert len(grpc_side.tokens) == MIN_TOKENS - 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == grpc_side.text


async def test_the_operator_guard_holds_on_a_request_that_names_none_on_both_apis(served, other):
    answer = await other.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40,
                                                 extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "content_filter"
    ext = extension(answer)
    assert ext["verdict"]["probe"] == GUARD and ext["verdict"]["generated_index"] == MIN_TOKENS - 1 and ext["gated"]
    assert {(b["probe"], b["operator_set"]) for b in ext["bindings"]} == {(OBSERVER, True), (GUARD, True)}
    assert answer.usage.completion_tokens == MIN_TOKENS - 1
    async with stack.channel(served[0].address, DevSecurity.ensure().other_client_token) as channel:
        outcome = await stack.generate(engine_pb_grpc.EngineServiceStub(channel), grpc_request("other-grpc", text="hi",
                                                                                         max_tokens=40))
    assert outcome.reason == "PROBE_ABORT" and outcome.finished.gated and len(outcome.tokens) == MIN_TOKENS - 1
    assert [(b.probe, b.operator_set) for b in outcome.finished.bindings][0] == (OBSERVER, True)


@pytest.mark.parametrize("body, param", [
    ({"undercurrent": {"probes": [{"probe": GUARD, "failure_policy": "fail_open"}]}},
     "undercurrent.probes[0].failure_policy"),
    ({"undercurrent": {"probes": [{"probe": GUARD, "action": "observe"}]}}, "undercurrent.probes[0].action"),
    ({"undercurrent": {"gate_tokens": False}}, "undercurrent.gate_tokens"),
])
async def test_a_request_weakening_the_operator_guard_is_refused_naming_the_field(other, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        await other.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=body)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    assert "operator-set binding of 'always_fires'" in err.value.body["message"]


async def test_a_grpc_request_weakening_the_operator_guard_is_refused_the_same_way(served):
    async with stack.channel(served[0].address, DevSecurity.ensure().other_client_token) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(engine_pb_grpc.EngineServiceStub(channel), grpc_request(
                "weaker", None, "hi", 4, None, (GUARD, types_pb.FAILURE_POLICY_FAIL_OPEN)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("probes[0].failure_policy: FAIL_OPEN would weaken the operator-set")


@pytest.mark.parametrize("kwargs, status, param", [
    (dict(logprobs=True), 400, "logprobs"),
    (dict(n=2), 400, "n"),
    (dict(extra_body={"frobnicate": 1}), 400, "frobnicate"),
    (dict(temperature=-1), 400, "temperature"),
    (dict(max_tokens=5000), 400, "max_tokens"),
    (dict(extra_body={"undercurrent": {"probes": [{"probe": "no_such_probe"}]}}), 404, "undercurrent.probes[0].probe"),
    (dict(extra_body={"undercurrent": {"probes": [{"probe": GUARD, "failure_policy": "sometimes"}]}}), 400,
     "undercurrent.probes.0.failure_policy"),
    (dict(extra_body={"undercurrent": {"request_id": "x\n"}}), 400, "undercurrent.request_id"),
])
async def test_bad_input_gets_an_openai_shaped_error_naming_the_field(demo, kwargs, status, param):
    with pytest.raises(openai.APIStatusError) as err:
        await demo.chat.completions.create(model=MODEL, messages=MESSAGES, **{"max_tokens": 4, **kwargs})
    body = err.value.body
    assert err.value.status_code == status and set(body) >= {"message", "type", "param"}, body
    assert body["param"] == param, body


async def test_an_unknown_model_is_404_and_malformed_messages_400(demo):
    with pytest.raises(openai.NotFoundError) as err:
        await demo.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        await demo.chat.completions.create(model=MODEL, messages=[{"content": "no role"}])
    assert err.value.body["param"].startswith("messages.0")


async def test_a_missing_or_wrong_token_is_401(served):
    async with client(served[1], "not-a-token-of-this-engine") as wrong:
        with pytest.raises(openai.AuthenticationError) as err:
            await wrong.models.list()
    assert "not valid" in err.value.body["message"]
    dev = DevSecurity.ensure()
    async with httpx.AsyncClient(verify=str(dev.ca)) as raw:
        reply = await raw.post(f"{served[1]}/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert reply.status_code == 401 and "Authorization: Bearer" in reply.json()["error"]["message"]


def vllm_total(port: int, name: str) -> float:
    """One of vLLM's own series, summed over its labels."""
    return sum(value for sample, value in stack.scrape(port).items() if sample.split("{")[0] == name)


async def first_choice(lines) -> None:
    async for line in lines:
        if line.startswith("data:") and '"choices":[{' in line:
            return


@pytest.mark.parametrize("streamed", [True, False])
async def test_a_client_that_disconnects_aborts_its_request_in_vllm(served, streamed):
    """vLLM runs in short bursts (it could otherwise finish all its tokens before
    the client leaves): the request is running when the client goes away, and
    vLLM counts it aborted long before its LONG tokens."""
    engine, base_url, port = served
    before, vllm_tokens_before = stack.scrape(port), vllm_total(port, VLLM_TOKENS)
    dev = DevSecurity.ensure()
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": streamed}
    headers = {"Authorization": f"Bearer {dev.client_token}"}
    async with httpx.AsyncClient(verify=str(dev.ca), timeout=120) as raw:
        with stack.vllm_paused(engine) as vllm:
            if streamed:
                async with raw.stream("POST", f"{base_url}/completions", json=body, headers=headers) as reply:
                    assert reply.status_code == 200, await reply.aread()
                    first = asyncio.ensure_future(first_choice(reply.aiter_lines()))
                    async with asyncio.timeout(120):
                        while not first.done():
                            await vllm.run_for(0.02)
                            await asyncio.sleep(0.05)
                # Leaving the block closed the connection mid-stream.
            else:
                call = asyncio.create_task(raw.post(f"{base_url}/completions", json=body, headers=headers))
                async with asyncio.timeout(120):
                    while stack.scrape(port)[TOKENS] == before[TOKENS]:
                        assert not call.done(), call.result().text
                        await vllm.run_for(0.02)
                        await asyncio.sleep(0.05)
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
            await asyncio.sleep(1.0)  # the engine notices while vLLM is still held
    await stack.wait_metric(port, CLIENT_ABORTS, lambda n: n == before.get(CLIENT_ABORTS, 0) + 1)
    # vLLM's own count of tokens it generated settles far short of the request's:
    # it stopped computing it (unaborted, it would run on to LONG).
    last, still_since = None, None
    async with asyncio.timeout(120):
        while still_since is None or time.monotonic() - still_since < 3.0:
            now = vllm_total(port, VLLM_TOKENS)
            if now != last:
                last, still_since = now, time.monotonic()
            await asyncio.sleep(0.2)
    assert 0 < last - vllm_tokens_before < LONG / 2


async def test_the_openai_npm_package_streams_aborts_and_meets_the_guard_and_the_door(served, tmp_path):
    """clients/node/test/openai.test.js, with the official `openai` npm package."""
    summary, output = await node_live.run_openai({"model": MODEL, "guard": GUARD, "minTokens": MIN_TOKENS},
                                                 tmp_path, served[1])
    assert summary == {"pass": "3", "fail": "0", "skipped": "0"}, output
