"""API keys and tenant privacy (issue 12) on stories260K: 401 in OpenAI's format without a key,
/health and /metrics open, /kv_cache behind the admin key with request ids hashed, and the prefix
cache salted per key so one tenant cannot probe another's prompts through cached_tokens."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from conftest import GOLDEN_COMPLETION, GOLDEN_PROMPT

from pagedkv.common.config import EngineConfig
from pagedkv.scheduler.api import build_app
from pagedkv.scheduler.api_keys import APIKeys, fingerprint
from pagedkv.scheduler.cli import _api_keys, build_parser
from pagedkv.scheduler.engine import Engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY_60 = {"prompt": GOLDEN_PROMPT, "max_tokens": 60, "temperature": 0}
ALICE, BOB, ADMIN = "sk-alice", "sk-bob", "sk-admin"
# 50 tokens: three full blocks of 16 can be reused by a repeat (the last token is always computed)
SECRET_PROMPT = [1] + [403, 407, 261, 378, 432] * 9 + [383, 286, 261, 376]


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(stories260k):
    e = await Engine.start(EngineConfig(model=str(stories260k), device="cpu", num_gpu_blocks=64, swap_space=0.001))
    yield e
    await e.shutdown()


async def _url(app) -> tuple[TestServer, str]:
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keyed(engine):
    """Keys for Alice and Bob, an admin key; isolation left to its default (api-key, since keys are set)."""
    server, url = await _url(build_app(engine, api_keys=APIKeys([ALICE, BOB], [ADMIN])))
    async with aiohttp.ClientSession(url) as s:
        yield s
    await server.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_cache(engine):
    """The same keys with --prefix-cache-isolation none: the side channel is open."""
    server, url = await _url(build_app(engine, api_keys=APIKeys([ALICE, BOB], prefix_cache_isolation="none")))
    async with aiohttp.ClientSession(url) as s:
        yield s
    await server.close()


@pytest.mark.parametrize("headers", [{}, bearer("sk-wrong"), {"Authorization": ALICE}, {"Authorization": "Bearer "}],
                         ids=["none", "wrong", "no-scheme", "empty"])
@pytest.mark.parametrize("method,path", [("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                                         ("get", "/v1/models"), ("get", "/kv_cache")])
async def test_request_without_a_valid_key_gets_401_in_openai_format(keyed, headers, method, path):
    resp = await keyed.request(method, path, json=GREEDY_60, headers=headers)
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"] == "Bearer"  # RFC 9110: a 401 names the scheme it wants
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key" and error["param"] is None


@pytest.mark.parametrize("key", [ALICE, BOB, ADMIN])
async def test_every_configured_key_serves_the_golden(keyed, key):
    resp = await keyed.post("/v1/completions", json=GREEDY_60, headers=bearer(key))
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["text"] == GOLDEN_COMPLETION


async def test_health_and_metrics_stay_open(keyed):
    assert (await keyed.get("/health")).status == 200
    assert (await keyed.get("/metrics")).status == 200


async def test_kv_cache_needs_the_admin_key_and_hashes_request_ids(keyed):
    refused = await keyed.get("/kv_cache", headers=bearer(ALICE))  # a user key: valid elsewhere, not here
    assert refused.status == 401
    assert (await refused.json())["error"]["message"] == ("Incorrect API key provided: /kv_cache takes an admin key "
                                                          "(--admin-api-key).")
    assert (await (await keyed.get("/kv_cache", headers=bearer("sk-mallory"))).json())["error"]["message"] == (
        "Incorrect API key provided.")
    resp = await keyed.post("/v1/completions", headers=bearer(ALICE),
                            json={**GREEDY_60, "max_tokens": 400, "ignore_eos": True, "stream": True})
    request_id = json.loads((await resp.content.readuntil(b"\n\n"))[len(b"data: "):])["id"]
    snap = await (await keyed.get("/kv_cache", headers=bearer(ADMIN))).json()
    assert [r["id"] for r in snap["requests"]] == ["sha256:" + fingerprint(request_id)]
    raw = await (await keyed.get("/kv_cache?request_ids=raw", headers=bearer(ADMIN))).json()
    assert [r["id"] for r in raw["requests"]] == [request_id]
    resp.close()


async def _cached_tokens(http, key: str, prompt: list[int]) -> int:
    resp = await http.post("/v1/completions", headers=bearer(key), json={"prompt": prompt, "max_tokens": 1})
    assert resp.status == 200
    return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_prefix_cache_is_salted_per_key_by_default(keyed):
    prompt = SECRET_PROMPT
    assert await _cached_tokens(keyed, ALICE, prompt) == 0
    assert await _cached_tokens(keyed, BOB, prompt) == 0  # Bob cannot tell Alice sent it
    assert await _cached_tokens(keyed, ALICE, prompt) == 48  # Alice's own repeat still hits
    assert await _cached_tokens(keyed, BOB, prompt) == 48


async def test_prefix_cache_isolation_none_shares_the_cache(shared_cache):
    prompt = SECRET_PROMPT[:1] + SECRET_PROMPT[2:] + [262]
    assert await _cached_tokens(shared_cache, ALICE, prompt) == 0
    assert await _cached_tokens(shared_cache, BOB, prompt) == 48  # the side channel the default closes


async def test_openai_client_uses_the_key(keyed):
    base = str(keyed._base_url) + "/v1"
    good = openai.AsyncOpenAI(base_url=base, api_key=BOB, max_retries=0)
    out = await good.completions.create(model="stories260K", prompt=GOLDEN_PROMPT, max_tokens=60, temperature=0)
    assert out.choices[0].text == GOLDEN_COMPLETION
    bad = openai.AsyncOpenAI(base_url=base, api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.completions.create(model="stories260K", prompt=GOLDEN_PROMPT, max_tokens=1)
    await good.close()
    await bad.close()


async def test_keys_come_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("PAGEDKV_API_KEY", "sk-env1, sk-env2")
    parser = build_parser()
    args = parser.parse_args(["serve", "--api-key", "sk-flag", "--admin-api-key", "sk-adm"])
    keys = _api_keys(args, parser)
    for key in ("sk-flag", "sk-env1", "sk-env2", "sk-adm"):
        assert keys.check(f"Bearer {key}", admin_route=False) == fingerprint(key)
    with pytest.raises(PermissionError):
        keys.check("Bearer sk-env1", admin_route=True)
    assert keys.prefix_cache_isolation == "api-key"
    monkeypatch.delenv("PAGEDKV_API_KEY")
    open_args = parser.parse_args(["serve"])
    assert _api_keys(open_args, parser).prefix_cache_isolation == "none"
    assert _api_keys(open_args, parser).check(None, admin_route=True) is None


async def test_an_empty_cache_salt_stays_empty_for_a_tenant_so_the_engine_refuses_it_as_without_keys():
    keys = APIKeys(["k"])
    tenant = fingerprint("k")
    assert keys.cache_salt(tenant, "") == ""  # was f"{tenant}:", accepted where a keyless server gives 400
    assert keys.cache_salt(tenant, None) == f"{tenant}:"
    assert keys.cache_salt(tenant, "s") == f"{tenant}:s"
    assert APIKeys().cache_salt(None, "") == ""
