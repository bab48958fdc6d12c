"""The doctor: a run's logs read back and judged. The log model (`model`, made of `records`, fed by
`reading` (and `typed`) into the `fold`, with `dumps`, `stacks` and `position`; `events` for the
events themselves), the doctor (`doctor`, with its rules in `blame`, `mismatch` and `hangs`, what
they find in `findings`, and its tables in `stats`), the verdict read from the end (`tail`), the
rule for replica groups (`replicas`), traces (`trace`).

It reads what a rank writes (`commlib.record`) and sits on top: nothing of the runtime imports it.
"""
