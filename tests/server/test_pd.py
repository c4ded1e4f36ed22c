"""Prefill/decode disaggregation in one process: a prefill app, a decode app and the proxy, KV over the in-process
transport, driven by the openai client. Greedy tokens through the proxy equal a single engine's for every lossless
profile; a lossy profile finishes with its quality recorded; a killed, corrupt or refused hand-off ends in a
recompute with the right tokens; the proxy routes around a dead prefill instance."""
from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from kvtide import SamplingParams
from kvtide.benchmarks.procs import free_port
from kvtide.server.config import role_restore_defaults
from kvtide.config import RestoreConfig
from kvtide.engine.llm import LLM
from kvtide.server.app import build_app
from kvtide.server.config import ServerConfig
from kvtide.server.proxy import Proxy, build_proxy_app
from kvtide.transfer.baselines import BF16, ZIPFUSION
from kvtide.transfer.transport import InProcTransport

from .app_thread import app_thread

MODEL = "smollm2-135m"
TOKENS = 8
# prompts of several 16-token pages, greedy continuations with clear margins (checked against the reference below)
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that large values of n "
    "do not exhaust the recursion limit of the interpreter.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize foods "
    "from carbon dioxide and water. Photosynthesis in plants generally involves the green pigment",
]
# the KVServe table of the bundled model (kvtide bench kvserve-profiles): profiled quality of its lossy profiles
TABLE = Path(__file__).resolve().parents[2] / "bench" / "results" / "kvserve_table_smollm2-135m_prose.json"
KIVI = "none|kivi:k=2,v=2,g=32|pack"  # in the table
LOSSLESS = [BF16, "none|none|zstd", ZIPFUSION]
# each profile gets its own copies of the prompts (else the decode side's device prefix cache serves the repeats)
VARIANTS = {spec: [f"Part {i + 1}. {p}" for p in PROMPTS] for i, spec in enumerate(LOSSLESS)}
KILLED = PROMPTS[0] + " Later,"  # not transferred before: the prefill side holds it only after its own prefill
KEYED = "Part 9. " + PROMPTS[2]  # sent under a policy key of its own


def _engine(role: str | None) -> LLM:
    restore = RestoreConfig(**role_restore_defaults(role, 16)) if role else None
    return LLM(MODEL, device="cpu", cache={"num_pages": 256}, restore=restore, progress=False)


