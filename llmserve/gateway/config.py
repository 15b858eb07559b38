"""The gateway's YAML configuration, typed and checked once at start: a bad key is named in the error.

    backends:                      # where requests can go
      local-a: {url: http://127.0.0.1:8001/v1, model: SmolLM2-135M-Instruct.Q4_1, priorities: true}
      vendor-x: {url: https://api.example.com/v1, api: anthropic, model: m, api_key_env: VENDOR_X_KEY, max_context: 200000}
    models:                        # what clients ask for in "model"
      chat:
        route: prefix-affinity     # or least-outstanding, round-robin
        targets: [local-a, local-b]
        fallbacks: [vendor-x]      # each a backend or a list of backends (a group), tried in order
        params: {drop: [], reject: [], rename: {}}
        tiers: {fast: [local-a], batch: [local-b]}
"""

from __future__ import annotations

import os
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmserve.errors import InvalidRequestError, validation_summary
from llmserve.plan.pricing import Price

TIERS = ("fast", "standard", "batch")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ParamPolicy(_Strict):
    """What to do with request parameters before a request goes on: drop them silently, refuse the request (400
    naming the parameter), or rename them (e.g. max_tokens -> max_completion_tokens)."""

    drop: tuple[str, ...] = ()
    reject: tuple[str, ...] = ()
    rename: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _disjoint(self):
        both = set(self.drop) & set(self.reject)
        if both:
            raise ValueError(f"parameters both dropped and rejected: {sorted(both)}")
        for protected in ("model", "messages", "prompt", "stream"):
            if protected in self.drop or protected in self.reject or protected in self.rename:
                raise ValueError(f"'{protected}' cannot be dropped, rejected or renamed")
        return self

    @property
    def empty(self) -> bool:
        return not (self.drop or self.reject or self.rename)


class BackendConfig(_Strict):
    url: str  # the API's base, ending in /v1
    model: str  # the model name the backend knows
    api: Literal["openai", "anthropic"] = "openai"
    api_key_env: str | None = None  # the backend's key is read from this environment variable, never from the file
    max_context: int | None = Field(default=None, gt=0)  # prompt + completion tokens it accepts
    priorities: bool = False  # it takes vLLM's `priority` field (llmserve and vLLM do): tiers map to priorities
    price: Price | None = None  # USD per million tokens, with the backend's cached-token convention
    params: ParamPolicy = ParamPolicy()  # this backend's own parameter policy, after the model's
    first_token_timeout: float | None = Field(default=None, gt=0)  # overrides the gateway's
    max_tokens_default: int = Field(default=4096, gt=0)  # Anthropic requires max_tokens; used when the client sends none

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


Group = tuple[str, ...]


class ModelConfig(_Strict):
    route: Literal["prefix-affinity", "least-outstanding", "round-robin"] = "least-outstanding"
    targets: Group
    fallbacks: tuple[str | Group, ...] = ()
    params: ParamPolicy = ParamPolicy()
    tiers: dict[Literal["fast", "standard", "batch"], Group] = Field(default_factory=dict)

    @field_validator("targets")
    @classmethod
    def _some(cls, v):
        if not v:
            raise ValueError("needs at least one backend")
        return v

    def groups(self, tier: str) -> list[Group]:
        """The groups to try in order: the tier's (or the targets), then each fallback."""
        first = self.tiers.get(tier, self.targets)
        return [first] + [(f,) if isinstance(f, str) else tuple(f) for f in self.fallbacks]


class HealthConfig(_Strict):
    failures_to_trip: int = Field(default=3, gt=0)  # consecutive failures that open a backend's circuit
    cooldown: float = Field(default=10.0, gt=0)  # seconds a tripped backend is skipped before it is probed
    probe_interval: float = Field(default=2.0, gt=0)  # how often cooled-down backends are probed
    default_retry_after: float = Field(default=1.0, ge=0)  # a 429 without Retry-After cools the backend this long


class CacheConfig(_Strict):
    enabled: bool = False
    ttl: float = Field(default=300.0, gt=0)
    max_entries: int = Field(default=1024, gt=0)


class GatewayConfig(_Strict):
    backends: dict[str, BackendConfig]
    models: dict[str, ModelConfig]
    api_keys_env: str | None = None  # the gateway's own keys (comma-separated) come from this variable
    first_token_timeout: float = Field(default=30.0, gt=0)  # seconds until the first token, then the next backend
    request_timeout: float = Field(default=600.0, gt=0)  # a whole request, once streaming
    affinity_chars: int = Field(default=256, gt=0)  # prefix affinity hashes this much of the prompt's start (~64 tokens)
    affinity_load_factor: float = Field(default=1.25, ge=1.0)  # bounded load: at most this x the mean outstanding
    tier_priorities: dict[Literal["fast", "standard", "batch"], int] = Field(
        default_factory=lambda: {"fast": -10, "standard": 0, "batch": 10})
    health: HealthConfig = HealthConfig()
    cache: CacheConfig = CacheConfig()

    @model_validator(mode="after")
    def _references(self):
        for name, m in self.models.items():
            named = list(m.targets) + [b for g in m.groups("standard")[1:] for b in g] + [b for g in m.tiers.values() for b in g]
            for b in named:
                if b not in self.backends:
                    raise ValueError(f"models.{name}: unknown backend '{b}' (backends: {', '.join(self.backends)})")
        if not self.models:
            raise ValueError("models: at least one model is needed")
        return self

    @classmethod
    def load(cls, path: str) -> "GatewayConfig":
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise InvalidRequestError(f"cannot read gateway config {path}: {e.strerror}", "config") from None
        except yaml.YAMLError as e:
            raise InvalidRequestError(f"gateway config {path} is not valid YAML: {e}".replace("\n", " "), "config") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data, source: str = "config") -> "GatewayConfig":
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise InvalidRequestError(f"gateway config {source}: {validation_summary(e)}", "config") from None
