"""The OpenAI-compatible server (``engine.serving.openai_api``) through the official ``openai`` client against a real
uvicorn server on a free port: greedy output equal to AR's, streamed or not; stop strings; usage; many clients at
once; a client that leaves mid-stream; every refusal in OpenAI's error shape; the traces the Studio reads. Mostly on
the tiny float64 model (``tests/tiny.py``); a few on the bundled SmolLM2 and the shipped drafter."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn

from engine.loop.decode import Decoder
from engine.loop.settings import DecodeSettings
from engine.serving.model_queue import ModelQueue
from engine.serving.openai_api import ServeOptions, create_app
from engine.tools import serve
from engine.trace import SCHEMA_VERSION, Trace
from tests.conftest import free_port
from tests.tiny import tiny_decoder

TINY = "tiny-llama"
BUDGET = 8
TOKENS = 24
PROMPTS = ["Hello!", "What_is_a_tree?", "Count:1,2,3", "Why?"]  # the tiny model's characters: no spaces
STARTUP_S = 30


@contextmanager
def serving(decoder: Decoder, queue: ModelQueue | None = None, **options) -> Iterator[str]:
    """A real uvicorn server on the app, in a thread; yields the API's base URL."""
    port = free_port()
    config = uvicorn.Config(create_app(decoder, ServeOptions(**options), queue), host="127.0.0.1", port=port,
                            log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=STARTUP_S)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tiny_url() -> Iterator[str]:
    with serving(tiny_decoder(0), tree_budget=BUDGET) as url:
        yield url


@pytest.fixture(scope="module")
def twin() -> Decoder:
    """The served decoder's twin (same seed, same weights), run here for the answers expected."""
    return tiny_decoder(0)


def solo(decoder: Decoder, prompt: str, method: str = "ar", max_tokens: int = TOKENS) -> Trace:
    return decoder.run(prompt_ids=decoder.target.text_ids(prompt),
                       settings=DecodeSettings(method, max_new_tokens=max_tokens, tree_budget=BUDGET))


