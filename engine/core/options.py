"""Every option of Colibri in one table, OPTIONS, and what is made from it: the flags of
`colibri serve` and of the engine's commands, the COLIBRI_* environment variables, the fields
of the server's settings, `.env.example` and docs/configuration.md.

One name per knob (flag --expert-cache-mb, variable COLIBRI_EXPERT_CACHE_MB, field
expert_cache_mb of every config object, and the C field where C reads it), one default and one
check (Option.check) whatever the entry point. Reads no files and imports nothing heavy; the
server's pydantic settings are built in app/ from `OPTION`, so the engine needs no pydantic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from colibri.engine.core.kv_types import DEFAULT_KV_CACHE_TYPE, KV_CACHE_TYPES
from colibri.engine.executor.expert_cache import LOAD_MODES
from colibri.engine.format.convert import DEFAULT_QUANT, PRESETS
from colibri.engine.spec import SPECULATIVE_METHODS

ENV_PREFIX = "COLIBRI_"
DEVICE_PATTERN = r"auto|cpu|cuda|cuda:[0-9]+|torch-cpu"
# every command with flags from this table; "serve" is the server (its settings), the others
# are engine commands
COMMANDS = ("serve", "generate", "bench", "eval", "info", "convert", "replay", "plan")
_ENGINE = ("generate", "bench", "eval")  # the commands that load and run a model
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Option:
    """One knob. `commands` take it as a flag; `setting`: a field of the server's settings,
    so COLIBRI_<NAME> (environment or .env) sets it for `colibri serve`; `engine_env`: the
    engine reads COLIBRI_<NAME> itself, so it applies to every command and to the Python API.
    """

    name: str
    type: type  # int, float, str, bool or list (of strings)
    default: Any
    help: str  # one line: --help and the tables of docs/configuration.md
    section: str
    commands: tuple[str, ...] = ("serve",)
    setting: bool = True
    engine_env: bool = False
    choices: tuple[str, ...] = ()
    pattern: str = ""  # a regular expression the whole value must match (str options)
    ge: float | None = None  # at least
    gt: float | None = None  # more than
    le: float | None = None  # at most
    unset: str = ""  # what the default None means
    note: str = ""  # more, for .env.example and docs/configuration.md
    example: str = ""  # a value for an unset option, shown commented out in .env.example
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def has_env(self) -> bool:
        return self.setting or self.engine_env

    def check(self, value: Any) -> Any:
        """value, if it is within this option's limits; else ValueError saying what it must
        be. The one check behind the flags, the environment and the server's settings."""
        if value is None:
            if self.default is not None:
                raise ValueError("must be set")
            return value
        if self.choices and value not in self.choices:
            raise ValueError(f"must be one of {', '.join(self.choices)}")
        if self.pattern and not re.fullmatch(self.pattern, str(value)):
            raise ValueError(f"must match {self.pattern}")
        if self.type in (int, float) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError("must be a finite number")
            if self.ge is not None and value < self.ge:
                raise ValueError(f"must be at least {_num(self.ge)}")
            if self.gt is not None and value <= self.gt:
                raise ValueError(f"must be greater than {_num(self.gt)}")
            if self.le is not None and value > self.le:
                raise ValueError(f"must be at most {_num(self.le)}")
        return value

    def parse(self, text: str) -> Any:
        """The value of text as written in COLIBRI_<NAME>, checked. ValueError says what it
        must be."""
        text = text.strip()
        if self.type is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError("must be true or false")
        if self.type is list:
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError('must be a JSON list of strings such as ["a", "b"]')
            return value
        if self.type in (int, float):
            try:
                number = self.type(text)
            except ValueError:
                kind = "an integer" if self.type is int else "a number"
                raise ValueError(f"must be {kind}") from None
            return self.check(number)
        return self.check(text)

    def default_text(self) -> str:
        """The default as --help shows it: "default 16", "default on", "default: all cores"."""
        if self.default is None:
            return f"default: {self.unset}" if self.unset else "default: unset"
        if self.type is bool:
            return "default on" if self.default else "default off"
        if self.default == []:
            return "default: none"
        return f"default {format_value(self.default)}"


