"""Several API-server processes in front of one engine process (`llmserve serve --api-server-count N`,
server/api_servers.py): connections spread over the processes, every request gets its own outputs (equal to the
offline engine's), /metrics adds the processes up, a closed stream frees its KV blocks, the whole server stops
together, and bad combinations are one-line errors. Real `llmserve serve` processes on 127.0.0.1, the default model
with peft adapters, the real `openai` client. The engine's side with two clients, on a tiny checkpoint (so that it
runs on a GPU machine too), is in test_engine_process.py."""

import asyncio
import signal
import socket
import time

import httpx
import openai
import psutil
import pytest

from llmserve.cli import main
from tests.server_fixtures import ServerProcess, free_port
from tests.test_lora_server import MODEL, PROMPT, adapter_dirs, expected  # noqa: F401 - fixtures used below
from tests.test_server import metric_values

pytest.importorskip("peft")


class ServeWithTwoAPIServers(ServerProcess):
    """`llmserve serve --api-server-count 2 ...`, ready once /health answers and both server processes listen (one
    may answer before the other has bound its socket)."""

    def __init__(self, *flags: str):
        super().__init__("--no-webui", "--api-server-count", "2", *flags)
        self.wait_ready(ready=lambda: len(self.api_servers()) == 2)

    def api_servers(self) -> list[psutil.Process]:
        """The processes listening on the server's port (the engine process listens on none)."""
        return [c for c in psutil.Process(self.proc.pid).children()
                if any(x.status == psutil.CONN_LISTEN and x.laddr.port == self.port for x in c.net_connections("tcp"))]

    def wait_idle(self, timeout: float = 30) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            values = metric_values(self.url)
            if all(values[(name, ())] == 0 for name in ("llmserve:num_requests_running", "llmserve:num_requests_waiting",
                                                        "llmserve:kv_cache_usage_perc")):
                return values
            time.sleep(0.1)
        raise AssertionError(f"not idle: {values}")


@pytest.fixture(scope="module")
def server(adapter_dirs):  # noqa: F811
    allowed, _ = adapter_dirs
    s = ServeWithTwoAPIServers("--dtype", "float32", "--served-model-name", MODEL,
                     "--kv-cache-memory", "64MiB", "--lora-modules", f"french={allowed / 'french'}",
                     f"german={allowed / 'german'}", "--allow-runtime-lora-updating", "--lora-dir", str(allowed))
    yield s
    s.stop()


def test_the_http_processes_load_neither_torch_nor_the_model(server):
    """Only the engine process holds torch and the weights: each HTTP process unpickles the engine's outputs and
    statistics as plain data (~160 MiB each, not ~340 MiB with torch)."""
    assert server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text
    assert "llmserve:num_requests_running" in httpx.get(server.url + "/metrics").text  # the engine's stats came through
    for proc in server.api_servers():
        libraries = {m.path for m in proc.memory_maps()}
        assert not any("libtorch" in path for path in libraries), proc
    engine = [c for c in psutil.Process(server.proc.pid).children() if c not in server.api_servers()]
    assert any(any("libtorch" in m.path for m in c.memory_maps()) for c in engine)  # the check can see torch