def ask(url: str, endpoint: str, prompt: str, stream: bool = False, model: str = TINY, **kwargs) -> dict:
    """One request as a client makes it; the answer's text, finish reason, usage and ddtree object (a stream's
    joined from its chunks)."""
    api = client(url)
    if endpoint == "chat":
        answer = api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                             stream=stream, **kwargs)
    else:
        answer = api.completions.create(model=model, prompt=prompt, stream=stream, **kwargs)
    if not stream:
        choice = answer.choices[0]
        text = choice.message.content if endpoint == "chat" else choice.text
        return {"id": answer.id, "text": text, "finish_reason": choice.finish_reason, "usage": answer.usage,
                "ddtree": answer.model_extra["ddtree"]}
    chunks = list(answer)
    pieces = [(c.choices[0].delta.content if endpoint == "chat" else c.choices[0].text) or ""
              for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return {"id": chunks[0].id, "text": "".join(pieces), "pieces": pieces, "finish_reason": finishes[-1],
            "usage": chunks[-1].usage, "ddtree": chunks[-1].model_extra["ddtree"], "chunks": len(chunks)}


def traces(url: str) -> list[dict]:
    return httpx.get(f"{url}/traces").json()["data"]


def trace_of(url: str, trace_id: str) -> Trace:
    data = httpx.get(f"{url}/traces/{trace_id}").json()
    assert data["schema_version"] == SCHEMA_VERSION and len(data["traces"]) == 1
    return Trace.from_dict(data["traces"][0])


# ---------------------------------------------------------------- answers

@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize("stream", [False, True])
def test_every_method_answers_ars_greedy_text_streamed_or_not(tiny_url, twin, endpoint, method, stream):
    reference, alone = solo(twin, PROMPTS[1]), solo(twin, PROMPTS[1], method)
    options = {"stream_options": {"include_usage": True}} if stream else {}
    answer = ask(tiny_url, endpoint, PROMPTS[1], stream, max_tokens=TOKENS, extra_body={"method": method}, **options)
    assert answer["text"] == reference.text
    assert answer["finish_reason"] == ("stop" if reference.summary.stop_reason == "eos" else "length")
    tokenizer = twin.target.tokenizer
    usage = answer["usage"]
    assert usage.prompt_tokens == len(tokenizer(PROMPTS[1])["input_ids"])
    # the tokenizer's count of the text, and the stop token the text leaves out
    assert usage.completion_tokens == len(tokenizer(answer["text"])["input_ids"]) + (answer["finish_reason"] == "stop")
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    ddtree = answer["ddtree"]
    assert ddtree == {"method": method, "tree_budget": BUDGET if method == "ddtree" else None,
                      "seed": ddtree["seed"], "tau": round(alone.summary.tau, 4), "steps": alone.summary.steps,
                      "tokens_per_s": ddtree["tokens_per_s"], "trace_id": ddtree["trace_id"]}
    assert 0 <= ddtree["seed"] < 2**63
    assert ddtree["tokens_per_s"] > 0 and answer["id"].endswith(ddtree["trace_id"].removeprefix("trace-"))
    if stream:
        assert len([piece for piece in answer["pieces"] if piece]) > 1, "the text arrives step by step"


def test_a_request_without_a_method_runs_the_servers_default(tiny_url, twin):
    answer = ask(tiny_url, "completions", PROMPTS[0], max_tokens=8)
    assert answer["ddtree"]["method"] == "ddtree" and answer["ddtree"]["tree_budget"] == BUDGET
    assert answer["text"] == solo(twin, PROMPTS[0], max_tokens=8).text


def test_a_sampled_request_is_its_seeds_run(tiny_url, twin):
    settings = DecodeSettings("ddtree", max_new_tokens=12, temperature=0.8, seed=5, tree_budget=BUDGET)
    expected = twin.run(prompt_ids=twin.target.text_ids(PROMPTS[0]), settings=settings).text
    answers = [ask(tiny_url, "completions", PROMPTS[0], stream, max_tokens=12, temperature=0.8, seed=seed)["text"]
               for stream, seed in ((False, 5), (True, 5), (False, 6))]
    assert answers[:2] == [expected, expected] and answers[2] != expected


def test_a_sampled_request_without_a_seed_is_a_fresh_sample_and_says_its_seed(tiny_url, twin):
    unseeded = [ask(tiny_url, "completions", PROMPTS[0], stream, max_tokens=16, temperature=1.0)
                for stream in (False, True, False)]
    assert len({answer["text"] for answer in unseeded}) == 3, "each request draws its own sample"
    for answer in unseeded:  # and repeats exactly with the seed it was given
        again = ask(tiny_url, "completions", PROMPTS[0], max_tokens=16, temperature=1.0, seed=answer["ddtree"]["seed"])
        assert again["text"] == answer["text"]


@pytest.mark.parametrize("stream", [False, True])
# the second: the text's first five characters, where one token a step must show nothing until it is known
@pytest.mark.parametrize("start, length, others", [(12, 2, ["never!in!this!text"]), (0, 5, [])])
def test_a_stop_string_cuts_the_text_and_ends_the_run(tiny_url, twin, stream, start, length, others):
    full = solo(twin, PROMPTS[2], max_tokens=40).text
    stop = full[start:start + length]
    cut = full[:full.index(stop)]
    answer = ask(tiny_url, "chat", PROMPTS[2], stream, max_tokens=40, stop=[stop, *others],
                 stream_options={"include_usage": True} if stream else None, extra_body={"method": "ar"})
    assert answer["text"] == cut and answer["finish_reason"] == "stop"
    assert answer["usage"].completion_tokens == len(cut) + len(stop), "one character a token, through the stop"
    trace = trace_of(tiny_url, answer["ddtree"]["trace_id"])
    assert len(trace.output_ids) < 40 and trace.summary.stop_reason == "cancelled", "the run ended at the stop"


def test_sixteen_clients_at_once_each_get_their_own_answer(tiny_url, twin):
    asks = [(endpoint, prompt, method, stream) for endpoint in ("chat", "completions") for prompt in PROMPTS
            for method, stream in (("ar", False), ("ddtree", True))]
    assert len(asks) == 16

    def one(request):
        endpoint, prompt, method, stream = request
        return ask(tiny_url, endpoint, prompt, stream, max_tokens=12, extra_body={"method": method})["text"]

    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(one, asks))
    assert answers == [solo(twin, prompt, max_tokens=12).text for _, prompt, _, _ in asks]


