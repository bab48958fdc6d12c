"""Observability: structured logs, the flight recorder, the progress board; reading them back: the
log model (`model`), the doctor (`doctor`, with its rules in `blame` and its tables in `stats`), traces.

`Communicator` feeds all of it from its one path; nothing here issues a collective.
"""
