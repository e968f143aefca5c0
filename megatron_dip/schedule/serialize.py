"""Compact, deterministic binary form of a `Plan`, shipped from the planner to every rank.

Layout (big-endian): magic `b"DIPPLAN"`, format version (u16), payload length (u32), CRC32 of
the payload (u32), payload. The payload is zlib-compressed JSON made of tables: module names,
sub-microbatch ids (works), stages, messages and tensor-spec groups are stored once and
referenced by index; each program is one flat list of integers (an opcode, then its operands).
Tables are filled in the order a fixed traversal of the plan meets their entries, so equal plans
give byte-identical output. Truncated, corrupted or foreign input raises `PlanError`.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

from .engine import PlanError
from .ir import (
    FORMAT_VERSION,
    RECOMPUTE_MODULES,
    Backward,
    BackwardInput,
    BackwardWeight,
    BatchTotals,
    Channels,
    ChunkSpec,
    Dependency,
    Forward,
    MemoryPolicy,
    MessageKey,
    MessageKind,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    Plan,
    Program,
    Recompute,
    Recv,
    ReduceGrads,
    Send,
    StageId,
    SubMicrobatch,
    TensorSpec,
    Wait,
    WorkId,
)

MAGIC = b"DIPPLAN"
_HEADER = struct.Struct(">7sHII")
_KINDS = list(MessageKind)
_RECOMPUTE = list(Recompute)
_OP_F, _OP_B, _OP_SEND, _OP_RECV, _OP_WAIT, _OP_BI, _OP_BW, _OP_REDUCE = range(8)


class _Tables:
    """Interning tables: each distinct entry gets the next index on first use."""

    def __init__(self) -> None:
        self.rows: dict[str, list[Any]] = {
            n: [] for n in ("names", "works", "stages", "msgs", "specs")
        }
        self._index: dict[tuple[str, Any], int] = {}

    def _intern(self, table: str, value: Any, row: Any) -> int:
        slot = (table, value)
        if slot not in self._index:
            self._index[slot] = len(self.rows[table])
            self.rows[table].append(row)
        return self._index[slot]

    def name(self, s: str) -> int:
        return self._intern("names", s, s)

    def work(self, w: WorkId) -> int:
        return self._intern("works", w, [self.name(w.module), w.microbatch, w.sub])

    def stage(self, s: StageId) -> int:
        return self._intern("stages", s, [self.work(s.work), s.chunk])

    def msg(self, k: MessageKey) -> int:
        row = [_KINDS.index(k.kind), self.stage(k.producer), self.stage(k.consumer)]
        return self._intern("msgs", k, row)

    def specs(self, specs: tuple[TensorSpec, ...]) -> int:
        row = [[t.name, list(t.shape), t.dtype] for t in specs]
        return self._intern("specs", specs, row)


# A Forward's memory policy is one integer: method index + methods x (N + _LAYER_SPAN x (K +
# _LAYER_SPAN x M)), M the bit set of its recompute modules (`RECOMPUTE_MODULES` order), so plans
# without offload and module recomputation (K = M = 0) keep the bytes they had before.
_LAYER_SPAN = 1 << 16


def _encode_policy(ins: Forward) -> int:
    memory = ins.memory
    for what, n in (("recompute", memory.layers), ("offload", memory.offload)):
        if not 0 <= n < _LAYER_SPAN:
            raise PlanError(f"{ins.stage}: cannot serialize {n} {what} layers")
    bits = sum(1 << RECOMPUTE_MODULES.index(m) for m in memory.modules)
    n = memory.layers + _LAYER_SPAN * (memory.offload + _LAYER_SPAN * bits)
    return _RECOMPUTE.index(memory.method) + len(_RECOMPUTE) * n


def _decode_forward(stage: StageId, code: int) -> Forward:
    n, method = divmod(code, len(_RECOMPUTE))
    n, layers = divmod(n, _LAYER_SPAN)
    bits, offload = divmod(n, _LAYER_SPAN)
    if bits >> len(RECOMPUTE_MODULES):
        raise PlanError(f"{stage}: unknown recompute modules in policy code {code}")
    modules = tuple(m for i, m in enumerate(RECOMPUTE_MODULES) if bits >> i & 1)
    return Forward(stage, MemoryPolicy(_RECOMPUTE[method], layers, offload, modules))


def _encode_program(p: Program, t: _Tables) -> list[int]:
    out: list[int] = []
    for ins in p.instructions:
        if isinstance(ins, Forward):
            mode = _encode_policy(ins)
            out += [_OP_F, t.stage(ins.stage), mode]
        elif isinstance(ins, (Backward, BackwardWeight)):
            out += [_split_opcode(ins), t.stage(ins.stage)]
        elif isinstance(ins, ReduceGrads):
            out += [_OP_REDUCE, t.name(ins.module), ins.chunk]
        elif isinstance(ins, (Send, Recv)):
            op = _OP_SEND if isinstance(ins, Send) else _OP_RECV
            out += [op, t.msg(ins.key), ins.peer, t.specs(ins.tensors)]
        elif isinstance(ins, Wait):
            out += [_OP_WAIT, len(ins.keys)] + [t.msg(k) for k in ins.keys]
        else:
            raise PlanError(f"rank {p.rank}: cannot serialize instruction {ins!r}")
    return out


def _split_opcode(ins: Backward | BackwardWeight) -> int:
    if isinstance(ins, BackwardInput):
        return _OP_BI
    return _OP_BW if isinstance(ins, BackwardWeight) else _OP_B


_STAGE_OPS: dict[int, type] = {_OP_B: Backward, _OP_BI: BackwardInput, _OP_BW: BackwardWeight}


def _encode(plan: Plan) -> dict[str, Any]:
    t = _Tables()
    modules = [
        [
            t.name(m.name),
            m.num_layers,
            m.trainable,
            [[c.rank, c.layer_start, c.layer_end] for c in m.chunks],
        ]
        for m in plan.placement.modules
    ]
    subs = [
        [
            t.work(s.work),
            s.instance_start,
            s.instance_end,
            s.tokens,
            s.padded_tokens,
            s.attention_pairs,
            s.input_tokens,
            s.context_tokens,
            s.context_pairs,
        ]
        for s in plan.submicrobatches
    ]
    deps = [[t.work(d.producer), t.work(d.consumer)] for d in plan.dependencies]
    programs = [_encode_program(p, t) for p in plan.programs]
    tot = plan.totals
    return {
        "head": [plan.iteration, plan.replica, plan.forward_only, plan.name, plan.num_ranks],
        "channels": plan.channels.value,
        "totals": [
            tot.num_microbatches,
            tot.num_samples,
            tot.num_loss_tokens,
            tot.data_parallel_size,
        ],
        "modules": modules,
        "mbs": [[m.index, list(m.sample_ids), m.seq_tokens] for m in plan.microbatches],
        "subs": subs,
        "deps": deps,
        "programs": programs,
        **t.rows,
    }


def plan_to_bytes(plan: Plan) -> bytes:
    """Serialize `plan`; equal plans give identical bytes."""
    text = json.dumps(_encode(plan), separators=(",", ":"), sort_keys=True)
    payload = zlib.compress(text.encode(), 9)
    return _HEADER.pack(MAGIC, plan.version, len(payload), zlib.crc32(payload)) + payload


class _Decoder:
    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d
        self.names: list[str] = [str(n) for n in d["names"]]
        self.works = [WorkId(self.names[m], int(mb), int(s)) for m, mb, s in d["works"]]
        self.stages = [
            StageId(w.module, int(c), w.microbatch, w.sub)
            for w, c in ((self.works[i], c) for i, c in d["stages"])
        ]
        self.msgs = [MessageKey(_KINDS[k], self.stages[p], self.stages[c]) for k, p, c in d["msgs"]]
        self.specs = [
            tuple(TensorSpec(str(n), tuple(int(x) for x in shape), str(dt)) for n, shape, dt in g)
            for g in d["specs"]
        ]

    def placement(self) -> Placement:
        modules = []
        for name_i, layers, trainable, chunks in self.d["modules"]:
            name = self.names[name_i]
            specs = tuple(ChunkSpec(name, i, r, a, b) for i, (r, a, b) in enumerate(chunks))
            modules.append(ModuleLayout(name, layers, bool(trainable), specs))
        return Placement(int(self.d["head"][4]), tuple(modules))

    def program(self, rank: int, code: list[int]) -> Program:
        out: list[Any] = []
        i = 0
        while i < len(code):
            op = code[i]
            if op == _OP_F:
                out.append(_decode_forward(self.stages[code[i + 1]], int(code[i + 2])))
                i += 3
            elif op in _STAGE_OPS:
                out.append(_STAGE_OPS[op](self.stages[code[i + 1]]))
                i += 2
            elif op == _OP_REDUCE:
                out.append(ReduceGrads(self.names[code[i + 1]], int(code[i + 2])))
                i += 3
            elif op in (_OP_SEND, _OP_RECV):
                cls = Send if op == _OP_SEND else Recv
                out.append(cls(self.msgs[code[i + 1]], int(code[i + 2]), self.specs[code[i + 3]]))
                i += 4
            elif op == _OP_WAIT:
                n = code[i + 1]
                out.append(Wait(tuple(self.msgs[j] for j in code[i + 2 : i + 2 + n])))
                i += 2 + n
            else:
                raise ValueError(f"unknown opcode {op} in program of rank {rank}")
        return Program(rank, tuple(out))

    def plan(self, version: int) -> Plan:
        d = self.d
        iteration, replica, forward_only, name, _ = d["head"]
        # Rows list the fields in order; rows written before the optional context fields existed
        # are shorter and take their defaults.
        subs = tuple(
            SubMicrobatch(w.module, w.microbatch, w.sub, *map(int, rest))
            for w, rest in ((self.works[row[0]], row[1:]) for row in d["subs"])
        )
        return Plan(
            iteration=int(iteration),
            placement=self.placement(),
            microbatches=tuple(MicrobatchInfo(int(i), tuple(s), int(n)) for i, s, n in d["mbs"]),
            submicrobatches=subs,
            dependencies=tuple(Dependency(self.works[a], self.works[b]) for a, b in d["deps"]),
            totals=BatchTotals(*(int(x) for x in d["totals"])),
            programs=tuple(self.program(r, code) for r, code in enumerate(d["programs"])),
            replica=int(replica),
            forward_only=bool(forward_only),
            name=str(name),
            channels=Channels(d["channels"]),
            version=version,
        )


def plan_from_bytes(data: bytes) -> Plan:
    """Deserialize a plan written by `plan_to_bytes`; raise `PlanError` on bad input."""
    if len(data) < _HEADER.size:
        raise PlanError(
            f"plan data truncated: {len(data)} bytes, the header alone is {_HEADER.size}"
        )
    magic, version, length, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise PlanError(
            f"not a serialized plan: starts with {bytes(data[:7])!r}, expected {MAGIC!r}"
        )
    if version != FORMAT_VERSION:
        raise PlanError(f"plan format version {version}, this code reads version {FORMAT_VERSION}")
    payload = data[_HEADER.size :]
    if len(payload) != length:
        raise PlanError(
            f"plan data truncated or padded: payload {len(payload)} bytes, header says {length}"
        )
    if zlib.crc32(payload) != crc:
        raise PlanError("plan data corrupted: CRC32 mismatch")
    try:
        decoded = json.loads(zlib.decompress(payload))
        return _Decoder(decoded).plan(version)
    except (ValueError, KeyError, IndexError, TypeError, zlib.error) as e:
        # The CRC matched, so this is a writer bug or forged data, not line noise.
        raise PlanError(f"malformed plan payload: {type(e).__name__}: {e}") from None