def test_clients_at_once_share_decoding_steps_and_each_trace_says_with_whom(slow_url):
    """Continuous batching: requests in flight together verify in the same steps; a request's trace names its
    neighbours per step, and its text is still its solo answer."""
    asks = [(prompt, method) for prompt, method in zip(PROMPTS, ("ar", "dflash", "ddtree", "ddtree"))]

    def one(request):
        prompt, method = request
        return ask(slow_url, "completions", prompt, max_tokens=24, extra_body={"method": method})

    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(one, asks))
    twin = tiny_decoder(0)
    twin.target.stop_ids = []
    names = {answer["ddtree"]["trace_id"] for answer in answers}
    for (prompt, _), answer in zip(asks, answers):
        assert answer["text"] == solo(twin, prompt, max_tokens=24).text
        trace = trace_of(slow_url, answer["ddtree"]["trace_id"])
        sizes = [step.batch.size for step in trace.steps]
        assert max(sizes) >= 2, "it shared steps"
        neighbours = {name for step in trace.steps for name in step.batch.neighbours}
        assert neighbours and neighbours <= names - {answer["ddtree"]["trace_id"]}


def test_a_server_one_at_a_time_runs_each_request_alone(twin):
    with serving(tiny_decoder(0), tree_budget=BUDGET, batching=False) as url:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda prompt: ask(url, "completions", prompt, max_tokens=8), PROMPTS[:3]))
        for prompt, answer in zip(PROMPTS, answers):
            trace = trace_of(url, answer["ddtree"]["trace_id"])
            assert answer["text"] == solo(twin, prompt, max_tokens=8).text
            assert all(step.batch is None for step in trace.steps) and trace.config.step == "readable"


@pytest.fixture()
def slow_url() -> Iterator[str]:
    """A server whose model takes 10 ms a pass and never meets a stop token: a long run ends only at its limit."""
    decoder = tiny_decoder(0)
    decoder.target.stop_ids = []
    forward, verify = decoder.target.forward, decoder.target.verify_batch
    decoder.target.forward = lambda *args, **kwargs: time.sleep(0.01) or forward(*args, **kwargs)
    decoder.target.verify_batch = lambda *args, **kwargs: time.sleep(0.01) or verify(*args, **kwargs)
    with serving(decoder, tree_budget=BUDGET) as url:
        yield url


def test_a_client_that_leaves_mid_stream_stops_its_run_and_the_server_serves_on(slow_url):
    stream = client(slow_url).chat.completions.create(model=TINY, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                      max_tokens=400, stream=True, extra_body={"method": "ar"})
    for number, _ in enumerate(stream):
        if number == 2:
            break
    stream.close()
    answer = ask(slow_url, "completions", PROMPTS[3], max_tokens=10, extra_body={"method": "ddtree"})
    twin = tiny_decoder(0)
    twin.target.stop_ids = []
    assert answer["text"] == solo(twin, PROMPTS[3], max_tokens=10).text
    left = traces(slow_url)[-1]
    assert left["finish_reason"] == "cancelled" and 2 <= left["tokens"] < 400


def test_a_client_that_leaves_before_a_whole_answer_stops_its_run_too(slow_url):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow_url}/completions", json={"model": TINY, "prompt": PROMPTS[1], "max_tokens": 400,
                                                    "method": "ar"}, timeout=1.0)
    deadline = time.monotonic() + STARTUP_S
    while not traces(slow_url):  # the run ends at its next step after the server sees the client gone
        assert time.monotonic() < deadline, "the run went on"
        time.sleep(0.1)
    left = traces(slow_url)[0]
    assert left["finish_reason"] == "cancelled" and left["tokens"] < 400


# ---------------------------------------------------------------- refusals

