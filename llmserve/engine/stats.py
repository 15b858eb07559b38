"""What the engine reports about itself, as plain data: read where the engine runs, and sent as it is to the server's
HTTP processes (server/engine_process.py, api_servers.py), which unpickle it without loading torch or the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: dict = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})  # tokens found, by tier


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification rounds with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification round: accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class ConnectorStats:
    """Disaggregated prefill: requests prefilled by the peer, prefilled here, and fallbacks by cause."""

    remote_prefills: int = 0
    bypasses: int = 0
    fallbacks: dict = field(default_factory=lambda: {"order_failed": 0, "checksum": 0, "timeout": 0, "evicted": 0,
                                                     "link": 0})
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class EngineStats:
    """What /metrics reports about the engine at one moment."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float  # fraction of KV blocks in use
    num_preemptions: int
    prefix_cache: PrefixCacheStats  # tokens looked up and found, by tier
    offload_bytes: dict[str, int]  # bytes held in each spill tier
    max_loras: int
    running_loras: list[str] | None = None  # the adapters of running and waiting requests (None: LoRA off)
    waiting_loras: list[str] | None = None
    spec_decode: SpecDecodeStats | None = None
    kv_transfer: ConnectorStats | None = None
