"""The doctor: a run's logs read back and judged. The log model (`run_logs`, made of `records`,
fed by `reading` (and `typed`) to the `builder`, with `dumps`, `stacks` and `position`; `events`
for the events themselves), the diagnosis (`diagnosis`, with its rules in `blame`, `mismatch` and
`hangs`, what they find in `findings`, and its tables in `stats`), the verdict read from the end
(`verdict_from_end`), the rule for replica groups (`replicas`), traces (`trace`).

It reads what a rank writes (`commlib.record`) and sits on top: nothing of the runtime imports it.
"""
