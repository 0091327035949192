"""Routing policy: pure code, no I/O, no hidden clocks (``now`` is always an argument).

The kvrouter policy picks the engine with the lowest *expected time to first token*
(docs/design.md, "Routing policy"), estimated in prefill-token equivalents:

    cost = uncached prefill tokens of this prompt on that engine
         + cpu_hit_tokens * cpu_transfer_discount        (loading offloaded chunks is cheaper)
         + prefill tokens already queued there by this router (released at first token),
           less what the engine has done of the oldest of them at its learned prefill rate
           (``queued_estimate``)
         + the worker's own /metrics correction for that engine:
             waiting requests the router did not send itself  * mean prompt tokens
             running requests                                  * running_request_tokens
             KV usage above kv_pressure_threshold              * kv_pressure_tokens (scaled)
         + what the request's LoRA adapter costs there (router/lora.py): loading it, waiting for
           an adapter slot
    expected TTFT = cost / prefill_tokens_per_s

Ranking adds ``(weight - 1) * uncached``: recomputing a prefix elsewhere also delays every request
that queues behind it there and evicts cached prefixes to store the copy (``recompute_weight``:
learned by default as ``1 / (1 - u) + k / (1 - k)`` from the fleet's utilization ``u``, the share
of engines busy when requests arrive, and its mean KV usage ``k``; any value >= 1 fixes it; an
engine unused for a window weighs it at the floor, see ``KvRouterPolicy.unused``; raised while the
router has given up more cache hits than ``hit_loss_budget`` allows, see
``KvRouterPolicy.hit_loss_weight``). Ranking also adds what the engine's mean queue costs the
requests expected to continue this prompt there (``KvRouterPolicy.follow_on_tokens``): a prompt
placed on an engine pins its continuations to that engine's cache. A copy of a prefix more of the
traffic shares than its holders can take at an even spread ranks partly like a hit
(``KvRouterPolicy.new_holder_credit``, ``router/popularity.py``). On a hybrid model (sliding-window
or Mamba groups) ranking subtracts ``weight * junction``: a prefix whose full-attention blocks an
engine holds without the other groups' (a *junction*, ``Candidate.junction_tokens``) is not a hit
for this prompt, but computing the prompt there makes it one for every later prompt sharing it, so
it ranks like the hit it becomes.

Hits are the larger of what the index shows and what a short-lived speculative entry predicts
(a prefix this router just sent there, before the worker's events arrive). Herd protection:
every candidate whose cost is within ``near_tie_tokens`` of the best is a near-tie; among them
the one with the fewest in-flight requests wins, remaining ties broken at random (seeded RNG).

The routing benchmark drives this module directly with a simulated clock:

    policy = make_policy("kvrouter", PolicyParams(...), seed=0)
    spec = SpeculativeCache(ttl_s=2.0)
    hits = spec.hit_tokens(engine, keys, unit=16, now=t)
    d = policy.choose([Candidate(engine, gpu, cpu, EngineLoad(...), speculative_tokens=hits)], n, t)
    spec.record(d.engine, keys, now=t)
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from router.load import EngineLoad
from router.popularity import PrefixPopularity, PromptKeys
from router.speculative import SAMPLE_STRIDE, Engine, SpeculativeCache

__all__ = [
    "SAMPLE_STRIDE",
    "Candidate",
    "Decision",
    "EngineCost",
    "KvRouterPolicy",
    "LeastLoadedPolicy",
    "Policy",
    "PolicyParams",
    "RandomPolicy",
    "RoundRobinPolicy",
    "SpeculativeCache",
    "make_policy",
]


@dataclass(slots=True)
class Candidate:
    engine: Engine
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    load: EngineLoad = field(default_factory=EngineLoad)
    speculative_tokens: int = 0
    """Hit predicted by a speculative entry; used when larger than the indexed GPU hit."""
    adapter_tokens: float = 0.0
    """Prefill-token equivalent of readying the request's LoRA adapter there (router/lora.py)."""
    junction_tokens: int = 0
    """On an engine with sliding-window or Mamba groups, the prefix its full-attention blocks
    hold (or are about to: a speculative entry) when longer than the hit. vLLM keeps those
    groups' blocks only at a prompt's replay boundary and at such junctions, so the prompt
    computes that prefix there, and every later prompt sharing it hits it there."""


