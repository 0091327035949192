"""Load sweep, goodput and the targets kvrouter must meet against its peers.

* ``sweep``: per policy, per offered load (x round robin's measured capacity), its metrics.
* ``goodput``: per policy, the highest offered load up to which every tested load keeps p90
  TTFT within the SLO (a policy that meets it at every tested load is censored at the top).
* ``targets``: kvrouter against the best peer product (bench/peers.py) on each metric, all
  limits computed from this run's numbers. Given the workload's ``bounds`` (bench/bounds.py:
  what no placement beats, from the requests alone), each hit-rate and TTFT target also
  carries a ``bound`` and ``excluded`` when the bound alone puts the limit out of reach.
  Goodput has no bound: it is flagged ``censored`` when the tested loads do not bracket it.

``over_seeds``: the same targets from runs that differ only in ``--seed`` (the policies' random
tie-breaks; for the synthetic workloads, the trace), so a target met or missed by less than the
spread between seeds reads as such: per target, on how many seeds it was met and each seed's
value and limit.

A mean-TTFT target that is missed also carries ``queueing``: kvrouter's mean TTFT split into
its no-queueing floor at the hits it got (``ttft_floor_s``) and the rest, the queueing its
placement left; ``allowed_s`` is the queueing the limit leaves at that floor, and every peer's
and ``pooled_ideal``'s own queueing (mean TTFT - its floor) is given alongside. A limit whose
allowed queueing is below what every measured policy queues at this load asks for less
queueing than any router measured reaches at these hits (a comparison, not a bound: the
bound is ``bound``); more hits (a lower floor) would leave more.
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["TARGET_LOAD", "chart_p90", "goodput", "over_seeds", "sweep", "targets"]

TARGET_LOAD = 0.8
MEAN_RATIO = 0.85
P90_RATIO = 0.9
HIT_MARGIN = 0.005
GOODPUT_RATIO = 1.1
POOLED_RATIO = 1.3


def sweep(by_load: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """``{load: {policy: s}}`` -> ``{policy: {load: s}}``, loads in increasing order."""
    out: dict[str, dict[str, dict]] = {}
    for load in sorted(by_load, key=float):
        for name, s in by_load[load].items():
            out.setdefault(name, {})[load] = s
    return out


def goodput(sw: dict[str, dict[str, dict]], slo_p90_s: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, by_load in sw.items():
        best = 0.0
        for load in sorted(by_load, key=float):
            p90 = by_load[load]["ttft_p90_s"]
            if math.isnan(p90) or p90 > slo_p90_s:
                break
            best = float(load)
        out[name] = best
    return out


def _at_load(by_load: dict[str, dict[str, dict]]) -> tuple[str, dict[str, dict]]:
    for load in by_load:
        if math.isclose(float(load), TARGET_LOAD):
            return load, by_load[load]
    load = min(by_load, key=lambda x: abs(float(x) - TARGET_LOAD))
    return load, by_load[load]


def targets(
    by_load: dict[str, dict[str, dict]],
    good: dict[str, float],
    peer_names: tuple[str, ...],
    conversation_trace: bool,
    bounds: dict | None = None,
) -> dict[str, dict]:
    """Each target: ``value`` (kvrouter), ``limit``, ``best_peer``, ``load``, ``met``, and
    ``bound`` from ``bounds`` (bench/bounds.py) where it has one."""
    load, pol = _at_load(by_load)
    k = pol.get("kvrouter")
    present = [p for p in peer_names if p in pol]
    out: dict[str, dict] = {}
    if not k:
        return out
    b = bounds or {}

    def check(
        name: str,
        value: float,
        limit: float,
        ok: bool,
        best: str | None,
        bound: tuple[str, bool] | None = None,
    ) -> None:
        out[name] = {
            "value": round(value, 4),
            "limit": round(limit, 4),
            "best_peer": best,
            "load": float(load),
            "met": bool(ok),
        }
        if bound is not None and bound[0] in b:
            key, upper = bound
            excluded = limit > b[key] if upper else limit < b[key]
            out[name]["bound"] = {"what": key, "value": b[key], "excluded": bool(excluded)}
        if not ok and name.startswith("ttft_mean") and "ttft_floor_s" in k:
            others = {p: pol[p] for p in (*present, "pooled_ideal") if p in pol}
            out[name]["queueing"] = _queueing(k, limit, others)

    if present:
        best = min(present, key=lambda p: pol[p]["ttft_mean_s"])
        lim = MEAN_RATIO * pol[best]["ttft_mean_s"]
        check(
            f"ttft_mean <= {MEAN_RATIO} * best peer",
            k["ttft_mean_s"],
            lim,
            k["ttft_mean_s"] <= lim,
            best,
            ("ttft_mean_lower_s", False),
        )
        best = min(present, key=lambda p: pol[p]["ttft_p90_s"])
        lim = P90_RATIO * pol[best]["ttft_p90_s"]
        check(
            f"ttft_p90 <= {P90_RATIO} * best peer",
            k["ttft_p90_s"],
            lim,
            k["ttft_p90_s"] <= lim,
            best,
            ("ttft_p90_lower_s", False),
        )
        best = max(present, key=lambda p: pol[p]["hit_rate"])
        lim = pol[best]["hit_rate"] - HIT_MARGIN
        check(
            f"hit_rate >= best peer - {HIT_MARGIN}",
            k["hit_rate"],
            lim,
            k["hit_rate"] >= lim,
            best,
            ("hit_rate_upper", True),
        )
        if len(by_load) > 1 and "kvrouter" in good:
            best = max(present, key=lambda p: good.get(p, 0.0))
            lim = GOODPUT_RATIO * good.get(best, 0.0)
            g = good["kvrouter"]
            check(f"goodput >= {GOODPUT_RATIO} * best peer", g, lim, g >= lim, best)
            loads = [float(x) for x in by_load]
            entry = out[f"goodput >= {GOODPUT_RATIO} * best peer"]
            if good.get(best, 0.0) >= max(loads):
                entry["censored"] = f"{best} meets the SLO at every tested load: test higher loads"
            elif good.get(best, 0.0) == 0.0:
                entry["censored"] = (
                    f"no peer meets the SLO at the lowest tested load ({min(loads):g}): "
                    "their goodput is below it"
                )
    if conversation_trace and "pooled_ideal" in pol:
        lim = POOLED_RATIO * pol["pooled_ideal"]["ttft_mean_s"]
        check(
            f"ttft_mean <= {POOLED_RATIO} * pooled_ideal (conversation trace)",
            k["ttft_mean_s"],
            lim,
            k["ttft_mean_s"] <= lim,
            None,
            ("ttft_mean_lower_s", False),
        )
    return out


def over_seeds(by_seed: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """``{target: {"met_on", "seeds", "values", "limits"}}`` from each seed's ``targets``."""
    out: dict[str, dict] = {}
    for seed, targets_ in by_seed.items():
        for name, t in targets_.items():
            o = out.setdefault(name, {"met_on": 0, "seeds": 0, "values": {}, "limits": {}})
            o["seeds"] += 1
            o["met_on"] += bool(t["met"])
            o["values"][seed] = t["value"]
            o["limits"][seed] = t["limit"]
    return out


