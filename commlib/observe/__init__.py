"""Observability: structured logs, the flight recorder, the progress board, the doctor, traces.

`Communicator` feeds all of it from its one path; nothing here issues a collective.
"""