class PolicyParams(msgspec.Struct, forbid_unknown_fields=True):
    """The ``policy`` section of the configuration: which policy, and the kvrouter cost model.

    The prefill rate ``queue_drain`` trusts is learned per engine, ``recompute_weight`` from the
    fleet (unless fixed); docs/benchmarks.md has the A/B figures of both.
    """

    name: str = "kvrouter"
    """Which policy :func:`make_policy` builds: kvrouter, round_robin, least_loaded or random."""
    speculative_ttl_s: float = 2.0
    """Lifetime of a speculative entry (:class:`SpeculativeCache`)."""
    cpu_transfer_discount: float = 0.25
    near_tie_tokens: int = 64
    prefill_tokens_per_s: float = 8000.0
    """Converts token cost to seconds for ``/debug/route``'s ``expected_ttft_s`` until an engine's
    own prefill rate has been learned (ranking compares tokens, never seconds)."""
    mean_prompt_tokens: float = 1024.0
    """Assumed prompt size of a waiting request the router did not send (other routers)."""
    running_request_tokens: float = 16.0
    """Prefill-token equivalent each running (decoding) request costs a new prefill."""
    kv_pressure_threshold: float = 0.9
    kv_pressure_tokens: float = 2048.0
    """Added cost at 100 % KV usage (linear from the threshold): preemption and eviction risk."""
    queue_drain: float = 1.0
    """How much of each worker's learned prefill rate to trust (0 = none). The router's queued
    tokens only fall at first tokens, so a worker 3 s into a 60k-token prefill still counts all
    60k; the policy instead counts the request at the head of the router's queue there as done
    at that rate since the worker turned to it (the router's last first token there, or the
    send that found nothing queued), never beyond the request itself. The rate is learned per
    worker from its streamed first tokens, so it fits the GPU and model without configuration;
    a rate above the real one makes a busy worker look idle, which is why it is learned and not
    configured."""
    recompute_weight: float = 0.0
    """Weight of a prompt's uncached tokens against queued ones when ranking; 0 (the default)
    learns it from the fleet's utilization and KV usage (:meth:`KvRouterPolicy.
    recompute_weight`), any value >= 1 fixes it. A fixed weight fits one traffic shape: a
    high one keeps long conversations' hits but queues chat turns behind a busy holder while
    other engines idle, a low one does the reverse (docs/benchmarks.md has the A/B).
    Above 1 a cached prefix is worth more than the queue it saves this one request:
    recomputing it elsewhere spends that prefill a second time, and every request that queues
    behind it on that engine waits for it too. ``near_tie_tokens`` is scaled by it.
    ``cost_tokens`` and ``expected_ttft_s`` stay unweighted (they are the TTFT estimate)."""
    follow_on_weight: float = 0.5
    """Share of the expected continuations of a prompt whose wait in the engine's mean queue
    its placement is charged (:meth:`KvRouterPolicy.follow_on_tokens`; 0 = none). Moving a
    session to a quieter engine closes about half the gap between the two queues (the one
    loses its load, the other gains it), hence a half."""
    new_holder_weight: float = 1.0
    """Share of a new holder's worth credited to recomputing a popular prefix away from its
    holders (:meth:`KvRouterPolicy.new_holder_credit`; 0 = none, 1 = the whole measured
    shortfall of holders)."""
    hit_loss_budget: float = 0.003
    """Share of prompt tokens the router may give up in cache hits, once its first window of
    decisions is past, by sending requests away from the engine that caches most of their
    prompt (:meth:`KvRouterPolicy.hit_loss_weight`). Each such move saves that request
    queueing but computes the prefix a second time; beyond the budget the recompute weight
    rises until only the moves that save the most queueing pass. 1 = no budget."""
    prefill_priority: bool = False
    """Write each completion's vLLM ``priority``: the size class of the prefill it leaves on its
    engine, so engines run shorter prefills first (router/prefill_priority.py). Needs every
    worker started with ``--scheduling-policy priority`` (without it vLLM ignores the field)."""
    prefill_priority_max_wait_s: float = 5.0
    """With ``prefill_priority``: how long beyond its own prefill a request may wait on its engine
    before later requests there stop passing it (vLLM itself never ages a waiting request; the
    admission queue's ``shortest_first_max_wait_s`` is the same bound at the router)."""