def _queueing(k: dict, limit: float, others: dict[str, dict]) -> dict:
    """kvrouter's mean TTFT as floor + queueing, the queueing ``limit`` allows at that floor,
    and each other policy's queueing (mean TTFT - its own floor; see the module docstring)."""
    floor = k["ttft_floor_s"]
    out = {
        "floor_s": round(floor, 4),
        "queueing_s": round(k["ttft_mean_s"] - floor, 4),
        "allowed_s": round(limit - floor, 4),
    }
    for key in ("queueing_resumed_s", "queueing_fresh_s", "resumed_requests"):
        if key in k:
            out[key] = k[key]
    for name, s in others.items():
        if not math.isnan(s.get("ttft_floor_s", math.nan)):
            out[f"{name}_queueing_s"] = round(s["ttft_mean_s"] - s["ttft_floor_s"], 4)
    return out


def chart_p90(sw: dict[str, dict[str, dict]], slo_p90_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, by_load in sw.items():
        loads = sorted(by_load, key=float)
        ax.plot(
            [float(x) for x in loads],
            [max(by_load[x]["ttft_p90_s"], 1e-3) for x in loads],
            marker="o",
            lw=2.4 if name == "kvrouter" else 1.2,
            label=name,
        )
    ax.axhline(slo_p90_s, color="grey", ls="--", lw=1, label=f"SLO p90 {slo_p90_s:g} s")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (x round-robin capacity)")
    ax.set_ylabel("p90 TTFT (s, log)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