def format_value(value: Any) -> str:
    """value as COLIBRI_<NAME> spells it (empty for None)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


def _num(x: float) -> str:
    return format(x, "g")


_MODEL = "model"
_BATCH = "batching and KV cache"
_XC = "expert cache"
_SPEC = "speculative decoding"
_NET = "network"
_LIMITS = "limits"
_TEMPLATES = "chat templates"
_KERNELS = "kernels and folders (read by the engine, so every command follows them)"
_REPLICAS = "replicas (Ray Serve)"
_GEN = "generation (`colibri generate` and the Python API's LLM.generate / LLM.stream)"
_SERVE_ENGINE = ("serve", *_ENGINE)

OPTIONS: tuple[Option, ...] = (
    # -- model --------------------------------------------------------------------------
    Option("model", str, None, "model folder (Colibri or Hugging Face) or Hugging Face repo id",
           _MODEL, commands=(*_SERVE_ENGINE, "info", "plan"), unset="the bundled demo model",
           note="A Hugging Face folder is converted once into a cache (see COLIBRI_CACHE_DIR); "
                "a repo id (owner/name) is downloaded once, then converted.",
           example="/models/my-moe", metavar="PATH"),
    Option("served_model_name", str, None, "the model name clients pass and see in /v1/models",
           _MODEL, unset="the folder's name", example="my-moe"),
    Option("accept_any_model", bool, False, "answer requests whatever model name they send",
           _MODEL, note="For clients that insist on their own model names, such as "
                        "Ollama-style front ends. Off: an unknown name is a 404, as with OpenAI."),
    Option("quant", str, DEFAULT_QUANT, "weight precision when a Hugging Face folder is "
           "converted (q4: embeddings and lm_head q6, the rest q4)", _MODEL,
           commands=(*_SERVE_ENGINE, "info", "convert", "plan"), choices=PRESETS),
    Option("threads", int, None, "compute threads", _MODEL, commands=_SERVE_ENGINE, ge=1,
           engine_env=True, unset="the physical cores this process may run on", example="8"),
    Option("device", str, "auto", "where the forward pass runs: cpu (the C core), cuda or "
           "cuda:N (a GPU through PyTorch), torch-cpu (the PyTorch path on the CPU), auto",
           _MODEL, commands=(*_SERVE_ENGINE, "info"), engine_env=True, pattern=DEVICE_PATTERN,
           note="auto is cuda:0 when PyTorch sees a CUDA device (install colibri[cuda]), else "
                "cpu. torch-cpu runs the GPU code on the CPU: slow, for checking a placement on "
                "a machine without a GPU."),
    Option("gpu_memory_mb", float, None, "GPU memory the placement may use, in MB: the cost "
           "model puts what every token needs first, then routed experts hottest first; a GPU "
           "layer's other experts run on the C core beside it, and the rest of the layers on "
           "the C core", _MODEL,
           commands=(*_SERVE_ENGINE, "info", "plan"), engine_env=True, ge=0,
           unset="everything on the device", example="24000",
           note="Between steps the GPU tier swaps a cold expert on the GPU for a hotter one on "
                "the CPU when the routing says so (a few uploads per step at most)."),
    Option("device_profile", str, None, "the machine profile the --gpu-memory-mb placement "
           "plans with: a JSON file (engine/executor/profiles/ has the format) or a profile "
           "kept with Colibri by name", _MODEL, commands=(*_SERVE_ENGINE, "info"),
           engine_env=True, unset="this machine, measured at start", example="h200",
           metavar="FILE"),
    Option("n_ctx", int, None, "context length in tokens (prompt and completion)", _MODEL,
           ge=16, unset="the model's own", example="8192"),
    # -- batching and KV cache ----------------------------------------------------------
    Option("max_num_seqs", int, 16, "sequences generated together in one batch", _BATCH,
           ge=1, le=256, note="Continuous batching: every engine step carries the next token "
                              "of each running sequence plus chunks of new prompts."),
    Option("max_num_batched_tokens", int, 256, "tokens per engine step, prompt chunks included",
           _BATCH, ge=16),
    Option("prefill_tokens_while_decoding", int, 128, "prompt tokens per engine step while "
           "other requests decode", _BATCH, ge=1,
           note="Every decoding stream waits for the step, so a smaller value keeps their pace "
                "when new requests arrive; measured on a Mixtral-shaped model with 8 streams, "
                "128 cut the p99 time between tokens from 0.93 s to 0.54 s against whole "
                "256-token chunks."),
    Option("kv_cache_mb", float, None, "KV cache pool in MB", _BATCH, gt=0,
           unset="a full context for each sequence of a batch, at most a quarter of the memory "
                 "free at start", note="The size chosen is printed in the log.", example="512",
           metavar="MB"),
    Option("kv_cache_type", str, DEFAULT_KV_CACHE_TYPE, "KV cache element type (auto: f32 for "
           "an f32 model, else f16)", _BATCH, commands=("serve", "bench", "eval"),
           choices=KV_CACHE_TYPES),
    Option("prefix_cache", bool, True, "reuse the KV blocks of prompt prefixes shared between "
           "requests (system prompts, chat turns)", _BATCH),
    Option("kv_window_pool", bool, True, "keep the KV of sliding-window and chunked-attention "
           "layers in a pool of its own, whose blocks go back once they leave every window",
           _BATCH, note="Models with such layers beside full ones (gpt-oss, Llama 4): a "
           "request then holds about a window of KV for those layers however long it grows "
           "(gpt-oss-20b: half the KV per token). Tokens do not change."),
    # -- expert cache -------------------------------------------------------------------
    Option("expert_cache_mb", float, None, "memory for the routed experts of all layers, in MB",
           _XC, commands=_SERVE_ENGINE, engine_env=True, gt=0,
           unset="every expert when the model fits in free memory, else what is free",
           note="A cgroup memory limit counts as the free memory. A budget below one layer's "
                "top-k experts in every layer is refused at start with the minimum.",
           example="2048", metavar="MB"),
    Option("expert_cache_size", int, None, "routed experts kept resident per layer (wins over "
           "the budget in MB)", _XC, commands=_SERVE_ENGINE, engine_env=True, ge=1,
           unset="from the budget in MB or the free memory", example="32", metavar="N"),
    Option("prefetch_window", int, 16, "tokens of routing history that make an expert hot",
           _XC, commands=(*_SERVE_ENGINE, "replay"), engine_env=True, ge=1,
           note="Heat decides the eviction order: the expert with the least heat goes first.",
           metavar="TOKENS"),
    Option("expert_load", str, "auto", "how missing experts are read", _XC,
           commands=_SERVE_ENGINE, engine_env=True, choices=LOAD_MODES,
           note="direct: O_DIRECT reads into the slots, past the page cache; uring: the same, "
                "each reader splitting its read into chunks that are all in flight at once "
                "through its own io_uring (Linux 5.6 or later); pread: into the slots, "
                "through the page cache; mmap: madvise on the mapped files; auto: direct "
                "where the file system allows it, else pread."),
    Option("expert_prefetch", bool, True, "the reader threads read ahead the experts the next "
           "layer's router predicts while a layer computes", _XC, commands=_SERVE_ENGINE,
           engine_env=True),
    Option("expert_pin", bool, True, "pin each layer's most used experts, learned from earlier "
           "runs (expert_routing.json next to the model)", _XC, commands=_SERVE_ENGINE,
           engine_env=True),
    Option("expert_huge_pages", bool, True, "2 MiB transparent huge pages on the expert slots, "
           "where the system grants them", _XC, commands=_SERVE_ENGINE, engine_env=True,
           note="O_DIRECT reads into 2 MiB pages run faster than into 4 KiB pages."),
    Option("expert_prefetch_depth", str, "auto", "layers the reader threads read ahead: 1 "
           "(the next layer's predicted experts), 2 (the next two layers'), auto (two while "
           "one expert read takes longer than one layer computes, else one)", _XC,
           commands=_SERVE_ENGINE, engine_env=True, choices=("auto", "1", "2"),
           note="The prediction two layers ahead is less sure: what the next layer's own "
                "prediction no longer names is dropped before it is read, and a layer whose "
                "read-aheads mostly go unused is not read two layers ahead."),
    Option("expert_readers", int, None, "threads that read missing experts in parallel, the "
           "prefetches included", _XC, commands=_SERVE_ENGINE, engine_env=True, ge=1, le=64,
           unset="measured at start: the fewest reads in flight at which the expert files "
                 "read within a tenth of their best rate, 2 to 16 (4 where it cannot be "
                 "measured)",
           note="A layer hands all the reads of its missing experts to them at once, so that "
                "many are in flight: storage that answers several reads together (NVMe, most "
                "virtual disks) reads faster with more; one reads one expert at a time. The "
                "start log says how many were chosen and why.", example="8",
           metavar="N"),
    Option("expert_read_timeout_s", float, 30.0, "seconds one expert read may take before the "
           "model is marked failed", _XC, commands=_SERVE_ENGINE, engine_env=True, gt=0,
           le=86400,
           note="Storage that stalls (a hung network mount) fails the request with a clean "
                "error and /ready answers 503, instead of the server hanging."),
    # -- speculative decoding -------------------------------------------------------------
    Option("speculative", str, "off", "draft tokens and verify them together in one step: "
           "ngram drafts by prompt lookup (what followed the sequence's last tokens earlier in "
           "its prompt and output); auto drafts the same way but lets a cost model choose, per "
           "sequence and step, how many drafts to verify (none where they would not pay); mtp "
           "drafts with the model's own multi-token-prediction layer (DeepSeek-V3, GLM-4.5 "
           "checkpoints that ship one); off decodes one token per step", _SPEC,
           commands=("serve", "generate", "bench"), choices=SPECULATIVE_METHODS,
           note="Greedy requests (temperature 0) keep a draft only where it is the model's "
                "own choice, so their output is the same token for token; sampled ones keep it "
                "by the speculative sampling rule, so their output follows the same "
                "distribution (a given seed gives other tokens than without speculation); a "
                "response format drafts only what its grammar accepts. It pays where the "
                "output repeats its input (code edits, quoting); each verify step runs every "
                "draft through every layer, and on a MoE model through the union of their "
                "experts. auto weighs that cost, measured on this machine's own steps, against "
                "each request's acceptance so far and the batch's size: on free text and in "
                "large batches it drafts little or nothing."),
    Option("num_speculative_tokens", int, None, "tokens drafted per sequence and step at most",
           _SPEC, commands=("serve", "generate", "bench"), ge=1, le=16,
           unset="4 with ngram and mtp, 16 with auto",
           note="ngram and mtp draft this many at every step. auto verifies at most twice the "
                "length of the sequence's prompt-lookup match (at least 2, or twice what its "
                "last verify step kept) and at most what the cost model finds worth it, so a "
                "copy that keeps being confirmed drafts up to this many.",
           example="8", metavar="N"),
    # -- network ------------------------------------------------------------------------
    Option("host", str, "127.0.0.1", "address to bind", _NET,
           note="127.0.0.1 keeps the server local; 0.0.0.0 exposes it (set an API key)."),
    Option("port", int, 8000, "port to listen on", _NET, ge=0, le=65535),
    Option("api_key", str, None, "require 'Authorization: Bearer KEY' on the API", _NET,
           unset="no key", note="Covers /v1/*, /tokenize, /detokenize, /docs, "
                                "/openapi.json and the routers' /health_generate, "
                                "/flush_cache and /get_*_info; /health, /ready, /metrics, "
                                "/get_load and the chat page stay open.", example="sk-local",
           metavar="KEY"),
    Option("cors_origins", list, [], "origins allowed to call the API from a browser (CORS)",
           _NET, note='As a variable, a JSON list such as ["http://localhost:3000"]. Empty: '
                      "CORS off. Credentials are never allowed.", metavar="ORIGIN"),
    Option("allowed_hosts", list, [], "host names the server answers to besides localhost, "
           "127.0.0.1 and ::1 (the Host header); '*': any", _NET,
           note='As a variable, a JSON list such as ["colibri.lan"]. Checked while the server '
                "listens on a loopback address, and on any address once names are given: a "
                "web page cannot reach a local server through a name of its own (DNS "
                "rebinding). Other names get 421.", metavar="HOST"),
    Option("log_level", str, "info", "log level: debug, info, warning or error", _NET),
    Option("docs", bool, True, "serve the API description at /docs and /openapi.json (behind "
           "the API key when one is set)", _NET),
    # -- limits -------------------------------------------------------------------------
    Option("max_queue", int, 16, "requests that may wait beyond the running batch", _LIMITS,
           ge=0, note="More get 503 with Retry-After."),
    Option("retry_after_s", int, 1, "seconds clients are told to wait (Retry-After) when the "
           "queue is full or the model is loading", _LIMITS, ge=1),
    Option("max_body_bytes", int, 1 << 20, "largest request body in bytes (413 beyond it)",
           _LIMITS, ge=1024),
    Option("max_header_bytes", int, 16 << 10, "largest total size of the request headers in "
           "bytes (431 beyond it)", _LIMITS, ge=1024),
    Option("max_n", int, 8, "largest n (choices) a request may ask for", _LIMITS, ge=1),
    Option("max_stop", int, 4, "most stop strings per request", _LIMITS, ge=1),
    Option("max_stop_chars", int, 256, "longest stop string in characters", _LIMITS, ge=1),
    Option("max_logprobs", int, 20, "largest top_logprobs (chat) or logprobs (completions)",
           _LIMITS, ge=0),
    Option("send_timeout_s", float, 30.0, "seconds a streaming client may take to accept a "
           "chunk before it is dropped", _LIMITS, gt=0),
    Option("header_timeout_s", float, 10.0, "seconds a client has to send its request line and "
           "headers (else 408 and the connection is closed)", _LIMITS, gt=0),
    Option("body_timeout_s", float, 30.0, "seconds a client has to send a request body (else "
           "408)", _LIMITS, gt=0),
    Option("constraint_timeout_s", float, 5.0, "seconds a response_format schema, regex or "
           "grammar may take to compile (400 beyond)", _LIMITS, gt=0,
           note="It compiles first in a separate process with its own memory limit, stopped "
                "as soon as its client disconnects; a compiled one is kept for the next "
                "request with the same schema."),
    Option("max_connections", int, 256, "open client connections at most; more are answered "
           "503 (Retry-After) and closed", _LIMITS, ge=1),
    Option("drain_timeout_s", float, 30.0, "on SIGTERM, seconds running requests get to finish",
           _LIMITS, ge=0,
           note="New requests are refused at once; when the time is up, queued requests get "
                "503 (Retry-After), cut streams end with an error event and [DONE], and the "
                "process exits 0."),
    # -- chat templates -----------------------------------------------------------------
    Option("allow_client_chat_template", bool, False, "let requests send their own "
           "chat_template, rendered in a jinja2 sandbox", _TEMPLATES,
           note="Off: such a request gets 400."),
    Option("max_chat_template_chars", int, 32 << 10, "longest client chat template in "
           "characters", _TEMPLATES, ge=64),
    Option("client_template_timeout_s", float, 2.0, "seconds a client chat template may take to "
           "render (400 beyond)", _TEMPLATES, gt=0,
           note="It renders in a separate process with its own memory limit, stopped as soon "
                "as its client disconnects."),
    Option("model_template_timeout_s", float, 2.0, "seconds the model's own chat template may "
           "take to render", _TEMPLATES, gt=0,
           note="Rendered the same way; one that runs past the time, its memory limit or its "
                "output cap is a 500 naming the model's template, and the server goes on."),
    # -- replicas on Ray Serve ------------------------------------------------------------
    Option("replicas", int, 1, "servers behind the one endpoint, each a whole engine with its "
           "own threads, KV cache and expert cache", _REPLICAS, ge=1,
           note="More than one runs them as a Ray Serve application on a local Ray cluster "
                "(or the one --ray-address names), each replica taking --threads CPUs "
                "(unset: an equal share of this machine's cores); needs the replicas extra "
                "(pip install 'colibri[replicas]'). docs/replicas.md has the details."),
    Option("min_replicas", int, None, "fewest replicas when scaling on queue depth", _REPLICAS,
           ge=1, unset="1 when --max-replicas is set", example="1"),
    Option("max_replicas", int, None, "most replicas when scaling on queue depth", _REPLICAS,
           ge=1, unset="no scaling: --replicas replicas",
           note="Ray Serve adds a replica while requests wait beyond a full batch "
                "(--max-num-seqs) on each, and removes one when they do not.", example="4"),
    Option("replica_routing", str, "prefix", "which replica a request goes to: prefix (the "
           "one that recently served a prompt starting like it, unless it is much busier; "
           "else the least loaded) or round_robin", _REPLICAS,
           choices=("prefix", "round_robin")),
    Option("replica_gpus", float, 0.0, "GPUs each replica asks Ray for", _REPLICAS, ge=0),
    Option("ray_address", str, None, "the Ray cluster to run the replicas on (ray://HOST:10001 "
           "or HOST:6379)", _REPLICAS, unset="a local Ray cluster, stopped with the server",
           example="auto", metavar="ADDRESS"),
    # -- kernels and folders: read by the engine from the environment ---------------------
    Option("cache_dir", str, None, "where converted models are kept",
           _KERNELS, commands=(), setting=False, engine_env=True,
           unset="~/.cache/colibri/models", example="/var/cache/colibri"),
    Option("repack", bool, True, "copy q8/q4 weights at start into the layout this CPU's "
           "kernels read fastest", _KERNELS, commands=(), setting=False, engine_env=True,
           note="The tokens are the same either way; off keeps the files' layout, to "
                "compare speeds."),
    Option("isa", str, None, "the kernel path: ref, avx2, avxvnni or avx512", _KERNELS,
           commands=(), setting=False, engine_env=True,
           unset="the best this CPU runs, found at start",
           note="Set it to compare paths on one machine, e.g. what an AVX2-only CPU would run.",
           example="avx2"),
    Option("stream_hint", str, None, "how the AVX-512 products prefetch the weights they stream: "
           "l2 (into L2) or nta (non-temporal)", _KERNELS, commands=(), setting=False,
           engine_env=True, unset="picked at start (nta on AMD Zen 5, where it measured "
                                  "faster; l2 elsewhere)",
           note="The tokens are the same either way.", example="nta"),
    # -- generation: colibri generate and LLM.generate / LLM.stream ------------------------
    Option("max_tokens", int, 128, "tokens to generate at most", _GEN, commands=("generate",),
           setting=False, ge=1, metavar="N"),
    Option("temperature", float, 0.8, "sampling temperature; 0 is greedy", _GEN,
           commands=("generate",), setting=False, ge=0, le=2),
    Option("top_p", float, 1.0, "nucleus sampling: sample among the fewest tokens with this "
           "much probability; 1 is off", _GEN, commands=("generate",), setting=False, gt=0, le=1),
    Option("top_k", int, -1, "sample among the k most likely tokens; -1 is off", _GEN,
           commands=("generate",), setting=False, ge=-1),
    Option("seed", int, None, "seed of the sampler: the same seed, the same tokens", _GEN,
           commands=("generate",), setting=False, unset="random"),
)

OPTION: dict[str, Option] = {o.name: o for o in OPTIONS}
SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(o.section for o in OPTIONS))
EXPERT_CACHE_OPTIONS: tuple[str, ...] = tuple(o.name for o in OPTIONS if o.section == _XC)
GENERATION_OPTIONS: tuple[str, ...] = tuple(o.name for o in OPTIONS if o.section == _GEN)


def default(name: str) -> Any:
    """The one default of option `name` (for config dataclasses and function signatures)."""
    return OPTION[name].default


@dataclass
class ExpertCacheConfig:
    """How many experts to keep resident and how to load the others: the expert cache options,
    by the same names and defaults (engine.executor.expert_cache plans from it)."""

    # budget for all layers' experts; None: from memory
    expert_cache_mb: float | None = default("expert_cache_mb")
    # slots per layer (wins over the budget in MB); None: from that or from memory
    expert_cache_size: int | None = default("expert_cache_size")
    prefetch_window: int = default("prefetch_window")  # tokens of routing history: heat
    # auto (direct where the file system allows it, else pread) | direct | pread | mmap
    expert_load: str = default("expert_load")
    expert_prefetch: bool = default("expert_prefetch")  # pre-gating prefetch
    expert_pin: bool = default("expert_pin")  # pin the hot set learned from earlier runs
    expert_huge_pages: bool = default("expert_huge_pages")  # 2 MiB pages on the slots
    # one read past this fails the model instead of hanging the step
    expert_read_timeout_s: float = default("expert_read_timeout_s")
    # reader threads, reads in flight; None: measured at start (probe_readers)
    expert_readers: int | None = default("expert_readers")
    # layers read ahead: "1", "2" or "auto" (two while a read takes longer than a layer)
    expert_prefetch_depth: str = default("expert_prefetch_depth")

    @classmethod
    def from_env(cls) -> ExpertCacheConfig:
        """Defaults, with the COLIBRI_EXPERT_* variables (and COLIBRI_PREFETCH_WINDOW) that
        are set applied; ValueError names a variable out of its option's limits."""
        return cls(**env_values(EXPERT_CACHE_OPTIONS))