@dataclass(slots=True)
class EngineCost:
    engine: Engine
    hit_tokens: int
    """GPU hit used (max of index and speculative)."""
    cpu_hit_tokens: int
    uncached_tokens: int
    queued_tokens: float
    metrics_tokens: float
    cost_tokens: float
    expected_ttft_s: float
    """``cost_tokens`` at ``prefill_tokens_per_s``: an estimate for reading, not for ranking."""
    rank_tokens: float
    """What the ranking compares: ``cost_tokens`` plus ``(recompute_weight - 1) * uncached``
    plus ``follow_on_tokens`` minus ``recompute_weight * (junction_tokens +
    new_holder_tokens)``."""
    speculative: bool
    """True when the speculative entry supplied the hit."""
    prefill_tokens_per_s: float = 0.0
    """The engine's learned prefill rate, else the configured ``prefill_tokens_per_s``."""
    rate_learned: bool = False
    follow_on_tokens: float = 0.0
    """The engine's mean queue charged for the requests expected to continue this prompt
    there (:meth:`KvRouterPolicy.follow_on_tokens`)."""
    junction_tokens: int = 0
    """Tokens beyond the hit that computing the prompt there makes hittable for the prompts
    sharing them (``Candidate.junction_tokens``); ranked like cached ones."""
    new_holder_tokens: float = 0.0
    """Tokens of a popular prefix that computing the prompt there copies, times the share of
    a hit an extra holder of that prefix is worth (:meth:`KvRouterPolicy.new_holder_credit`);
    ranked like cached ones."""


@dataclass(slots=True)
class Decision:
    engine: Engine
    ranked: list[Engine]
    """Every candidate, best first (the proxy retries on ``ranked[1]``)."""
    costs: list[EngineCost]
    """Per candidate, in candidate order (empty for policies that do not score)."""
    reason: str
    predicted_hit_tokens: int = 0


class Policy:
    """``choose`` ranks the candidates for one request. ``dry_run=True`` (``/debug/route``)
    decides the same way but leaves the policy's state (round-robin turn, learned queue drain)
    as it was, so asking why changes no later decision. ``prompt``: the prompt's block keys and
    pool (None when it was not tokenized); the kvrouter policy learns from them which prefixes
    many requests share."""

    name = "base"

    def choose(
        self,
        candidates: Sequence[Candidate],
        prompt_tokens: int,
        now: float,
        *,
        dry_run: bool = False,
        prompt: PromptKeys | None = None,
    ) -> Decision:
        raise NotImplementedError


def _draws(rng: random.Random, dry_run: bool) -> random.Random:
    """The generator a decision's tie-breaks draw from: on a dry run a copy, so that asking
    why leaves every later tie-break as it would have been."""
    if not dry_run:
        return rng
    twin = random.Random()
    twin.setstate(rng.getstate())
    return twin


UTILIZATION_DECISIONS = 256
"""Decisions the utilization averages over (exponentially; a plain mean before that many)."""
MAX_RECOMPUTE_WEIGHT = 16.0
"""Ceiling of the learned weight: near full utilization there is no steady state to model."""
HIT_LOSS_GAIN = 4.0
"""Recompute weight added per mean prompt of cache hit given up beyond ``hit_loss_budget``."""
LEARNED_WEIGHT_FLOOR = 1.1
"""Least learned weight. At 1 (an idle fleet) waiting for a prefix queued on its holder and
recomputing it on an idle engine tie, and the near-tie rule (fewest in-flight requests) sends
siblings that arrive together away from the first one's speculative entry: the prefix is
computed twice for no gain in TTFT. Just above 1, an equal wait goes to the cached copy while
a recompute that is clearly faster still wins."""


def kv_weight(kv_usage: float) -> float:
    """Extra weight of an uncached token when running requests fill the fleet's KV caches to
    ``kv_usage`` on average (``k / (1 - k)``, the KV counterpart of the queueing term).

    Recomputing a prefix away from its holder stores a second copy of it, which evicts cached
    prefixes from the part of the cache running requests leave free; the smaller that part,
    the sooner the evicted prefixes are ones later requests come back for. The fleet's mean,
    not the candidate's own usage: the engines running the most are the holders of the
    busiest conversations, and pricing their uncached tokens higher drives those
    conversations away from their prefixes."""
    k = min(max(kv_usage, 0.0), 0.95)
    return k / (1.0 - k)


