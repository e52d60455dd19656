"""A step's generation on vLLM engines that live across calls, so the driver can look between chunks of
engine steps and move unfinished requests between the replicas' engines (``run.rollout.midstep`` with
``run.rollout.engine: vllm``): the same ``gen_open`` / ``gen_run`` / ``gen_migrate`` / ``gen_close`` calls
as the native engine's session (``runtime.engines.native.session``), answered with the same typed values.

``VllmSession`` runs in the engine's process: every row of the replica is a request (named by its global
row and an incarnation, so a row that moves away and back is a new request), stepped one engine step at a
time; an active row is one that produced a token (the engine holds its KV blocks), a queued one has not.

A move is an abort and a re-prefill: vLLM's KV blocks stay in its engine, so a moved row's prompt and the
tokens it generated so far become the receiving engine's prompt, which generates the rest (its length
limit shortened by them). ``migrate_requests`` is the worker's part, two-phase like the native migration:
the sources read their moving rows without stopping them, every worker of the world exchanges them
(``all_gather_object`` over the control group), the receivers add them, and a vote commits: only then do
the sources abort theirs; otherwise the receivers abort what they added and every row runs on where it
was. The moved row's continuation samples from its own seed, ``stream_seed(row's seed, tokens so far)``:
the same distribution as unmoved, reproducible for a seed, but other tokens than an unmoved row's (the
native engine's moves carry the sampling stream and are bit-identical). Greedy rows are identical.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nereus.elastic.kvplan import GenPlacement, MigrationPlan
from nereus.elastic.plan import KVSend
from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.comm.transfer import TransferComm
from nereus.runtime.engines.answers import ClosedReplica, MigrationOutcome
from nereus.runtime.engines.sampling import SamplingParams, row_limit, stream_seed
from nereus.spec.generation import ReplicaStatus, SequenceRecord

Response = tuple[list[int], list[float]]


def row_sampling(params: SamplingParams, row: int, before: int = 0):
    """``vllm.SamplingParams`` of global row ``row`` that generated ``before`` tokens elsewhere already:
    temperature, top-k, top-p, what is left of its length limit (``row_limit``: a resumed row's is shortened),
    EOS and ``stop_token_ids`` as stop tokens, its own seed (a moved row's derived from it and ``before``),
    and the sampled token's log-prob (``logprobs=0``). None when nothing is left to generate."""
    from vllm import SamplingParams as VllmSampling

    left = row_limit(params, row) - before
    if left <= 0:
        return None
    seed = stream_seed(params.seed, row) if before == 0 else stream_seed(stream_seed(params.seed, row), before)
    # top_k: vLLM's "off" is 0 (it accepts -1 too), Nereus's -1 or 0
    return VllmSampling(n=1, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
                        max_tokens=left, stop_token_ids=sorted(params.stops) or None, seed=seed, logprobs=0,
                        detokenize=False)


def answer_of(completion) -> Response:
    """A vLLM completion's tokens and their log-probs (so far, for one still running)."""
    tokens = list(completion.token_ids)
    return tokens, [float(step[t].logprob) for step, t in zip(completion.logprobs, tokens, strict=True)]


@dataclass(frozen=True)
class MovedRow:
    """An unfinished row on the wire: its prompt and what it generated so far (tokens, log-probs)."""

    row: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logps: tuple[float, ...]


@dataclass
class Row:
    """One row on this engine: its prompt, what it brought from another replica (``before``), what its
    current request generated (``latest``), and that request's id (None once finished or released)."""

    prompt: list[int]
    before: Response = field(default_factory=lambda: ([], []))
    latest: Response = field(default_factory=lambda: ([], []))
    request: str | None = None

    def response(self) -> Response:
        return self.before[0] + self.latest[0], self.before[1] + self.latest[1]


class VllmSession:
    """A replica's rows as requests of ``llm`` (a ``vllm.LLM``), stepped in chunks (module docstring)."""

    def __init__(self, llm, prompts: list[list[int]], first_row: int, params: SamplingParams,
                 replica: int) -> None:
        self.engine, self.params, self.replica = llm.llm_engine, params, replica
        self.rows: dict[int, Row] = {}
        self.done: dict[int, Response] = {}
        self.incarnation = 0
        for i, prompt in enumerate(prompts):
            self._add(first_row + i, Row(list(prompt)))

    def _add(self, row: int, state: Row) -> None:
        """Submit ``row`` (from its prompt and what it generated before) as a new request."""
        from vllm.inputs import TokensPrompt

        self.rows[row] = state
        sampling = row_sampling(self.params, row, len(state.before[0]))
        if sampling is None:  # nothing left to generate: finished already
            self.done[row] = state.response()
            return
        self.incarnation += 1
        state.request = f"nereus-seq-{row}-{self.incarnation}"
        self.engine.add_request(state.request, TokensPrompt(prompt_token_ids=state.prompt + state.before[0]),
                                sampling)

    def _live(self) -> dict[str, int]:
        return {s.request: row for row, s in self.rows.items() if s.request is not None}

    def run(self, iterations: int) -> ReplicaStatus:
        """Up to ``iterations`` engine steps (fewer when every request ended); the replica's status."""
        t0, rows, ran, finished = time.perf_counter(), 0, 0, []
        live = self._live()
        while ran < iterations and live:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"the vLLM engine holds none of the session's {len(live)} unfinished requests")
            rows += len(live)
            for out in self.engine.step():
                row = live.get(out.request_id)
                if row is None:
                    continue
                state = self.rows[row]
                state.latest = answer_of(out.outputs[0])
                if out.finished:
                    state.request = None
                    self.done[row] = state.response()
                    finished.append((row, len(self.done[row][0])))
                    del live[out.request_id]
            ran += 1
        active, queued = self.records()
        return ReplicaStatus(self.replica, active, queued, tuple(finished), ran, rows, time.perf_counter() - t0)

    def records(self) -> tuple[tuple[SequenceRecord, ...], tuple[SequenceRecord, ...]]:
        """Unfinished rows as (active, queued) records: an active row's KV blocks cover its context."""
        active, queued = [], []
        for row, s in sorted(self.rows.items()):
            if s.request is None:
                continue
            tokens = len(s.before[0]) + len(s.latest[0])
            started = bool(s.latest[0])
            record = SequenceRecord(row, self.replica, len(s.prompt), tokens,
                                    len(s.prompt) + tokens if started else 0)
            (active if started else queued).append(record)
        return tuple(active), tuple(queued)

    def peek(self, rows: list[int]) -> list[MovedRow]:
        """The given unfinished rows as they stand, left running (a move's first phase)."""
        missing = [r for r in rows if r not in self.rows or self.rows[r].request is None]
        if missing:
            raise ValueError(f"rows {missing} are not running on replica {self.replica}'s engine")
        return [MovedRow(r, tuple(self.rows[r].prompt), *map(tuple, self.rows[r].response())) for r in rows]

    def adopt(self, moved: list[MovedRow]) -> None:
        """Rows moved in: each a new request re-prefilling its prompt and the tokens it brought."""
        for m in moved:
            self._add(m.row, Row(list(m.prompt), (list(m.tokens), list(m.logps))))

    def release(self, rows: list[int]) -> None:
        """Rows moved away (or an adoption undone): their requests aborted, the rows dropped here."""
        ids = [self.rows[r].request for r in rows if r in self.rows and self.rows[r].request is not None]
        if ids:
            self.engine.abort_request(ids)
        for r in rows:
            self.rows.pop(r, None)
            self.done.pop(r, None)

    def close(self) -> ClosedReplica:
        """Every request run to the end; every row this engine finished (its own and those moved in)."""
        last = self.run(2**62)
        return ClosedReplica(self.replica, dict(self.done), last.iterations, last.rows, last.busy_s)


def moving_rows(plan: MigrationPlan, where: GenPlacement) -> tuple[dict[int, list[int]], dict[int, int], bool]:
    """From a migration plan between the replicas of ``where``: rows leaving each engine owner (global
    rank → rows), each moving row's destination owner, and whether any move asks for KV caches (which a
    vLLM engine cannot send: its moves re-prefill). The rows' records travel in the plan's ``KVSend``
    steps from the source replica's output rank to each rank of the destination replica; its output rank
    owns the engine."""
    owners = {where.output_rank(d) for d in range(where.layout.dp)}
    leaving: dict[int, list[int]] = {}
    to: dict[int, int] = {}
    kv = False
    for step in plan.steps:
        if isinstance(step, KVSend) and step.dst in owners:
            for part in step.parts:
                if part.state == "kv":
                    kv = True
                    continue
                for piece in part.pieces:
                    leaving.setdefault(step.src, []).append(piece.seq)
                    to[piece.seq] = step.dst
    return leaving, to, kv


def migrate_requests(engine, plan: MigrationPlan, where: GenPlacement, me: int, comm: TransferComm,
                     faults: FaultHook) -> MigrationOutcome:
    """This worker's part of moving rows between the engines of ``where`` (``engine``: its
    ``ReplicaEngine``, or None where it owns none); every worker of the world calls it (module docstring)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    leaving, to, kv = moving_rows(plan, where)
    error, mine, adopted = "", leaving.get(me, []), []  # adopted: undone on a failed vote, even a partial add
    outgoing: list[MovedRow] = []
    try:
        if kv:
            raise ValueError("a vLLM engine moves sequences by re-prefill only (run.rollout.midstep.transfer: "
                             "refill), not with their KV caches")
        faults.at("migration.transfer")
        if mine:
            outgoing = engine.session_peek(mine)
    except Exception as exc:  # noqa: BLE001 - voted on below: every worker learns the cause
        error = f"{type(exc).__name__}: {exc}"
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outgoing, group=comm.control)
    incoming = [m for part in gathered for m in part or () if to.get(m.row) == me]
    if not error and incoming:
        adopted = [m.row for m in incoming]
        try:
            engine.session_adopt(incoming)
            faults.at("migration.install")
        except Exception as exc:  # noqa: BLE001 - voted on below
            error = f"{type(exc).__name__}: {exc}"
    verdict = comm.vote(error)
    if verdict:
        if adopted:
            engine.session_release(adopted)
        return MigrationOutcome(False, verdict, time.perf_counter() - t0)
    if mine:
        engine.session_release(mine)
    return MigrationOutcome(True, "", time.perf_counter() - t0, tuple(adopted), tuple(mine))
