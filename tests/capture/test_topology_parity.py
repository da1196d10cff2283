"""TP=2, PP=2 and TP=2 x PP=2 capture the same records as one worker (real vLLM,
real worker processes): same greedy tokens, same keys in the same order, values
within tolerance, for concurrent requests with different selectors. Qwen3 has
one KV head, fewer than the TP ranks, so vLLM replicates it across them.

The one-worker engines run compiled (vLLM's default on CPU); the Llama
topologies run compiled too and the Qwen3 one eager (`--enforce-eager`), so
the parity also holds between the two modes. Each cell proves something of its
own: Llama at TP=2, PP=2 and both, compiled; Qwen3 at TP=2 x PP=2, eager, its
one KV head replicated across the TP ranks of both stages (TP=2 and PP=2 alone
add nothing the other cells do not check)."""

import pytest

from tests.capture.conftest import SMALL_STEPS
from tests.capture.oracle import RELATIVE_TOLERANCE, compare_with_oracle, relative_error
from tests.capture.workloads import mixed_selectors
from tools.capture_engines import capture_engine, run_requests

pytestmark = [pytest.mark.vllm, pytest.mark.multiworker]

TOPOLOGIES = [
    ("llama", 2, 1, False),
    ("llama", 1, 2, False),
    ("llama", 2, 2, False),
    ("qwen3", 2, 2, True),
]


@pytest.fixture(scope="session")
def single_worker_runs():
    """The parity workload's run on each model's one-worker engine, made once."""
    return {}


@pytest.fixture
def case(request):
    """One topology and what it is compared with; fixtures are resolved here
    (synchronously) because async tests cannot request fixtures by name."""
    model, tp, pp, eager = request.param
    return dict(
        model=model,
        tp=tp,
        pp=pp,
        eager=eager,
        one_worker=request.getfixturevalue(f"{model}_engine"),
        oracle=request.getfixturevalue(f"{model}_oracle"),
        path=request.getfixturevalue(f"tiny_{model}_path"),
    )


async def single_worker_run(case, runs):
    if case["model"] not in runs:
        engine, controller = case["one_worker"]
        runs[case["model"]] = await run_requests(engine, controller, mixed_selectors("parity"))
    return runs[case["model"]]


def per_point_order(run):
    keys = {(k[0], k[1]) for k in run.records()}
    return {key: run.arrival_order(*key) for key in sorted(keys)}


@pytest.mark.parametrize(
    "case", TOPOLOGIES, ids=[f"{m}-tp{t}-pp{p}-{'eager' if e else 'compiled'}" for m, t, p, e in TOPOLOGIES], indirect=True
)
async def test_topology_matches_one_worker(case, single_worker_runs):
    model, tp, pp, path = case["model"], case["tp"], case["pp"], case["path"]
    reference = await single_worker_run(case, single_worker_runs)
    requests = mixed_selectors("parity")

    async with capture_engine(path, tp=tp, pp=pp, enforce_eager=case["eager"], **SMALL_STEPS) as (
        engine,
        controller,
    ):
        info = controller.model_info()
        half = 4 // pp
        assert [(r.rank, r.tp_rank, r.pp_rank, r.start_layer, r.end_layer, r.has_final_norm) for r in info.ranks] == [
            (s * tp + t, t, s, s * half, (s + 1) * half, s == pp - 1) for s in range(pp) for t in range(tp)
        ]
        assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (tp, pp)
        assert len(info.tensor_types) == 4
        run = await run_requests(engine, controller, requests)

    assert run.tokens == reference.tokens
    got, want = run.records(), reference.records()
    assert sorted(got) == sorted(want)
    orders = per_point_order(run)
    assert orders == per_point_order(reference)
    for key, order in orders.items():
        assert order == sorted(order), f"{key} not in (token_position, layer) order: {order}"
    # The point spanning every layer (both pipeline stages when pp=2).
    span = orders[("parity-span", "span")]
    assert span[:5] == [(6, 0), (6, 1), (6, 2), (6, 3), (7, 0)]
    worst_vs_one_worker = max(relative_error(got[k], want[k]) for k in want)
    assert worst_vs_one_worker < RELATIVE_TOLERANCE
    worst = compare_with_oracle(case["oracle"], run, requests)
    print(
        f"\n{model} TP={tp} PP={pp} {'eager' if case['eager'] else 'compiled'}: {len(got)} records; worst relative error vs one worker "
        f"{worst_vs_one_worker:.2e}; vs transformers {worst}"
    )
