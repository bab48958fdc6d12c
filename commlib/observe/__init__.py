"""Observability: structured logs, the flight recorder, the progress board; reading them back: the
log model (`model`, made of `records`, fed by `reading` (and `typed`) into the `fold`, on two
cores by `halves`, with `dumps` and `position`), the doctor (`doctor`, with its rules in `blame`,
`mismatch` and `hangs`, what they find in `findings`, and its tables in `stats`), traces.

`Communicator` feeds all of it from its one path; nothing here issues a collective.
"""