def test_connections_spread_and_each_request_gets_its_own_outputs(server, expected):  # noqa: F811
    """24 concurrent streams over 24 connections, base model and both adapters (each server process loaded them at
    its start; the engine read each once): each stream's text is the offline engine's for its model, and both
    processes held some of the connections."""
    models = [MODEL, "french", "german"] * 8
    holders = {}

    async def one(client, model):
        text = ""
        async with client.stream("POST", "/v1/completions", json={
                "model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += __import__("json").loads(line[6:])["choices"][0]["text"]
                    if model == "german" and not holders:  # all 24 connections are open by now
                        holders.update({p.pid: sum(x.status == psutil.CONN_ESTABLISHED for x in p.net_connections("tcp"))
                                        for p in server.api_servers()})
        return text

    async def run():
        limits = httpx.Limits(max_connections=len(models), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*[one(client, m) for m in models])

    texts = asyncio.run(run())
    assert texts == [expected[m] for m in models]
    assert len(holders) == 2 and all(holders.values()), holders
    assert {m.id for m in openai.OpenAI(base_url=server.url + "/v1", api_key="x").models.list().data} == {
        MODEL, "french", "german"}


def test_an_adapter_loaded_through_one_process_is_served_by_all(server, expected):  # noqa: F811
    """--allow-runtime-lora-updating with two server processes: an adapter loaded through one connection is served
    (and listed) through every new connection, whichever process takes it; once unloaded, none serves it; loaded
    again under its name, all do. Each call below comes on a connection of its own, so both processes take some."""
    def fresh():
        return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    def text(model):
        return fresh().completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text

    def load():
        return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "spare", "lora_path": "spare"})

    assert load().status_code == 200
    again = load()
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_adapter_exists", again.text
    for _ in range(8):
        assert "spare" in {m.id for m in fresh().models.list().data}
        assert text("spare") == expected["spare"]

    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "spare"}).status_code == 200
    for _ in range(8):
        assert "spare" not in {m.id for m in fresh().models.list().data}
        with pytest.raises(openai.NotFoundError) as err:
            text("spare")
        assert err.value.body["code"] == "model_not_found"
    missing = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "spare"})
    assert missing.status_code == 404, missing.text

    assert load().status_code == 200
    assert [text("spare") for _ in range(4)] == [expected["spare"]] * 4
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "spare"}).status_code == 200
    server.wait_idle()


def test_stored_responses_are_shared_by_the_processes(server):
    """The Responses API's store lives in the engine process: a response made through one connection is retrieved,
    continued and cancelled through new connections, whichever process takes each."""
    def fresh():
        return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    first = fresh().responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=8, temperature=0)
    follow_ups = set()
    for _ in range(6):
        assert fresh().responses.retrieve(first.id).output_text == first.output_text
        follow_ups.add(fresh().responses.create(model=MODEL, input="And a vegetable?", previous_response_id=first.id,
                                                max_output_tokens=8, temperature=0).output_text)
    assert len(follow_ups) == 1  # the same conversation everywhere
    long = fresh().responses.create(model=MODEL, input="Write a long story.", max_output_tokens=400, background=True,
                                    extra_body={"ignore_eos": True})
    assert fresh().responses.cancel(long.id).status == "cancelled"
    server.wait_idle()
    assert [fresh().responses.retrieve(long.id).status for _ in range(4)] == ["cancelled"] * 4
    fresh().responses.delete(first.id)
    for _ in range(4):
        with pytest.raises(openai.NotFoundError):
            fresh().responses.retrieve(first.id)


def test_metrics_add_up_over_the_processes(server):
    """Counters and histograms from both processes add up to what the requests got; the engine's gauges appear
    once (not once per process), whichever process answers /metrics."""
    before = server.wait_idle()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    tokens = 0
    for i in range(8):
        # a client per request: a new connection each time, so that both processes serve some
        r = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
            model=MODEL, prompt=f"Count {i}:", max_tokens=3 + i, temperature=0, extra_body={"ignore_eos": True})
        tokens += r.usage.completion_tokens
    assert tokens == sum(3 + i for i in range(8))
    del client
    after = server.wait_idle()
    generated = ("llmserve:generation_tokens_total", ())
    assert after[generated] - before[generated] == tokens
    finished = ("llmserve:request_success_total", (("finished_reason", "length"),))
    assert after[finished] - before.get(finished, 0) == 8
    first = ("llmserve:time_to_first_token_seconds_count", ())
    assert after[first] - before[first] == 8
    for _ in range(6):  # new connections: both processes answer some of these
        text = httpx.get(server.url + "/metrics").text
        lines = [line for line in text.splitlines() if line.startswith("llmserve:num_requests_running")]
        assert lines == [f'llmserve:num_requests_running{{model_name="{MODEL}"}} 0.0'], lines
        assert "pid=" not in text