RATE_WINDOW_S = 60.0
"""Prefill seconds the learned rate averages over (older evidence is halved away)."""
RATE_MIN_S = 2.0
"""No rate is assumed before an engine has been seen prefilling this long."""


@dataclass(slots=True)
class _Rate:
    """One engine's prefill rate as served (see ``KvRouterPolicy.queued_estimate``)."""

    tokens: int = 0
    """``EngineLoad.prefilled_tokens`` already taken in."""
    seconds: float = 0.0
    """``EngineLoad.prefill_seconds`` already taken in."""
    window_tokens: float = 0.0
    """Prefilled tokens in the window, decayed."""
    window_s: float = 0.0
    """Their prefill seconds, decayed alike: ``window_tokens / window_s`` is the rate."""

    def take(self, tokens: int, seconds: float) -> None:
        """The load record's counters now. Counters that went back (a new record: the worker
        was replaced) start the count again from there."""
        dt, ds = tokens - self.tokens, seconds - self.seconds
        if dt >= 0 and ds >= 0:
            self.window_tokens += dt
            self.window_s += ds
            if self.window_s > RATE_WINDOW_S:
                self.window_tokens *= 0.5
                self.window_s *= 0.5
        self.tokens, self.seconds = tokens, seconds

    def rate(self) -> float | None:
        if self.window_s < RATE_MIN_S or self.window_tokens <= 0:
            return None
        return self.window_tokens / self.window_s


