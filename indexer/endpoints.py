"""Turn a vLLM-reported ZMQ endpoint into the one a subscriber connects to.

docs/vllm-reference.md §2.2: vLLM reports endpoints as configured, so a wildcard bind host
(``tcp://*:5557``) comes back literally and must be replaced by the worker's address. Each DP
rank publishes on its own port: ``port + rank`` for tcp (unchanged for port 0, where every rank
gets its own OS port), ``inproc://name_dp{rank}`` for inproc; ipc is rejected for ranks > 0, as
vLLM does.
"""

from __future__ import annotations

__all__ = ["WILDCARD_HOSTS", "concrete_endpoint", "offset_endpoint", "resolve_endpoint"]

WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", "[*]", ""})


def _split_tcp(endpoint: str) -> tuple[str, int]:
    rest = endpoint[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"tcp endpoint without a port: {endpoint!r}")
    return host, int(port)


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint of DP rank ``dp_rank`` given rank 0's (vLLM's ``offset_endpoint_port``)."""
    if dp_rank < 0:
        raise ValueError("dp_rank must be >= 0")
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp://"):
        host, port = _split_tcp(endpoint)
        return endpoint if port == 0 else f"tcp://{host}:{port + dp_rank}"
    raise ValueError(f"only tcp:// and inproc:// endpoints can be offset per DP rank: {endpoint!r}")


def concrete_endpoint(endpoint: str, host: str, dp_rank: int = 0) -> str:
    """Replace a wildcard host (``*``, ``0.0.0.0``, ``::``) by ``host``, then offset by rank."""
    if endpoint.startswith("tcp://"):
        old, port = _split_tcp(endpoint)
        if old in WILDCARD_HOSTS:
            if not host:
                raise ValueError(f"endpoint {endpoint!r} has a wildcard host; give the host")
            new = f"[{host}]" if ":" in host and not host.startswith("[") else host
            endpoint = f"tcp://{new}:{port}"
    return offset_endpoint(endpoint, dp_rank)


def resolve_endpoint(endpoint: str, host: str | None, dp_rank: int) -> str:
    """The endpoint to connect to for DP rank ``dp_rank``: the wildcard host replaced by
    ``host`` when one is given; without ``host`` a wildcard host is an error."""
    if host:
        return concrete_endpoint(endpoint, host, dp_rank)
    if endpoint.startswith("tcp://"):
        h = endpoint[len("tcp://") :].rpartition(":")[0]
        if h in WILDCARD_HOSTS:
            raise ValueError(f"endpoint {endpoint!r} has a wildcard host; pass host=")
    return offset_endpoint(endpoint, dp_rank)