def test_metrics_name_the_running_adapters_as_they_change(server):
    """lora_requests_info with several processes: one series, naming the adapter of the running request while it
    runs and none once it is done, whichever process answers (old label sets do not linger)."""
    def lora_series() -> list[str]:
        text = httpx.get(server.url + "/metrics").text  # a new connection each time: both processes answer some
        return [line for line in text.splitlines() if line.startswith("llmserve:lora_requests_info{")]

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        task = asyncio.ensure_future(client.completions.create(model="german", prompt=PROMPT, max_tokens=200,
                                                                extra_body={"ignore_eos": True}))
        seen = []
        while not task.done():
            seen.append(lora_series())
            await asyncio.sleep(0.05)
        await task
        await client.close()
        return seen

    seen = asyncio.run(run())
    assert all(len(series) == 1 for series in seen), seen
    assert any('running_lora_adapters="german"' in series[0] for series in seen), seen
    server.wait_idle()
    deadline = time.time() + 10
    while True:
        after = [lora_series() for _ in range(6)]
        if all(len(series) == 1 and 'running_lora_adapters=""' in series[0] for series in after):
            break
        assert time.time() < deadline, after
        time.sleep(0.2)


def test_a_closed_stream_frees_its_blocks(server):
    async def read_a_little():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n == 3:
                        running = metric_values(server.url)[("llmserve:num_requests_running", ())]
                        return running

    assert asyncio.run(read_a_little()) >= 1
    server.wait_idle()  # no request running, and no KV block held


def test_sigterm_stops_every_process(server):
    """Last of the module's server: SIGTERM to `llmserve serve` stops the server processes and the engine; the exit
    status says so (128 + 15, as with one server process)."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert len(server.api_servers()) == 2
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert "Traceback" not in server.output()


@pytest.fixture(scope="module")
def one_at_a_time(shallow_gguf):
    """A server that runs one sequence at a time behind a queue of three requests."""
    s = ServeWithTwoAPIServers("--model", shallow_gguf, "--kv-cache-memory", "32MiB",
                     "--max-num-seqs", "1", "--max-queued-requests", "3")
    yield s
    s.stop()


def test_the_queue_limit_holds_for_the_whole_server(one_at_a_time):
    """--max-queued-requests 3 with two server processes: three requests queue, wherever their connections land
    (per-process shares of the limit would refuse the third at one of them), and the fourth gets 429."""
    server = one_at_a_time

    async def run():
        limits = httpx.Limits(max_connections=8, max_keepalive_connections=0)  # a connection per request
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            body = {"prompt": "Count:", "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 8000}) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()  # held: a dropped iterator would close the stream
                await anext(lines)  # running, so out of the queue

                async def queued():
                    r = await client.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False})
                    return r.status_code

                waiting = [asyncio.create_task(queued()) for _ in range(3)]
                deadline = time.time() + 60
                while metric_values(server.url)[("llmserve:num_requests_waiting", ())] < 3:
                    assert time.time() < deadline and not any(t.done() for t in waiting), \
                        [t.result() for t in waiting if t.done()]
                    await asyncio.sleep(0.1)
                refused = await client.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False})
            # the long stream is closed: the engine aborts it, and the three queued requests run
            return refused, await asyncio.gather(*waiting)

    refused, statuses = asyncio.run(run())
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "queue_full"
    assert "limit of 3 queued requests" in refused.json()["error"]["message"]
    assert statuses == [200, 200, 200]
    server.wait_idle()


def test_a_dead_api_server_stops_the_whole_server(one_at_a_time):
    """Last of that server: a server process that dies (here: SIGKILL) takes the server down, engine included, with
    one error line and a non-zero exit, for a supervisor to restart it: a server with a process missing is not the
    one started."""
    s = one_at_a_time
    children = psutil.Process(s.proc.pid).children(recursive=True)
    s.api_servers()[1].kill()
    assert s.proc.wait(timeout=60) == 1
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    errors = [line for line in s.output().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "exited (code -9)" in errors[0], errors


@pytest.mark.parametrize("flags, message", [
    (["--api-server-count", "0"], "--api-server-count must be at least 1"),
    (["--api-server-count", "2", "--no-engine-process"], "--api-server-count above 1 needs the engine in a process"),
])
def test_bad_combinations_are_one_line(flags, message, default_gguf, capsys):
    assert main(["serve", "--model", default_gguf, "--port", str(free_port()), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: " + message), err


def test_a_busy_port_and_a_load_error_are_one_line(shallow_gguf, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", shallow_gguf, "--port", str(port), "--api-server-count", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"], err
    # the model fails to load in the engine process: reported once, though two server processes were to start
    assert main(["serve", "--model", shallow_gguf, "--port", str(free_port()), "--api-server-count", "2",
                 "--kv-cache-memory", "1KiB"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "KV cache memory 1024 bytes holds no block" in err[0], err