def command_options(command: str) -> tuple[str, ...]:
    """The names of the options `command` takes as flags, in table order."""
    return tuple(o.name for o in OPTIONS if command in o.commands)


def settings_options() -> tuple[Option, ...]:
    """The options that are fields of the server's settings."""
    return tuple(o for o in OPTIONS if o.setting)


def engine_env_variables() -> tuple[str, ...]:
    """COLIBRI_* variables the engine reads itself rather than through the server's
    settings."""
    return tuple(o.env for o in OPTIONS if o.engine_env and not o.setting)


# -- argparse -------------------------------------------------------------------------------

def add_option_args(parser: argparse.ArgumentParser, names: Iterable[str],
                    suppress: bool = False) -> None:
    """Add the flags of options `names` to parser, with the table's help, default and check.

    suppress: leave options not given out of the namespace (serve layers them over the
    environment and .env); else each defaults to the table's default, except those the engine
    reads from the environment too (see option_values). A boolean gets --name and --no-name.
    """
    for name in names:
        o = OPTION[name]
        text = f"{o.help} ({o.default_text()})".replace("%", "%%")
        if o.type is bool:
            action = parser.add_argument(o.flag, action=argparse.BooleanOptionalAction,
                                         default=argparse.SUPPRESS, help=text)
        else:
            # argparse converts the type and refuses what is not a choice; the limits are
            # checked after parsing, where the message can name the flag and the value in one
            # line (option_values, the server's settings, each command's own checks)
            kw: dict[str, Any] = {"type": o.type, "help": text, "metavar": o.metavar}
            if o.choices:
                kw["choices"], kw["metavar"] = o.choices, None
            if o.type is list:
                kw["nargs"], kw["type"] = "+", str
            action = parser.add_argument(o.flag, default=argparse.SUPPRESS, **kw)
        # an option the engine also reads from COLIBRI_<NAME> stays out of the namespace
        # unless given: option_values layers it over the environment. Set after adding, as
        # BooleanOptionalAction would print a default of its own.
        if not suppress and not o.engine_env:
            action.default = o.default


