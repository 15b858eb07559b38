"""Token prices and what a request costs under them.

Providers count cached input differently: OpenAI's `prompt_tokens` include the cached ones (subtract
them before pricing the rest at the full rate); Anthropic reports cache reads apart from `input_tokens`.
A price says which convention the usage it prices follows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmserve.errors import InvalidRequestError, validation_summary

Convention = Literal["openai", "anthropic"]


class Price(BaseModel):
    """USD per million tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cached_input: float | None = Field(default=None, ge=0)  # None: cache reads cost the full input price
    convention: Convention = "openai"

    @model_validator(mode="after")
    def _cached_not_dearer(self):
        if self.cached_input is not None and self.cached_input > self.input:
            raise ValueError("cached_input price above the input price")
        return self


class PricingConfig(BaseModel):
    """`--pricing FILE`: {"models": {"name": {"input": 0.1, "cached_input": 0.01, "output": 0.4}}, "gpu_hour_price": 2.5}."""

    model_config = ConfigDict(extra="forbid")
    models: dict[str, Price] = Field(default_factory=dict)
    gpu_hour_price: float | None = Field(default=None, gt=0)

    @classmethod
    def load(cls, path: str) -> "PricingConfig":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise InvalidRequestError(f"cannot read pricing file {path}: {e.strerror}", "pricing") from None
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"pricing file {path} is not valid JSON ({e.msg}, line {e.lineno})", "pricing") from None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise InvalidRequestError(f"pricing file {path}: {validation_summary(e)}", "pricing") from None


@dataclass(frozen=True)
class Cost:
    input: float
    cached_input: float
    output: float

    @property
    def total(self) -> float:
        return self.input + self.cached_input + self.output

    def as_usage_details(self) -> dict:
        return {"input_cost": self.input, "cached_input_cost": self.cached_input, "output_cost": self.output}


def price_tokens(price: Price, input_tokens: int, cached_tokens: int, output_tokens: int) -> Cost:
    """input_tokens as the upstream reports them: including the cached ones (openai) or not (anthropic)."""
    uncached = input_tokens - cached_tokens if price.convention == "openai" else input_tokens
    if uncached < 0:
        raise InvalidRequestError("cached tokens exceed the prompt tokens under the openai convention", "usage")
    cached_rate = price.input if price.cached_input is None else price.cached_input
    return Cost(uncached * price.input / 1e6, cached_tokens * cached_rate / 1e6, output_tokens * price.output / 1e6)


# Standard-tier list prices, USD per 1M tokens, as the chapter quotes them for October 2026. Cache-write
# premiums, batch discounts and long-context surcharges are left out. Check the providers before relying on them.
HOSTED_PRICES_AS_OF = "2026-10"
HOSTED_PRICES: dict[str, Price] = {
    "gpt-6-sol": Price(input=2.00, cached_input=0.20, output=10.00, convention="openai"),
    "claude-sonnet-5-5": Price(input=2.00, cached_input=0.20, output=10.00, convention="anthropic"),
    "claude-opus-5-5": Price(input=4.00, output=20.00, convention="anthropic"),  # half its 8/40 fast mode
    "mercury-2.5": Price(input=0.20, output=0.75),
}