BAD_CHATS = [
    ({"messages": []}, 400, "messages", "messages: List should have at least 1 item after validation, not 0"),
    ({"extra_body": {"method": "beam"}}, 400, "method", "unknown method 'beam'; choose from ar, dflash, ddtree"),
    ({"max_tokens": 0}, 400, "max_tokens", "max new tokens must be a whole number from 1 to 4096, got 0"),
    ({"max_tokens": -3}, 400, "max_tokens", "max new tokens must be a whole number from 1 to 4096, got -3"),
    ({"max_completion_tokens": 5000, "max_tokens": None}, 400, "max_completion_tokens",
     "max new tokens must be a whole number from 1 to 4096, got 5000"),
    ({"max_tokens": 500}, 400, "max_tokens", "max_tokens 500 and the prompt's 6 tokens exceed the model's context "
                                             "of 512 tokens: at most 490 new tokens fit after this prompt"),
    ({"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages",
     "the prompt's 600 tokens fill the model's context of 512 tokens: shorten it"),
    ({"extra_body": {"tree_budget": 0}}, 400, "tree_budget",
     'tree budget must be "auto" or a whole number from 1 to 1024, got 0'),
    ({"extra_body": {"tree_budget": 5000}}, 400, "tree_budget",
     'tree budget must be "auto" or a whole number from 1 to 1024, got 5000'),
    ({"extra_body": {"tree_budget": "many"}}, 400, "tree_budget",
     "tree budget must be \"auto\" or a whole number from 1 to 1024, got 'many'"),
    ({"seed": 2**70}, 400, "seed", f"seed must be a whole number from 0 to {2**63 - 1}, got {2**70}"),
    ({"temperature": 2.5}, 400, "temperature", "temperature must be a number from 0 to 2, got 2.5"),

    ({"n": 2}, 400, "n", "n must be 1: this server returns one choice per request"),
    ({"model": "gpt-4o"}, 404, "model", "The model `gpt-4o` does not exist: this server runs `tiny-llama`"),
    ({"max_tokens": "ten"}, 400, "max_tokens",
     "max_tokens: Input should be a valid integer, unable to parse string as an integer"),
    ({"temperature": -1}, 400, "temperature", "temperature must be a number from 0 to 2, got -1.0"),
    ({"messages": "Hello!"}, 400, "messages", "messages: Input should be a valid list"),
    ({"stop": ["a", ""]}, 400, "stop", "stop takes 1 to 4 non-empty strings"),
    ({"logprobs": True}, 400, "logprobs", "logprobs are not supported"),
    ({"tools": [{"type": "function", "function": {"name": "now"}}]}, 400, "tools",
     "tools is not supported by this server"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format",
     "response_format is not supported by this server"),
    ({"messages": [{"role": "system", "content": "Be_brief."}, {"role": "user", "content": "Hi"}]}, 400, "messages",
     "tiny-llama has no chat template to mark the turns of a conversation: send one user message, or the text "
     "itself as a completion"),
]


@pytest.mark.parametrize("bad, status, param, message", BAD_CHATS, ids=[row[2] for row in BAD_CHATS])
def test_bad_input_is_refused_in_openais_shape_naming_the_field(tiny_url, bad, status, param, message):
    request = {"model": TINY, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4} | bad
    with pytest.raises(openai.APIStatusError) as refused:
        client(tiny_url).chat.completions.create(**request)
    assert refused.value.status_code == status
    assert isinstance(refused.value, openai.NotFoundError if status == 404 else openai.BadRequestError)
    assert refused.value.body == {"message": message, "type": "invalid_request_error", "param": param,
                                  "code": "model_not_found" if status == 404 else None}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint, body, param, text", [
    ("chat/completions", '"messages": [{"role": "user", "content": "bad \\ud800"}]', "messages",
     "\\ud800' at character 4"),
    ("chat/completions", '"messages": [{"role": "user", "content": "Hi"}], "stop": ["\\udfff"]', "messages",
     "\\udfff' at character 0"),
    ("completions", '"prompt": "bad \\ud800"', "prompt", "\\ud800' at character 4"),
])
def test_a_lone_surrogate_is_refused_before_any_answer_starts(tiny_url, stream, endpoint, body, param, text):
    """Valid JSON (``"\\ud800"`` is an escape JSON allows), but no text: a 400 naming the field, streamed or not
    (never a 200 followed by an error)."""
    raw = f'{{"model": "{TINY}", "max_tokens": 4, "stream": {json.dumps(stream)}, {body}}}'
    refused = httpx.post(f"{tiny_url}/{endpoint}", content=raw, headers={"content-type": "application/json"})
    assert refused.status_code == 400
    assert refused.json() == {"error": {"message": f"{param} holds a lone surrogate ('{text}), which is not text: "
                                                   "send valid Unicode", "type": "invalid_request_error",
                                        "param": param, "code": None}}


def test_a_completion_refuses_what_only_a_chat_takes_and_what_it_does_not_do(tiny_url):
    api = client(tiny_url)
    refusals = (({"echo": True}, "echo"), ({"extra_body": {"messages": []}}, "messages"),
                ({"prompt": ["a", "b"]}, "prompt"))
    for request, param in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(**({"model": TINY, "prompt": "Hi", "max_tokens": 4} | request))
        assert refused.value.body["param"] == param


