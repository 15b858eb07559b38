"""Which grammar engine llmserve uses for structured output, by measurement on this machine.

    .venv/bin/python benchmarks/grammar_engines.py [--json bench-results/grammar_engines.json]

For each engine that imports (llguidance is llmserve's dependency; xgrammar and outlines-core can be put on PYTHONPATH,
e.g. `pip install --target /tmp/gram --no-deps xgrammar apache-tvm-ffi outlines-core`), on the default model's
tokenizer (49,152 tokens):
- compile: seconds to turn a mid-size JSON schema into something that can produce masks (first time);
- mask: median and 99th-percentile microseconds to fill one token bitmask while walking a valid document;
- coverage: how many of a set of JSON Schema features each accepts (compiles and admits a valid instance).
Then, for llmserve's own path (structured/manager.py on llguidance), how long indexing the tokenizer and compiling a
schema hold the GIL: the longest pause of a Python loop in the main thread while each runs in another thread (what
the steps of a running server would wait; why a server indexes the tokenizer while it starts).
The wheel sizes and install dependencies are read from PyPI by hand and stated in docs/structured-output.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json

from llmserve.loader import load_model_files

MID_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"], "additionalProperties": False},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "manager": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
    },
    "required": ["id", "name", "role", "active"],
    "additionalProperties": False,
}
DOCUMENT = ('{"id": 7, "name": "Ada Lovelace", "email": "ada@example.com", "role": "admin", "tags": ["math", "engines"], '
            '"address": {"street": "12 St James", "city": "London", "zip": "12345"}, "score": 9.5, "active": true, '
            '"manager": null}')

# (feature, schema, a valid instance)
FEATURES = [
    ("enum", {"enum": ["red", "green"]}, "red"),
    ("const", {"const": 3}, 3),
    ("nested objects", {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}},
                                                                 "required": ["b"]}}, "required": ["a"]}, {"a": {"b": 1}}),
    ("array min/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}, [1, 2]),
    ("string pattern", {"type": "string", "pattern": "^[A-Z]{3}$"}, "ABC"),
    ("string format date-time", {"type": "string", "format": "date-time"}, "2026-12-04T10:00:00Z"),
    ("anyOf", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 5),
    ("oneOf", {"oneOf": [{"type": "string"}, {"type": "integer"}]}, "x"),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}, {"a": 1}),
    ("$ref / $defs", {"$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/p"}},
                      "required": ["x"]}, {"x": 2}),
    ("recursive $ref", {"$defs": {"n": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                                        "required": ["next"]}}, "$ref": "#/$defs/n"}, {"next": {"next": None}}),
    ("integer min/max", {"type": "integer", "minimum": 1, "maximum": 9}, 4),
    ("number exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 0.5),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"}}, {"k": 1}),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}, {"x_a": 1}),
    ("type list", {"type": ["string", "null"]}, None),
    ("prefixItems (tuple)", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False}, ["a", 1]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2]),
    ("pydantic Optional field", {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}}},
     {"a": None}),
]


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int]):
        import llguidance
        import llguidance.torch as lt

        self.ll, self.lt = llguidance, lt
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.bitmask = lt.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        m = self.ll.LLMatcher(self.tok, self.ll.LLMatcher.grammar_from_json_schema(schema))
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m):
        self.lt.fill_next_token_bitmask(m, self.bitmask)

    def advance(self, m, token) -> bool:
        return m.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int]):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def fill(self, m):
        m.fill_next_token_bitmask(self.bitmask)

    def advance(self, m, token) -> bool:
        return m.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int]):
        import outlines_core
        from tokenizers import Tokenizer

        self.oc = outlines_core
        tok = Tokenizer.from_str(tokenizer_json)
        # outlines-core's Vocabulary wants token strings → ids, without the EOS token
        decoded = {}
        for i in range(vocab):
            if i in eos:
                continue
            s = tok.decode([i], skip_special_tokens=False)
            decoded.setdefault(s, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos[0], decoded)
        self.bitmask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, m):
        m.get_tokens()

    def advance(self, m, token) -> bool:
        m.advance(token)
        return True


def measure(engine_cls, tokenizer_json, vocab, eos, doc_ids):
    try:
        engine = engine_cls(tokenizer_json, vocab, eos)
    except Exception as e:  # not installed, or its tokenizer adapter failed
        return {"engine": engine_cls.name, "error": f"{type(e).__name__}: {e}"}
    t0 = time.perf_counter()
    matcher = engine.compile(MID_SCHEMA)
    compile_s = time.perf_counter() - t0
    times = []
    for token in doc_ids:
        t0 = time.perf_counter()
        engine.fill(matcher)
        times.append(time.perf_counter() - t0)
        if not engine.advance(matcher, token):
            return {"engine": engine.name, "error": f"rejected token {token} of the valid document"}
    covered, missing = 0, []
    for feature, schema, instance in FEATURES:
        try:
            m = engine.compile(schema)
            ok = all(engine.advance(m, t) for t in engine_doc_ids(instance))
        except Exception:
            ok = False
        covered += ok
        if not ok:
            missing.append(feature)
    times.sort()
    return {"engine": engine.name, "compile_s": round(compile_s, 4), "mask_us_median": round(statistics.median(times) * 1e6, 1),
            "mask_us_p99": round(times[int(0.99 * (len(times) - 1))] * 1e6, 1), "coverage": f"{covered}/{len(FEATURES)}",
            "missing": missing}


def longest_pause(work) -> tuple[float, float]:
    """(seconds `work` took in another thread, the longest gap between iterations of a Python loop here meanwhile)."""
    import threading

    done, took = threading.Event(), []

    def run():
        t0 = time.perf_counter()
        work()
        took.append(time.perf_counter() - t0)
        done.set()

    longest, last = 0.0, time.perf_counter()
    threading.Thread(target=run).start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
        sum(range(2000))  # ~20 µs of Python
    return took[0], longest


def manager_gil(files) -> dict:
    from llmserve.sampling_params import StructuredOutputsParams
    from llmserve.structured import StructuredOutputManager

    manager = StructuredOutputManager(files.tokenizer, files.config.vocab_size, files.config.eos_token_ids)
    index_s, index_pause = longest_pause(manager.warm_up)
    compile_s, compile_pause = longest_pause(lambda: manager.compile(StructuredOutputsParams(json=MID_SCHEMA)))
    return {"tokenizer_index_s": round(index_s, 3), "tokenizer_index_longest_gil_hold_ms": round(index_pause * 1e3, 1),
            "schema_compile_s": round(compile_s, 4), "schema_compile_longest_gil_hold_ms": round(compile_pause * 1e3, 2)}


def engine_doc_ids(instance):
    return TOKENIZER.encode(json.dumps(instance), add_special_tokens=False)


def main():
    global TOKENIZER
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    files = load_model_files(None)
    TOKENIZER = files.tokenizer
    tokenizer_json = files.tokenizer.tokenizer.to_str()
    vocab, eos = files.config.vocab_size, list(files.config.eos_token_ids)
    doc_ids = TOKENIZER.encode(DOCUMENT, add_special_tokens=False)
    results = [measure(cls, tokenizer_json, vocab, eos, doc_ids) for cls in (Llguidance, Xgrammar, OutlinesCore)]
    for r in results:
        print(json.dumps(r))
    gil = manager_gil(files)
    print("llmserve's grammar path:", json.dumps(gil))
    if args.json:
        write_json(args.json, {"results": results, "llmserve_gil": gil, "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