class KvRouterPolicy(Policy):
    name = "kvrouter"

    def __init__(self, params: PolicyParams | None = None, seed: int | None = None) -> None:
        self.params = params or PolicyParams()
        self._rng = random.Random(seed)
        self._rates: dict[Engine, _Rate] = {}
        """Per engine, its learned prefill rate."""
        self._busy = 0.0  # see utilization()
        self._decisions = 0
        self._last_sent: dict[Engine, int] = {}
        """Per engine, the decision that last chose it (see ``unused``)."""
        self._mean_queue: dict[Engine, float] = {}
        """Per engine, the prefill tokens ahead of a request arriving there (queued and
        foreign waiting), averaged over decisions like the utilization."""
        self._hit = 0.0  # chosen engines' predicted hit tokens, averaged over decisions
        self._prompt = 0.0  # prompt tokens, averaged alike: see reuse()
        self.popularity = PrefixPopularity(UTILIZATION_DECISIONS)
        """Which prefixes the requests of the last decisions shared: see new_holder_credit."""
        self._hit_debt = 0.0
        """Hit tokens given up beyond the budget (negative: budget saved): see hit_loss_weight."""
        self._counting_hit_loss = False
        self._repeated = 0.0
        """The share of a prompt's tokens that recent prompts already began with, averaged over
        decisions like the hit rate: see hit_loss_weight."""

    def utilization(self) -> float:
        """The share of engines with prefill queued (this router's, or waiting requests it did
        not send) when a request arrives, averaged over decisions. Arrivals see time averages,
        so this is the share of time an engine is busy: its utilization."""
        return self._busy

    def recompute_weight(self, kv_usage: float = 0.0) -> float:
        """``recompute_weight`` if set, else learned from the fleet's state: ``1 / (1 - u)`` at
        utilization ``u`` plus :func:`kv_weight` at the fleet's mean KV usage ``kv_usage``.

        ``x`` more tokens to prefill on an engine delay this request by ``x`` and, in an M/M/1
        queue, the requests behind it by ``x * u / (1 - u)`` in all: an idle fleet weighs
        recomputing at about its own cost (nobody waits), a busy one at the queueing it causes.
        The copy it stores costs cache room as well, which the KV term prices. Never below
        ``LEARNED_WEIGHT_FLOOR``."""
        w = self.params.recompute_weight
        if w > 0:
            return w
        queueing = 1.0 / max(1.0 - self._busy, 1e-9)
        learned = max(queueing, LEARNED_WEIGHT_FLOOR) + kv_weight(kv_usage)
        return min(learned, MAX_RECOMPUTE_WEIGHT)

    def hit_loss_weight(self) -> float:
        """What the hit-loss budget adds to every candidate's recompute weight now.

        A request sent away from the engine caching the longest prefix of its prompt gives up
        that hit to skip the holder's queue. Each such move is the cheaper one for its request,
        but they come in runs: a long prompt with no cached prefix lands on the holder of a
        popular one, and its requests leave one after another, each computing the prefix
        again. The budget is a token bucket: every decision adds ``hit_loss_budget`` of its
        prompt, up to one window's worth (``hit_loss_budget * UTILIZATION_DECISIONS`` mean
        prompts, so a rare move needs no saving up), every decision takes the hit it gave up.
        While it is in debt the weight rises by ``HIT_LOSS_GAIN`` per mean prompt owed, so only
        the moves that save the most queueing pass.

        In the first window, what counts depends on the traffic. Where prompts mostly repeat
        what recent prompts began with (shared system prompts, sessions' histories: each
        computed token is read again at least once), a cold fleet's moves make the copies that
        later requests hit, so they are not counted. Where prompts mostly do not (long
        conversations that share little), a move gives up its own request's hit and nothing
        else: a decision is counted when the repeated share measured so far, plus
        ``1 / sqrt(decisions)`` (two standard errors of a share, at most), is under a half.
        The bucket starts full if the first decision counted is in the first window (there was
        no window to save it in), empty if it comes after. docs/benchmarks.md has the A/Bs."""
        if self._hit_debt <= 0.0 or self._prompt <= 0.0:
            return 0.0
        return min(HIT_LOSS_GAIN * self._hit_debt / self._prompt, MAX_RECOMPUTE_WEIGHT)

    @property
    def hit_debt_tokens(self) -> float:
        """Hit tokens given up beyond the budget (negative: budget saved up)."""
        return self._hit_debt

    def _observe_hit_loss(
        self, costs: Sequence[EngineCost], chosen: EngineCost, prompt: int
    ) -> None:
        budget = self.params.hit_loss_budget
        if budget >= 1.0:
            return
        n = self._decisions
        if n <= UTILIZATION_DECISIONS and self._repeated + 1.0 / math.sqrt(n) >= 0.5:
            return
        saved = budget * UTILIZATION_DECISIONS * self._prompt
        if not self._counting_hit_loss:
            self._counting_hit_loss = True
            if n <= UTILIZATION_DECISIONS:
                self._hit_debt = -saved  # no window yet to save it in
        best = max(x.hit_tokens + x.cpu_hit_tokens for x in costs)
        lost = best - chosen.hit_tokens - chosen.cpu_hit_tokens
        self._hit_debt = max(self._hit_debt + lost - budget * prompt, -saved)

    def _observe_repeated(self, prompt: PromptKeys, prompt_tokens: int) -> None:
        depth = self.popularity.count(prompt.keys, prompt.pool) * prompt.key_tokens
        share = min(depth / prompt_tokens, 1.0) if prompt_tokens > 0 else 0.0
        self._repeated += self._alpha() * (share - self._repeated)

    def reuse(self) -> float:
        """How many times a prompt token computed on the fleet is read from cache afterwards, on
        average: ``h / (1 - h)`` at the predicted hit rate ``h`` of this router's decisions
        (every token is computed once and hit ``h / (1 - h)`` times)."""
        h = min(self._hit / self._prompt, 0.999) if self._prompt > 0 else 0.0
        return h / (1.0 - h)

    def follow_on_tokens(self, engine: Engine) -> float:
        """What placing a prompt on ``engine`` costs the requests expected to continue it.

        Each continuation goes where the prompt's cache is, so it waits in that engine's queue:
        its mean over decisions, not the queue of this instant. ``reuse()`` estimates how many
        continuations a prompt has; the charge is ``follow_on_weight * reuse * mean queue``.
        The current request's own wait is the cost's queued term; this prices the session's.
        Without it, every new session of a shared prompt starts on the one engine caching it
        (the best for that request) and stays there while other engines idle. It is off while
        ``reuse() < 1``: where most computed tokens are never read again, a prompt's placement
        does not decide where later requests go. Capped at ``MAX_RECOMPUTE_WEIGHT`` mean queues.
        """
        return self._follow_on_queues() * self._mean_queue.get(engine, 0.0)

    def _follow_on_queues(self) -> float:
        """How many mean queues a placement is charged: the same for every engine of a
        decision (see ``follow_on_tokens``)."""
        r = self.reuse()
        k = self.params.follow_on_weight
        if r < 1.0 or k <= 0:
            return 0.0
        return min(k * r, MAX_RECOMPUTE_WEIGHT)

    def new_holder_credit(
        self,
        costs: Sequence[EngineCost],
        weights: Sequence[float],
        prompt: PromptKeys,
    ) -> None:
        """Rank recomputing a popular prefix away from its holders partly like a hit.

        The prefix is the deepest one a candidate holds (GPU or CPU hit), measured at the
        deepest sampled key inside it (:class:`PrefixPopularity`). When a share ``s`` of recent
        requests began with it and ``h`` of the ``n`` candidates hold it, its holders receive
        ``s`` of the requests with ``h / n`` of the engines: an even spread needs ``n * s``
        holders, and while there are fewer, its requests queue on the holders and the rest of
        the fleet idles. One more holder is then worth ``1 - h / (n * s)`` of a hit to the
        requests of that prefix (``new_holder_weight`` of it is credited); nothing once there
        are enough, and nothing for a prefix one session uses (``s`` is then about a request in
        a window). Each candidate short of the prefix is credited that share of the tokens it
        lacks (``EngineCost.new_holder_tokens``), subtracted from its rank at its own recompute
        weight, as a junction is; the request still computes them (``cost_tokens``).
        Updates ``costs`` in place."""
        held = [x.hit_tokens + x.cpu_hit_tokens for x in costs]
        unit = prompt.key_tokens
        n_keys, share = self.popularity.share(prompt.keys, max(held) // unit, prompt.pool)
        depth = n_keys * unit
        if share <= 0.0 or depth <= 0:
            return
        holders = sum(1 for h in held if h >= depth)
        worth = (1.0 - holders / (len(costs) * share)) * self.params.new_holder_weight
        if worth <= 0.0:
            return
        for x, w, h in zip(costs, weights, held, strict=True):
            lacking = depth - h - x.junction_tokens
            if lacking > 0:
                x.new_holder_tokens = worth * lacking
                x.rank_tokens -= w * x.new_holder_tokens

    def unused(self, c: Candidate) -> bool:
        """True for an engine this router has sent nothing to over its last
        ``UTILIZATION_DECISIONS`` decisions that runs, queues and holds nothing now.

        Its uncached tokens are weighed at ``LEARNED_WEIGHT_FLOOR``: the recompute weight prices
        the requests a recompute delays, and there are none on such an engine. With the fleet's
        weight, a fleet whose every prefix already has a holder leaves an engine that holds
        none unused while the holders queue (each session starts where its shared prompt is
        cached and grows there); at the floor it takes a request once waiting on the holder
        costs more than recomputing the whole prompt. Once chosen, the engine is not unused for
        another window, so a burst sends it one request."""
        ld = c.load
        return (
            self._decisions > UTILIZATION_DECISIONS
            and self._decisions - self._last_sent.get(c.engine, -UTILIZATION_DECISIONS - 1)
            > UTILIZATION_DECISIONS
            and ld.is_idle()
            and not (ld.running or ld.waiting)
        )

    def _observe_busy(self, candidates: Sequence[Candidate]) -> None:
        busy = sum(
            1
            for c in candidates
            if c.load.queued_prefill_tokens > 0 or c.load.foreign_waiting() > 0
        )
        self._decisions += 1
        self._busy += self._alpha() * (busy / len(candidates) - self._busy)

    def _alpha(self) -> float:
        return 1.0 / min(max(self._decisions, 1), UTILIZATION_DECISIONS)

    def _observe_decision(
        self, costs: Sequence[EngineCost], chosen: EngineCost, prompt: int
    ) -> None:
        a = self._alpha()
        for x in costs:
            q = self._mean_queue.get(x.engine, 0.0)
            self._mean_queue[x.engine] = q + a * (x.queued_tokens + x.metrics_tokens - q)
        self._hit += a * (chosen.hit_tokens + chosen.cpu_hit_tokens - self._hit)
        self._prompt += a * (prompt - self._prompt)

    def queued_estimate(self, c: Candidate, now: float, commit: bool = True) -> float:
        """Prefill tokens still queued on ``c.engine``, as of ``now``.

        ``queued_prefill_tokens`` holds a request's whole uncached prompt until its first token,
        so it overstates an engine part-way through a long prefill. The engine admits requests
        in order, so of this router's requests there only the oldest (``head_tokens``) is being
        prefilled, since ``head_since``; at the engine's learned rate that much of it is done,
        never more than the request itself: the rest of the count is still to come. Before a
        rate is learned (or with ``queue_drain`` 0) the count stands in full. ``commit=False``
        (a dry run) computes the same estimate and keeps no observation.
        """
        ld = c.load
        q = float(ld.queued_prefill_tokens)
        rate = self._rate(c, commit)
        if q <= 0 or rate is None or self.params.queue_drain <= 0:
            return q
        done = self.params.queue_drain * rate * max(0.0, now - ld.head_since)
        return max(q - min(done, float(ld.head_tokens)), 0.0)

    def _rate(self, c: Candidate, commit: bool) -> float | None:
        st = self._rates.get(c.engine)
        if st is None:
            st = _Rate()
            if commit:
                self._rates[c.engine] = st
        elif not commit:
            st = copy.copy(st)
        st.take(c.load.prefilled_tokens, c.load.prefill_seconds)
        return st.rate()

    def prefill_rate(self, engine: Engine) -> float | None:
        """Tokens/s this engine has been seen to prefill (its learned rate: each streamed first
        token's uncached tokens over the time since the one before it, or since the send that
        found the engine idle), or None before there is enough evidence."""
        st = self._rates.get(engine)
        return st.rate() if st is not None else None

    def cost(
        self,
        c: Candidate,
        prompt_tokens: int,
        queued: float | None = None,
        rate: float | None = None,
        weight: float | None = None,
        follow_on: float = 0.0,
    ) -> EngineCost:
        p = self.params
        if weight is None:
            weight = self.recompute_weight()
        max_hit = max(prompt_tokens - 1, 0)
        spec = c.speculative_tokens > c.gpu_hit_tokens
        hit = min(max(c.gpu_hit_tokens, c.speculative_tokens), max_hit)
        cpu = min(c.cpu_hit_tokens, max(max_hit - hit, 0)) if not spec else 0
        uncached = max(prompt_tokens - hit - cpu, 0)
        ld = c.load
        metrics = ld.foreign_waiting() * p.mean_prompt_tokens
        metrics += ld.running * p.running_request_tokens
        metrics += c.adapter_tokens
        if ld.kv_usage > p.kv_pressure_threshold < 1.0:
            frac = (ld.kv_usage - p.kv_pressure_threshold) / (1.0 - p.kv_pressure_threshold)
            metrics += min(frac, 1.0) * p.kv_pressure_tokens
        if queued is None:
            queued = float(ld.queued_prefill_tokens)
        total = uncached + cpu * p.cpu_transfer_discount + queued + metrics
        # A junction is ranked as the hit it becomes for the prompts that share it (see
        # Candidate.junction_tokens); this prompt computes it all the same (cost_tokens).
        junction = max(min(c.junction_tokens, max_hit) - hit - cpu, 0)
        return EngineCost(
            engine=c.engine,
            hit_tokens=hit,
            cpu_hit_tokens=cpu,
            uncached_tokens=uncached,
            queued_tokens=queued,
            metrics_tokens=metrics,
            cost_tokens=total,
            expected_ttft_s=total / (rate or p.prefill_tokens_per_s),
            prefill_tokens_per_s=rate or p.prefill_tokens_per_s,
            rate_learned=rate is not None,
            rank_tokens=total + (weight - 1.0) * uncached + follow_on - weight * junction,
            speculative=spec,
            follow_on_tokens=follow_on,
            junction_tokens=junction,
        )

    def choose(
        self,
        candidates: Sequence[Candidate],
        prompt_tokens: int,
        now: float,
        *,
        dry_run: bool = False,
        prompt: PromptKeys | None = None,
    ) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        if not dry_run and len(self._rates) > 2 * len(candidates) + 16:  # engines left: forget
            live = {c.engine for c in candidates}
            self._rates = {e: st for e, st in self._rates.items() if e in live}
            self._last_sent = {e: d for e, d in self._last_sent.items() if e in live}
            self._mean_queue = {e: q for e, q in self._mean_queue.items() if e in live}
        weight = self.recompute_weight(sum(c.load.kv_usage for c in candidates) / len(candidates))
        if not dry_run:
            self._observe_busy(candidates)
        follow_on = self._follow_on_queues()
        owed = self.hit_loss_weight()
        weights = [
            (min(weight, LEARNED_WEIGHT_FLOOR) if self.unused(c) else weight) + owed
            for c in candidates
        ]
        costs = [
            self.cost(
                c,
                prompt_tokens,
                self.queued_estimate(c, now, commit=not dry_run),
                self.prefill_rate(c.engine),
                w,
                follow_on * self._mean_queue.get(c.engine, 0.0),
            )
            for c, w in zip(candidates, weights, strict=True)
        ]
        if prompt is not None and prompt.keys and prompt.key_tokens > 0:
            self.new_holder_credit(costs, weights, prompt)
            if not dry_run:
                self._observe_repeated(prompt, prompt_tokens)
        best = min(x.rank_tokens for x in costs)
        tie = self.params.near_tie_tokens * max(weight, 1.0)
        # Rank: near-ties of the best by in-flight requests, then a random tie-break; everything
        # else by cost. The random key is drawn per decision so equal engines share the load.
        rng = _draws(self._rng, dry_run)
        keyed = []
        for i, (c, x) in enumerate(zip(candidates, costs, strict=True)):
            near = x.rank_tokens <= best + tie
            if near:
                key = (0, c.load.inflight_requests, x.rank_tokens, rng.random(), i)
            else:
                key = (1, 0, x.rank_tokens, rng.random(), i)
            keyed.append((key, i))
        keyed.sort()
        order = [i for _, i in keyed]
        chosen = costs[order[0]]
        if not dry_run:
            self._last_sent[chosen.engine] = self._decisions
            self._observe_decision(costs, chosen, prompt_tokens)
            self._observe_hit_loss(costs, chosen, prompt_tokens)
        near_count = sum(1 for x in costs if x.rank_tokens <= best + tie)
        if chosen.hit_tokens or chosen.cpu_hit_tokens:
            reason = (
                f"lowest expected TTFT: {chosen.cost_tokens:.0f} token-equivalents "
                f"({chosen.hit_tokens} cached{' speculatively' if chosen.speculative else ''}"
                f", {chosen.cpu_hit_tokens} on CPU, {chosen.queued_tokens:.0f} queued)"
            )
        else:
            reason = f"no cached prefix helps; least queued work ({chosen.cost_tokens:.0f})"
        if near_count > 1:
            reason += f"; {near_count} near-ties within {tie} tokens spread by in-flight count"
        return Decision(
            engine=chosen.engine,
            ranked=[candidates[i].engine for i in order],
            costs=costs,
            reason=reason,
            predicted_hit_tokens=chosen.hit_tokens,
        )


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        candidates: Sequence[Candidate],
        prompt_tokens: int,
        now: float,
        *,
        dry_run: bool = False,
        prompt: PromptKeys | None = None,
    ) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        i = self._next % len(candidates)
        if not dry_run:
            self._next += 1
        order = list(range(i, len(candidates))) + list(range(i))
        return Decision(
            engine=candidates[i].engine,
            ranked=[candidates[j].engine for j in order],
            costs=[],
            reason="round robin",
            predicted_hit_tokens=candidates[i].gpu_hit_tokens,
        )


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(
        self,
        candidates: Sequence[Candidate],
        prompt_tokens: int,
        now: float,
        *,
        dry_run: bool = False,
        prompt: PromptKeys | None = None,
    ) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        rng = _draws(self._rng, dry_run)
        keyed = sorted(
            (
                (c.load.inflight_requests + c.load.foreign_waiting()),
                rng.random(),
                i,
            )
            for i, c in enumerate(candidates)
        )
        order = [i for *_, i in keyed]
        return Decision(
            engine=candidates[order[0]].engine,
            ranked=[candidates[i].engine for i in order],
            costs=[],
            reason="fewest in-flight plus foreign waiting requests",
            predicted_hit_tokens=candidates[order[0]].gpu_hit_tokens,
        )


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(
        self,
        candidates: Sequence[Candidate],
        prompt_tokens: int,
        now: float,
        *,
        dry_run: bool = False,
        prompt: PromptKeys | None = None,
    ) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        order = list(range(len(candidates)))
        _draws(self._rng, dry_run).shuffle(order)
        return Decision(
            engine=candidates[order[0]].engine,
            ranked=[candidates[i].engine for i in order],
            costs=[],
            reason="random",
            predicted_hit_tokens=candidates[order[0]].gpu_hit_tokens,
        )


def make_policy(name: str, params: PolicyParams | None = None, seed: int | None = None) -> Policy:
    if name == "kvrouter":
        return KvRouterPolicy(params, seed)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy(seed)
    if name == "random":
        return RandomPolicy(seed)
    raise ValueError(f"unknown policy {name!r}")