def option_values(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """Each option of names: its flag when given, else its COLIBRI_<NAME> variable where the
    engine reads one, else its default."""
    names = tuple(names)
    values = {n: OPTION[n].default for n in names}
    values.update(env_values(n for n in names if OPTION[n].engine_env))
    for n in names:
        if hasattr(args, n):
            values[n] = check_flag(OPTION[n], getattr(args, n))
    return values


def check_flag(o: Option, value: Any) -> Any:
    """value of o's flag, checked; ValueError "--flag must be ..., got value"."""
    try:
        return o.check(value)
    except ValueError as e:
        raise ValueError(f"{o.flag} {e}, got {format_value(value)}") from None


# -- the environment ------------------------------------------------------------------------

def env_values(names: Iterable[str], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options of `names` that COLIBRI_<NAME> sets (unset or empty: left out), parsed and
    checked. ValueError names the variable and what it must be."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name in names:
        o = OPTION[name]
        raw = env.get(o.env, "")
        if not raw.strip():
            continue
        try:
            out[name] = o.parse(raw)
        except ValueError as e:
            raise ValueError(f"{o.env} {e}, got {raw.strip()!r}") from None
    return out


# -- generated files ------------------------------------------------------------------------

GENERATED_BY = "scripts/make_config_docs.py from engine/core/options.py"
_WIDTH = 96


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, _WIDTH, initial_indent="# ", subsequent_indent="# ")


def _sentence(text: str) -> str:
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def render_env_example() -> str:
    """The text of .env.example: every COLIBRI_* variable with its default."""
    lines = [
        "# Colibri's settings as environment variables. Copy to .env (read from the working",
        "# folder by `colibri serve`) or export them; command-line flags win over both.",
        "# Every line shows the default; a commented line shows an example of an option that",
        f"# is unset by default. Generated by {GENERATED_BY}.",
    ]
    for section in SECTIONS:
        opts = [o for o in OPTIONS if o.section == section and o.has_env]
        if not opts:
            continue
        title = section.split(" (")[0]
        lines += ["", f"# --- {title} " + "-" * (_WIDTH - 7 - len(title))]
        if section == _XC:
            lines += _comment("Exported, these apply to generate, bench, eval and the Python "
                              "API too; their flags win over them.")
        if section == _KERNELS:
            lines += _comment("The engine reads these itself: exported, they apply to every "
                              "command and the Python API, and serve also takes them from .env.")
        for o in opts:
            text = _sentence(o.help)
            if o.default is None:
                text += f" Unset: {o.unset}."
            if o.note:
                text += " " + o.note
            lines += _comment(text)
            if o.default is None:
                lines.append(f"# {o.env}={o.example}")
            else:
                lines.append(f"{o.env}={format_value(o.default)}")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default_cell(o: Option) -> str:
    if o.default is None:
        return f"unset: {o.unset}" if o.unset else "unset"
    return f"`{format_value(o.default)}`"


def _flag_cell(o: Option) -> str:
    if not o.commands:
        return "—"
    if o.type is bool:
        return f"`{o.flag}`, `--no-{o.flag[2:]}`"
    return f"`{o.flag}`"


def _limits(o: Option) -> str:
    parts = []
    if o.choices:
        parts.append("one of " + ", ".join(f"`{c}`" for c in o.choices))
    if o.pattern:
        parts.append("one of " + ", ".join(f"`{c}`" for c in o.pattern.split("|")))
    if o.ge is not None:
        parts.append(f"at least {_num(o.ge)}")
    if o.gt is not None:
        parts.append(f"more than {_num(o.gt)}")
    if o.le is not None:
        parts.append(f"at most {_num(o.le)}")
    return "; ".join(parts)


# The HTTP API's per-request defaults, for the docs only: they follow OpenAI's API and live in
# the server's request models (tests/test_options.py holds those to this list).
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
REQUEST_DEFAULTS: tuple[tuple[str, tuple[str, ...], Any, str], ...] = (
    # (field, endpoints, default, note)
    ("max_tokens", ("completions",), 16, "as OpenAI's completions API"),
    ("max_tokens", ("chat",), None, "up to the end of the context (max_completion_tokens "
                                    "likewise)"),
    ("temperature", ("chat", "completions"), 1.0, "as OpenAI's; the Responses API too"),
    ("top_p", ("chat", "completions"), 1.0, "as OpenAI's; the Responses API too"),
    ("n", ("chat", "completions"), 1, "at most COLIBRI_MAX_N"),
)


def render_config_docs() -> str:
    """The text of docs/configuration.md: every option, by section."""
    out = [
        "# Configuration",
        "",
        f"<!-- Generated by {GENERATED_BY}; edit the table there, then run the script. -->",
        "",
        "Every option has one name: the flag `--max-queue`, the environment variable",
        "`COLIBRI_MAX_QUEUE` (also read from a `.env` file in the working folder by",
        "`colibri serve`) and the setting `max_queue` are one knob with one default. Flags win",
        "over the environment, which wins over `.env`. `.env.example` lists every variable with",
        "its default. Boolean flags come in pairs (`--prefix-cache`, `--no-prefix-cache`); as",
        "variables they take `true` or `false`.",
        "",
        "The server's options are read once at start. The expert cache options and the kernel",
        "and folder variables are read by the engine itself, so they apply to every command that",
        "loads a model (`colibri serve`, `generate`, `bench`, `eval`) and to `engine.LLM` when",
        "exported; the flags of those commands win over them.",
    ]
    for section in SECTIONS:
        opts = [o for o in OPTIONS if o.section == section]
        out += ["", f"## {section[:1].upper()}{section[1:]}", ""]
        if section == _GEN:
            out += [
                "`colibri generate` takes these as flags; `LLM.generate` and `LLM.stream` take",
                "them as keyword arguments with the same defaults. They are not server options:",
                "requests to the HTTP API carry their own (see the next section).",
                "",
            ]
        out += ["| Flag | Variable | Default | Commands | What it does |",
                "|---|---|---|---|---|"]
        for o in opts:
            what = _sentence(o.help)
            if o.note:
                what += " " + o.note
            limits = _limits(o)
            if limits:
                what += f" ({limits})"
            env = f"`{o.env}`" if o.has_env else "—"
            commands = ", ".join(o.commands) if o.commands else "all (environment)"
            out.append(f"| {_flag_cell(o)} | {env} | {_cell(_default_cell(o))} | {commands} "
                       f"| {_cell(what)} |")
    out += [
        "",
        "## Per-request defaults of the HTTP API",
        "",
        "These belong to each request, not to the server, and follow OpenAI's API so that its",
        "clients get what they expect; a request sets its own. The server's options above only",
        "bound them (`COLIBRI_MAX_N`, `COLIBRI_MAX_STOP`, `COLIBRI_MAX_LOGPROBS`, the context).",
        "",
        "| Field | Endpoints | Default | Note |",
        "|---|---|---|---|",
    ]
    for field, endpoints, value, note in REQUEST_DEFAULTS:
        where = ", ".join(f"`{ENDPOINTS[e]}`" for e in endpoints)
        shown = "unset" if value is None else f"`{format_value(value)}`"
        out.append(f"| `{field}` | {where} | {shown} | {note} |")
    return "\n".join(out) + "\n"