def test_a_body_that_is_not_json_and_an_unknown_trace_are_refused_in_openais_shape(tiny_url):
    broken = httpx.post(f"{tiny_url}/chat/completions", content="{not json",
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400
    assert broken.json() == {"error": {"message": "the body is not valid JSON: JSON decode error",
                                       "type": "invalid_request_error", "param": None, "code": None}}
    unknown = httpx.get(f"{tiny_url}/traces/trace-0")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "trace_id"
    assert unknown.json()["error"]["code"] == "trace_not_found"


def test_an_unexpected_failure_is_a_500_in_openais_shape_and_the_server_serves_on(caplog):
    decoder, twin = tiny_decoder(0), tiny_decoder(0)
    verify = decoder.target.verify_batch
    decoder.target.verify_batch = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("out of memory"))
    with serving(decoder) as url:
        with pytest.raises(openai.InternalServerError) as failed:
            ask(url, "completions", PROMPTS[0], max_tokens=4)
        said = "internal error (RuntimeError: out of memory); the server is still running, try again"
        assert failed.value.body == {"message": said, "type": "server_error", "param": None, "code": None}
        with pytest.raises(openai.APIError) as failed_stream:
            ask(url, "chat", PROMPTS[0], stream=True, max_tokens=4)
        assert failed_stream.value.body["message"] == said
        assert len([r for r in caplog.records if r.exc_info]) == 2, "each failure logged once"
        decoder.target.verify_batch = verify
        answer = ask(url, "completions", PROMPTS[0], max_tokens=4, extra_body={"method": "ar"})
        assert answer["text"] == solo(twin, PROMPTS[0], max_tokens=4).text


def test_a_request_run_alone_is_checked_against_the_models_once(twin):
    """When it comes, not again when its run leaves the queue (nor, on the vLLM engine, which runs requests one at a
    time, in its workers)."""
    decoder = tiny_decoder(0)
    prepared, prepare = [], decoder.prepare
    decoder.prepare = lambda *args: prepared.append(args) or prepare(*args)
    with serving(decoder, batching=False) as url:
        answer = ask(url, "completions", PROMPTS[0], max_tokens=4, extra_body={"method": "ddtree", "tree_budget": 4})
    assert len(prepared) == 1 and answer["text"] == solo(twin, PROMPTS[0], max_tokens=4).text


# ---------------------------------------------------------------- traces

def test_traces_are_listed_newest_first_kept_to_a_bound_and_written_as_the_studios_files(tmp_path):
    with serving(tiny_decoder(0), tree_budget=BUDGET, traces_dir=tmp_path, kept_traces=2) as url:
        answers = [ask(url, "chat", PROMPTS[0], max_tokens=5, extra_body={"method": "dflash"}),
                   ask(url, "completions", PROMPTS[1], max_tokens=6, extra_body={"method": "ar"}),
                   ask(url, "chat", "x" * 250, max_tokens=7)]
        ids = [answer["ddtree"]["trace_id"] for answer in answers]
        listed = traces(url)
        assert [entry["id"] for entry in listed] == [ids[2], ids[1]], "the last two, newest first"
        newest = listed[0]
        assert newest == {"id": ids[2], "created": newest["created"], "endpoint": "chat.completions",
                          "method": "ddtree", "tree_budget": BUDGET, "prompt": ("user: " + "x" * 250)[:200],
                          "tokens": 7, "steps": answers[2]["ddtree"]["steps"], "tau": answers[2]["ddtree"]["tau"],
                          "tokens_per_s": answers[2]["ddtree"]["tokens_per_s"], "finish_reason": "length"}
        assert abs(newest["created"] - time.time()) < 60
        assert listed[1]["endpoint"] == "completions" and listed[1]["tree_budget"] is None
        trace = trace_of(url, ids[1])
        assert trace.text == answers[1]["text"] and trace.config.method == "ar"
        assert httpx.get(f"{url}/traces/{ids[0]}").status_code == 404, "past the bound"
    assert sorted(path.stem for path in tmp_path.glob("*.json")) == sorted(ids), "every request's file, kept or not"
    written = json.loads((tmp_path / f"{ids[0]}.json").read_text())
    assert written["schema_version"] == SCHEMA_VERSION
    assert Trace.from_dict(written["traces"][0]).text == answers[0]["text"]


# ---------------------------------------------------------------- the command

