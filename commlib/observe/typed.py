"""The two lines every collective writes, decoded into a typed record instead of a dict.

`collective.start` and `collective.end` are almost every line of a run's logs, and the doctor's
full read spent most of its time making a dict of each (a dozen keys, each a new object) to
read five of them. `decode_collective(raw)` decodes such a line with msgspec into a
`CollectiveLine`, a struct of the fields commlib's writer puts in them (`EventWriter`, fed by
`Communicator`): about half the CPU of a dict. The builder (`commlib.observe.builder`) reads its
fields by attribute; everything else that holds an event (a call's start and end, a rank's
last event) reads it as it reads a dict (`get`, `[]`, `in`).

Only a line that is exactly such a line is decoded so: a collective's start or end (not a
send's or a recv's: their `peer` is a rank), at info level, with no field the struct lacks
(`forbid_unknown_fields`: a caller's own `commlib.context(...)` field makes a line a dict
again), each field of the type the writer writes. Any other line gives None, and is read as a
dict, the general way; so is every line where msgspec is not installed (the doctor reads
logs where commlib's dependencies may not all be): the same model either way, the typed one
faster.
"""

from __future__ import annotations

from typing import Any, Literal

try:
    import msgspec
except ImportError:  # the general path reads every line (module docstring)
    msgspec = None  # type: ignore[assignment]

COLLECTIVE_EVENTS = ("collective.start", "collective.end")

# A key the line does not have (a field left at its default; not null, which is None).
UNSET: Any = msgspec.UNSET if msgspec is not None else object()

if msgspec is not None:

    class CollectiveLine(msgspec.Struct, forbid_unknown_fields=True, gc=False, kw_only=True):
        """One `collective.start` or `collective.end` line of a collective (not a send/recv).

        The fields the builder reads on every line are required and typed (a line without them,
        or with another type, is not one of these); the others are as JSON gives them, UNSET
        where the line has no such key (`get` tells a key absent from one that is null). The
        fields are in the order the writer writes them (`Communicator`'s fields, the caller's
        context, the clocks, the process's): msgspec decodes keys in its struct's order fastest
        (a third less CPU than another order)."""

        op: str
        seq: int
        shapes: Any = UNSET
        dtype: Any = UNSET
        bytes: Any = UNSET
        root: Any = UNSET
        peer: None = UNSET  # a send's or recv's is a rank: not one of these
        deadline_s: Any = UNSET
        async_op: Any = UNSET
        reduce_op: Any = UNSET
        duration_s: Any = UNSET
        status: Any = UNSET
        wait_s: Any = UNSET
        done_before_wait: Any = UNSET
        event: Literal["collective.start", "collective.end"]
        step: Any = UNSET
        phase: Any = UNSET
        label: Any = UNSET
        ts_ns: int
        mono_ns: Any = UNSET
        comm: str
        backend: Any = UNSET
        comm_rank: Any = UNSET
        comm_size: Any = UNSET
        rank: int
        pid: int
        attempt: int

        # Read as a dict is read, by whoever holds the event (a call, a rank's place).
        def get(self, key: str, default: Any = None) -> Any:
            value = getattr(self, key, UNSET) if key in _FIELDS else UNSET
            return default if value is UNSET else value

        def __getitem__(self, key: str) -> Any:
            value = self.get(key, UNSET)
            if value is UNSET:
                raise KeyError(key)
            return value

        def __contains__(self, key: object) -> bool:
            return isinstance(key, str) and self.get(key, UNSET) is not UNSET

        def to_dict(self) -> dict[str, Any]:
            """The line's event as a dict (for the general path), its keys in the struct's order."""
            return {k: v for k in _FIELDS_IN_ORDER if (v := getattr(self, k)) is not UNSET}

    _FIELDS_IN_ORDER = CollectiveLine.__struct_fields__
    _FIELDS = frozenset(_FIELDS_IN_ORDER)
    _DECODE = msgspec.json.Decoder(CollectiveLine).decode

    _DECODE_ARRAY = msgspec.json.Decoder(list[CollectiveLine]).decode

    def decode_collective(raw: bytes) -> CollectiveLine | None:
        """`raw` as a `CollectiveLine`, or None where it is not exactly one (module docstring)."""
        try:
            return _DECODE(raw)
        except msgspec.DecodeError:  # not JSON, or (a ValidationError) not of this shape
            return None

    def decode_collectives(lines: list[bytes]) -> list[CollectiveLine] | None:
        """Each of `lines` (whole lines) as a `CollectiveLine`, in one call over them as one JSON
        array; None where any is not one. Lines that are each an object decode to as many
        items. Two objects on one line, or one object across two lines, are valid JSON in the
        array too: the count of items refuses either alone. Both at once in one chunk could
        keep the count, and go unseen; commlib's writer writes neither (one object a line, no
        newline inside one), nor does a kill (it cuts a line short: no newline)."""
        try:
            decoded = _DECODE_ARRAY(b"[" + b",".join(lines) + b"]")
        except msgspec.DecodeError:
            return None
        return decoded if len(decoded) == len(lines) else None

else:

    class CollectiveLine:  # type: ignore[no-redef]  # never made: nothing decodes into it
        pass

    def decode_collective(raw: bytes) -> CollectiveLine | None:
        return None

    def decode_collectives(lines: list[bytes]) -> list[CollectiveLine] | None:
        return None


# An event as the model holds it (a call's start and end, a rank's last event): a dict, or a
# `CollectiveLine` read as one.
Event = dict[str, Any] | CollectiveLine