class Cluster:
    def __init__(self, prefill_app, decode_app, proxy_url: str, prefill_url: str, decode_url: str):
        self.prefill = prefill_app.state.serving
        self.decode = decode_app.state.serving
        self.url = proxy_url
        self.prefill_url, self.decode_url = prefill_url, decode_url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(self, prompt: str, **extra) -> dict:
        with httpx.Client(timeout=120) as c:
            r = c.post(self.url + "/v1/completions", json={"prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                                                           "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def decode_metric(self, name: str, **labels: str) -> float:
        reg = self.decode.metrics.registry
        v = reg.get_sample_value(name, {"model_name": MODEL, **labels})
        return 0.0 if v is None else v


@pytest.fixture(scope="module")
def reference():
    llm = _engine(None)
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompts = [*PROMPTS, KEYED, KILLED, KILLED.replace("Later", "Then"), KILLED.replace("Later", "Next"),
               *(p for v in VARIANTS.values() for p in v)]
    return {p: o.text for p, o in zip(prompts, llm.generate(prompts, greedy))}


@pytest.fixture(scope="module")
def cluster():
    pre_llm, dec_llm = _engine("prefill"), _engine("decode")
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    pre_cfg = ServerConfig(port=ports[0], role="prefill", kv_transport="inproc", advertise_url=urls[0],
                           kv_transfer_timeout_s=10, log_stats_interval_s=0, kv_profiles=str(TABLE))
    dec_cfg = ServerConfig(port=ports[1], role="decode", kv_transport="inproc", kv_transfer_timeout_s=10,
                           log_stats_interval_s=0, kv_accept_lossy=True)
    pre_app = build_app(pre_llm, pre_cfg, transport=InProcTransport())
    dec_app = build_app(dec_llm, dec_cfg, transport=InProcTransport())
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the proxy must route around it
    proxy_app = build_proxy_app(Proxy([dead, urls[0]], [urls[1]], down_s=0.0))
    with app_thread(pre_app, ports[0]), app_thread(dec_app, ports[1]), app_thread(proxy_app, ports[2]):
        yield Cluster(pre_app, dec_app, urls[2], urls[0], urls[1])


@pytest.mark.parametrize("spec", LOSSLESS)
def test_lossless_profiles_give_the_single_instance_tokens(cluster, reference, spec):
    restorer = cluster.decode.llm.engine.restorer
    before = (restorer.stats.recomputed_tokens, restorer.stats.restored_tokens,
              cluster.decode_metric("kvtide:kv_transfer_tokens_total"))
    for prompt in VARIANTS[spec]:
        body = cluster.complete(prompt, kv_transfer={"profile": spec})
        assert body["choices"][0]["text"] == reference[prompt]
        kv = body["kv_transfer"]
        assert kv["used"], kv
        assert kv["spec"] == spec and kv["quality"] == 1.0
        r = kv["restore"]  # the restoration that put the handed-off KV in place: all of it loaded
        assert r["load_bytes"] > 0 and r["fallback_tokens"] == 0, r
        assert r["load_s"] > 0 and r["total_s"] > 0, r
    st = restorer.stats
    moved = cluster.decode_metric("kvtide:kv_transfer_tokens_total") - before[2]
    assert moved > 0
    assert st.restored_tokens - before[1] == moved  # every transferred token came back from the hand-off ...
    assert st.recomputed_tokens == before[0]  # ... loaded, none recomputed
    name = "bf16" if spec == BF16 else spec
    assert cluster.decode_metric("kvtide:kv_transfer_profile_total", profile=name) >= len(PROMPTS)


def test_the_controller_chooses_a_lossless_profile_by_default(cluster, reference):
    body = cluster.complete(KILLED.replace("Later", "Then"))
    kv = body["kv_transfer"]
    assert kv["used"] and kv["quality"] == 1.0 and kv["spec"] in LOSSLESS, kv


def test_streamed_through_the_proxy(cluster, reference):
    text = "".join(c.choices[0].text for c in cluster.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "kv_transfer": {"profile": ZIPFUSION}}))
    assert text == reference[PROMPTS[0]]


def test_lossy_profile_records_its_quality(cluster):
    body = cluster.complete(PROMPTS[1], kv_transfer={"min_quality": 0.9, "profile": KIVI})
    kv = body["kv_transfer"]
    assert kv["used"] and 0.9 < kv["quality"] < 1.0 and kv["profile"] == KIVI, kv
    assert kv["wire_bytes"] < kv["raw_bytes"]
    assert body["usage"]["completion_tokens"] == TOKENS


def test_a_decode_instance_not_taking_lossy_kv_gets_lossless(cluster, reference):
    cluster.decode.cfg.kv_accept_lossy = False
    try:
        body = cluster.complete(KILLED.replace("Later", "Next"), kv_transfer={"min_quality": 0.9})
    finally:
        cluster.decode.cfg.kv_accept_lossy = True
    kv = body["kv_transfer"]
    assert kv["used"] and kv["quality"] == 1.0 and kv["spec"] in LOSSLESS and "lossless" in kv["note"], kv
    assert body["choices"][0]["text"] == reference[KILLED.replace("Later", "Next")]


def test_lossy_profile_refused_for_a_lossless_request(cluster, reference):
    before = cluster.decode_metric("kvtide:kv_transfer_fallbacks_total", reason="refused")
    body = cluster.complete(PROMPTS[2], kv_transfer={"profile": KIVI})  # min_quality 1.0: the decode side refuses
    assert body["kv_transfer"]["used"] is False
    assert body["choices"][0]["text"] == reference[PROMPTS[2]]
    assert cluster.decode_metric("kvtide:kv_transfer_fallbacks_total", reason="refused") == before + 1


