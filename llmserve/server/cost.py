"""What each request cost: from a price table when the operator gives one, else from the compute time it used
at a device-hour price. Both the response's `usage` and the `/metrics` counters come from here."""

from __future__ import annotations

from llmserve.outputs import PoolingRequestOutput, RequestOutput
from llmserve.plan.pricing import Cost, Price, PricingConfig, price_tokens


class RequestPricer:
    def __init__(self, model_name: str, pricing: PricingConfig | None = None, gpu_hour_price: float | None = None):
        self.price: Price | None = pricing.models.get(model_name) if pricing else None
        self.gpu_hour_price = gpu_hour_price if gpu_hour_price is not None else (pricing.gpu_hour_price if pricing else None)

    @property
    def enabled(self) -> bool:
        return self.price is not None or self.gpu_hour_price is not None

    @property
    def basis(self) -> str:
        return "price_table" if self.price is not None else "gpu_time"

    def cost(self, outs: list[RequestOutput | PoolingRequestOutput]) -> Cost | None:
        if self.price is not None:
            # Our own usage follows OpenAI: prompt tokens include the cached ones.
            prompt = sum(len(o.prompt_token_ids) for o in outs)
            cached = sum(o.num_cached_tokens for o in outs)
            completion = sum(len(c.token_ids) for o in outs if isinstance(o, RequestOutput) for c in o.outputs)
            return price_tokens(self.price.model_copy(update={"convention": "openai"}), prompt, cached, completion)
        if self.gpu_hour_price is not None:
            per_s = self.gpu_hour_price / 3600
            prefill = sum(o.metrics.prefill_compute_seconds for o in outs if o.metrics)
            decode = sum(o.metrics.decode_compute_seconds for o in outs if o.metrics)
            return Cost(prefill * per_s, 0.0, decode * per_s)  # cached tokens ran no compute
        return None