def test_the_command_checks_its_flags(capsys):
    args = serve.parse_args([])
    assert (args.host, args.port, args.method, args.tree_budget, args.engine, args.one_at_a_time) == (
        "127.0.0.1", 8000, "ddtree", "auto", "torch", False)
    assert serve.parse_args(["--tree-budget", "24"]).tree_budget == 24
    with pytest.raises(SystemExit):
        serve.parse_args(["--tree-budget", "0"])
    assert ('argument --tree-budget: tree budget must be "auto" or a whole number from 1 to 1024, got 0'
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        serve.parse_args(["--vllm-compile"])
    assert "--vllm-compile has vLLM compile its target: it needs --engine vllm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.parse_args(["--batch-invariant"])
    assert "--batch-invariant is vLLM's mode: it needs --engine vllm" in capsys.readouterr().err
    assert serve.parse_args(["--engine", "vllm", "--batch-invariant"]).batch_invariant


# ---------------------------------------------------------------- the bundled model

@pytest.fixture(scope="module")
def smollm2(bundled_decoder) -> Iterator[tuple[str, Decoder]]:
    """The server ``python -m engine.tools.serve`` starts: SmolLM2 and the shipped drafter on the CPU (what
    ``load_studio_decoder`` loads for its default flags: the session's bundled pair)."""
    decoder = bundled_decoder
    with serving(decoder, tree_budget=16) as url:
        yield url, decoder


def test_smollm2_chats_through_its_template_and_every_method_answers_ars_text(smollm2):
    url, decoder = smollm2
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is a hash table?"}]
    api = client(url)
    answers = {method: api.chat.completions.create(model=decoder.target.name, messages=messages, max_tokens=12,
                                                   extra_body={"method": method})
               for method in ("ar", "dflash", "ddtree")}
    texts = {method: answer.choices[0].message.content for method, answer in answers.items()}
    assert texts["dflash"] == texts["ar"] == texts["ddtree"] and texts["ar"]
    templated = decoder.target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    templated = list(templated["input_ids"] if hasattr(templated, "keys") else templated)
    assert answers["ar"].usage.prompt_tokens == len(templated)
    trace = trace_of(url, answers["ddtree"].model_extra["ddtree"]["trace_id"])
    assert trace.config.prompt_ids == templated and trace.config.tree_budget == 16
    assert answers["ddtree"].usage.completion_tokens == len(trace.output_ids)
    streamed = ask(url, "chat", "What is a hash table?", stream=True, model=decoder.target.name, max_tokens=12,
                   extra_body={"method": "ddtree"})
    assert streamed["text"] == ask(url, "chat", "What is a hash table?", model=decoder.target.name, max_tokens=12,
                                   extra_body={"method": "ar"})["text"]


def test_the_serve_bench_times_an_answer_on_the_engines_clock_as_well_as_the_clients(smollm2):
    """``serve_bench.engine_timed``: the answer's trace, fetched from the server, gives its time per output token where
    the models run: from the first token to the last on the engine's clock."""
    from types import SimpleNamespace

    from engine.methods import Label
    from engine.tools import serve_bench

    url, decoder = smollm2
    served = SimpleNamespace(url=url, model=decoder.target.name)
    answer = serve_bench.ask(served, {"id": "p", "prompt": "Name three colours."}, Label.parse("ddtree"), 12)
    assert answer.trace_id is not None and answer.engine_tpot_s is None and answer.tokens == 12
    timed = serve_bench.engine_timed(served, answer)
    trace = trace_of(url, answer.trace_id)
    assert timed.engine_tpot_s == (trace.steps[-1].t_end - trace.prefill.t_end) / (len(trace.output_ids) - 1)
    assert timed.engine_tpot_s > 0 and timed.text == answer.text
    assert serve_bench.engine_tpot([timed, answer]) == timed.engine_tpot_s


def test_smollm2_serves_sixteen_clients_at_once_each_their_solo_answer(smollm2):
    url, decoder = smollm2
    prompts = ["Name a colour.", "Say hello.", "Count to three.", "Name a fruit."]
    asks = [(prompt, method, stream) for prompt in prompts for method, stream in
            (("ar", False), ("dflash", True), ("ddtree", False), ("ddtree", True))]
    assert len(asks) == 16

    def one(request):
        prompt, method, stream = request
        return ask(url, "chat", prompt, stream, model=decoder.target.name, max_tokens=4,
                   extra_body={"method": method})["text"]

    alone = {prompt: one((prompt, "ar", False)) for prompt in prompts}  # greedy: every method's answer is AR's
    with ThreadPoolExecutor(len(asks)) as pool:
        assert list(pool.map(one, asks)) == [alone[prompt] for prompt, _, _ in asks]
