"""A seeded request through ``loom serve`` gets the same tokens alone and in a batch with
concurrent streams, and the same tokens as ``loom.LLM`` in-process."""

from __future__ import annotations

import threading

import httpx
from loom import LLM, SamplingParams
from serve_utils import serving

SEEDED = {"prompt": "The seeded one says", "max_tokens": 12, "temperature": 1.0, "top_p": 0.95, "seed": 4321,
          "ignore_eos": True}
COMPANIONS = [
    {"prompt": "A long greedy story:", "temperature": 0},
    {"prompt": "An unseeded ramble", "temperature": 1.0},
    {"prompt": "Two seeded voices", "temperature": 0.8, "seed": 7, "n": 2},
]


def seeded_completion(url: str, model: str) -> tuple[str, list[int]]:
    # logprobs=0 with token ids: the sampled token ids come back, not only their text
    body = {"model": model, **SEEDED, "logprobs": 0, "return_tokens_as_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["text"], [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


class Companion(threading.Thread):
    """A long streaming completion, read until it ends or ``stop`` is set (which drops it)."""

    def __init__(self, url: str, model: str, body: dict, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.body = {"model": model, "max_tokens": 400, "ignore_eos": True, "stream": True, **body}
        self.url, self.stop = url, stop
        self.first_token = threading.Event()
        self.finished = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.finished = True
                    elif line.startswith("data: ") and '"text"' in line:
                        self.first_token.set()
                    if self.stop.is_set():
                        return
        except BaseException as e:  # reported by the test thread
            self.error = e
        finally:
            self.first_token.set()  # never leave the test waiting on a companion that failed


def test_seeded_request_is_the_same_alone_and_among_streams(tiny_llama, tmp_path):
    model = str(tiny_llama)
    llm = LLM(model, dtype="float32", max_model_len=512)
    params = SamplingParams(**{k: v for k, v in SEEDED.items() if k != "prompt"})
    want = llm.generate(SEEDED["prompt"], params)[0].outputs[0]
    llm.shutdown()

    with serving([model, "--dtype", "float32", "--max-model-len", "512"], tmp_path) as serve:
        alone = seeded_completion(serve.url, model)
        stop = threading.Event()
        companions = [Companion(serve.url, model, body, stop) for body in COMPANIONS]
        for c in companions:
            c.start()
        try:
            for c in companions:
                assert c.first_token.wait(60) and c.error is None, c.error
            among = seeded_completion(serve.url, model)
            still_streaming = [not c.finished for c in companions]
        finally:
            stop.set()
            for c in companions:
                c.join(60)
    assert still_streaming == [True] * len(companions), "a companion ended first: the batch was not shared"
    assert alone == among
    assert alone == (want.text, list(want.token_ids))
