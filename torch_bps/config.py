"""One place for configuration: environment variables and keywords resolved once into a dataclass.

Keywords win over environment variables, which win over defaults. Every BPS_* variable is listed in
`Config`'s fields below; resolve with `Config.resolve(**keywords)` and pass the result explicitly.
May import: the standard library and torch_bps.errors only.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from torch_bps.errors import ConfigError


def _parse_servers(value: str) -> tuple[str, ...]:
    servers = tuple(s.strip() for s in value.split(",") if s.strip())
    for s in servers:
        host, _, port = s.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"BPS_SERVERS entry {s!r} is not host:port")
    return servers


@dataclass(frozen=True)
class Config:
    """Settings of a worker. Field -> environment variable: upper-case with the BPS_ prefix."""

    servers: tuple[str, ...] = field(default=(), metadata={"env": "BPS_SERVERS", "parse": _parse_servers})
    # A request with no reply within this many seconds fails, naming server, key and round.
    timeout: float = field(default=300.0, metadata={"env": "BPS_TIMEOUT", "parse": float})
    # How long to wait for every server to answer HELLO.
    connect_timeout: float = field(default=30.0, metadata={"env": "BPS_CONNECT_TIMEOUT", "parse": float})
    partition_bytes: int = field(default=4_096_000, metadata={"env": "BPS_PARTITION_BYTES", "parse": int})

    @classmethod
    def resolve(cls, **keywords) -> Config:
        """Build a Config from keywords, then BPS_* environment variables, then defaults.

        Example: `Config.resolve(servers=("10.0.0.5:9000",), timeout=60)`.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(keywords) - names
        if unknown:
            raise ConfigError(f"unknown torch_bps setting(s): {sorted(unknown)}; known: {sorted(names)}")
        values = {}
        for f in dataclasses.fields(cls):
            if keywords.get(f.name) is not None:
                values[f.name] = keywords[f.name]
                continue
            raw = os.environ.get(f.metadata["env"])
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = f.metadata["parse"](raw)
            except (ValueError, ConfigError) as e:
                raise ConfigError(f"{f.metadata['env']}={raw!r}: {e}") from None
        config = cls(**values)
        config._check()
        return config

    def _check(self) -> None:
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError(f"timeouts must be positive (timeout={self.timeout}, connect={self.connect_timeout})")
        if self.partition_bytes < 1024:
            raise ConfigError(f"partition_bytes={self.partition_bytes} is below 1024")
