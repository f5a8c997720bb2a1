"""Third-party clients against a real `pagedkv serve` process: lm-evaluation-harness scores tasks
exactly as transformers would, and chat works through ``--chat-template``.

lm-eval's ``local-completions`` model asks for ``{"echo": true, "logprobs": 1, "max_tokens": 1}`` and
reads the prompt tokens' logprobs; it tokenizes through the server (``tokenizer_backend=remote``:
/tokenizer_info and /tokenize), so nothing comes from a hub. Three tasks written as local JSONL files
(tests/data/lm_eval): a loglikelihood task and a multiple-choice task, where every loglikelihood must
equal transformers' on the same tokens within 1e-4 and the accuracy the one transformers'
loglikelihoods give; and a generate_until task (prompt token ids, ``stop`` = until + EOS, greedy), whose
continuations must be transformers' greedy ones, cut before the stop string.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import Server

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "data" / "lm_eval"
CHAT_TEMPLATE = REPO / "tests" / "data" / "chat_template.jinja"


def _docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def server(stories260k):
    """`pagedkv serve MODEL --chat-template FILE` in a subprocess (stopped with SIGTERM after the module)."""
    server = Server(str(stories260k), "--chat-template", str(CHAT_TEMPLATE), "--num-gpu-blocks", "64",
                    "--swap-space", "0.01", "--device", "cpu")
    yield server
    code, _ = server.stop(signal.SIGTERM)
    assert code == 0


@pytest.fixture(scope="module")
def lm_eval_samples(server, tmp_path_factory) -> dict[str, list[dict]]:
    """Run the lm_eval CLI against the server; its logged samples per task."""
    out = tmp_path_factory.mktemp("lm_eval")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(out / "datasets"), HF_HOME=str(out / "hf"))
    model_args = (f"model=stories260K,base_url={server.url}/v1/completions,tokenizer_backend=remote,"
                  "tokenized_requests=True,num_concurrent=1,max_retries=1")
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions",
                          "--model_args", model_args, "--tasks", "stories_continuation,stories_choice,stories_generate",
                          "--include_path", str(TASKS), "--output_path", str(out / "results"), "--log_samples"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    samples = {}
    for task in ("stories_continuation", "stories_choice", "stories_generate"):
        [path] = (out / "results").rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return samples


@pytest.fixture(scope="module")
def transformers_loglikelihood(stories260k):
    """loglikelihood(context, continuation) with transformers, tokenized as lm-eval does (no BOS; the
    context's trailing spaces move to the continuation; the continuation is what the whole adds)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(stories260k))
    model = transformers.LlamaForCausalLM.from_pretrained(str(stories260k), torch_dtype=torch.float32).eval()

    def loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = tok(context + continuation, add_special_tokens=False).input_ids
        ctx = tok(context, add_special_tokens=False).input_ids
        cont = whole[len(ctx):]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
        rows = logprobs[len(ctx) - 1:len(whole) - 1]  # row i predicts token i + 1
        chosen = rows[torch.arange(len(cont)), torch.tensor(cont)]
        return chosen.sum().item(), bool((rows.argmax(-1) == torch.tensor(cont)).all())

    return loglikelihood


def test_loglikelihood_task_equals_transformers(lm_eval_samples, transformers_loglikelihood):
    docs = _docs("stories_continuation")
    samples = lm_eval_samples["stories_continuation"]
    assert len(samples) == len(docs) == 6
    for doc, sample in zip(docs, samples):
        [[got, got_greedy]] = sample["filtered_resps"]  # logged as strings
        want, want_greedy = transformers_loglikelihood(doc["context"], doc["continuation"])
        assert float(got) == pytest.approx(want, abs=1e-4), doc
        assert float(got) < 0 and (got_greedy == "True") == want_greedy


def test_multiple_choice_accuracy_equals_the_one_from_transformers(lm_eval_samples, transformers_loglikelihood):
    docs = _docs("stories_choice")
    samples = lm_eval_samples["stories_choice"]
    assert len(samples) == len(docs) == 5
    correct = 0
    for doc, sample in zip(docs, samples):
        got = [float(ll) for ll, _ in sample["filtered_resps"]]
        want = [transformers_loglikelihood(doc["context"], c)[0] for c in doc["choices"]]
        assert got == pytest.approx(want, abs=1e-4), doc
        correct += max(range(len(want)), key=want.__getitem__) == doc["label"]
        assert float(sample["acc"]) == float(max(range(len(got)), key=got.__getitem__) == doc["label"])
    assert sum(float(s["acc"]) for s in samples) == correct > 0


# transformers' greedy continuation of each context's ids (no BOS), cut before the first "." or after
# 10 tokens; lm-eval applies no stop strings itself here, so the server must leave "." out
GREEDY_UNTIL_PERIOD = [" loved to play with her toys and", " play with the dog", " a big box with a big bo",
                       "my said, \"Don't wor", ", there was a little girl named Lily"]


def test_generate_until_task_gets_the_greedy_text_cut_before_the_stop_string(lm_eval_samples):
    samples = lm_eval_samples["stories_generate"]
    assert [s["doc"]["context"] for s in samples] == [d["context"] for d in _docs("stories_generate")]
    assert [s["arguments"]["gen_args_0"]["arg_1"]["until"] for s in samples] == [["."]] * 5
    assert [s["resps"][0][0] for s in samples] == GREEDY_UNTIL_PERIOD


def test_serve_with_chat_template_serves_chat_streamed_and_not(server):
    import urllib.request

    with urllib.request.urlopen(server.url + "/v1/models", timeout=60) as resp:
        [card] = json.loads(resp.read())["data"]
    assert card["supports_chat"] is True and card["max_model_len"] == 512
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, "temperature": 0}
    whole = server.post("/v1/chat/completions", body)["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"]
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [line[len(b"data: "):] for line in resp.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]]
    assert "".join(deltas) == whole["message"]["content"]