def test_transfer_killed_midway_is_recomputed(cluster, reference):
    transport = cluster.prefill.pd.transport
    transport.fail_after_bytes = 50_000  # the write that crosses it fails: a partial hand-off
    try:
        before = cluster.decode.llm.engine.restorer.stats.restored_tokens
        body = cluster.complete(KILLED, kv_transfer={"profile": BF16})
    finally:
        transport.reset_hooks()
    assert body["kv_transfer"]["used"] is False
    assert body["choices"][0]["text"] == reference[KILLED]
    # the chunks PROMPTS[0] shares with it came from earlier hand-offs; none of this one's partial layers is used
    assert cluster.decode_metric("kvtide:kv_transfer_fallbacks_total", reason="transport") >= 1


def test_a_policy_key_keeps_its_own_state(cluster, reference):
    policy = cluster.prefill.pd.policy
    peer = cluster.decode.pd.transport.session
    own = policy.observed(peer)
    body = cluster.complete(KEYED, kv_transfer={"profile": BF16, "policy_key": "arm-a"})
    kv = body["kv_transfer"]
    assert kv["used"] and body["choices"][0]["text"] == reference[KEYED], kv
    assert not kv["bandwidth_measured"]  # arm-a had measured nothing yet: the guess, not the instance's meter
    # the transfer fed arm-a's meter only; the instance's own state (and so its next decision) never saw it
    assert policy.observed(peer, "arm-a") == 1 and policy.observed(peer) == own
    body = cluster.complete(KEYED, kv_transfer={"policy_key": "arm-a"})  # the controller under arm-a
    kv = body["kv_transfer"]
    assert kv["used"] and kv["bandwidth_measured"] and kv["quality"] == 1.0, kv
    assert policy.observed(peer, "arm-a") == 2 and policy.observed(peer) == own


def test_a_policy_key_past_the_bound_is_refused_and_recomputed(cluster, reference):
    policy = cluster.prefill.pd.policy
    keep = policy.max_keys
    policy.max_keys = len(policy.keys()) - 1  # every named slot taken
    try:
        body = cluster.complete(PROMPTS[1], kv_transfer={"profile": BF16, "policy_key": "one-too-many"})
    finally:
        policy.max_keys = keep
    kv = body["kv_transfer"]
    assert kv["used"] is False and "409" in kv["message"] and "policy_key" in kv["message"], kv
    assert body["choices"][0]["text"] == reference[PROMPTS[1]]
    assert "one-too-many" not in policy.keys()


def test_the_proxy_routed_around_the_dead_prefill(cluster):
    with httpx.Client(timeout=30) as c:
        text = c.get(cluster.url + "/metrics").text
    assert 'kvtide:proxy_instance_errors_total{role="prefill"}' in text
    assert 'kvtide:proxy_requests_total{route="disaggregated"}' in text


def test_pull_checks_its_body(cluster):
    with httpx.Client(timeout=30) as c:
        r = c.post(cluster.prefill_url + "/v1/kv/pull", json={"token_ids": [1, 2, 3], "key_space": "x"})
        assert r.status_code == 409 and "key spaces differ" in r.json()["error"]["message"]
        r = c.post(cluster.prefill_url + "/v1/kv/pull", json={"token_ids": "nope"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids"
        space = cluster.prefill.pd.space
        r = c.post(cluster.prefill_url + "/v1/kv/pull", json={"token_ids": [1, 2, 3], "key_space": space,
                                                              "dst": {"session": "s", "addr": -1, "nbytes": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dst"
        dst = {"session": "s", "addr": 0, "nbytes": 1}
        r = c.post(cluster.prefill_url + "/v1/kv/pull", json={"token_ids": [1, 2, 3], "key_space": space,
                                                              "dst": dst, "policy_key": "a b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "policy_key"


def test_bad_kv_transfer_fields_are_400(cluster):
    with httpx.Client(timeout=30) as c:
        r = c.post(cluster.decode_url + "/v1/completions", json={"prompt": "hi", "kv_transfer": {"min_quality": 2}})
        assert r.status_code == 400
        r = c.post(cluster.decode_url + "/v1/completions", json={"prompt": "hi", "kv_transfer": {"policy_key": 3}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer.policy_key"
        r = c.post(cluster.decode_url + "/v1/completions", json={"prompt": "hi", "kv_transfer_params": [1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
