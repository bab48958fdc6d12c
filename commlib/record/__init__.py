"""What a rank writes while it runs: its structured log (`log`, its files `logfile`, their JSON
`codec`), its flight recorder and stack dumps (`flight`), its progress board in the store
(`board`), and how the files of a log dir are named and opened (`files`).

The runtime feeds all of it from the communicator's one path; the doctor (`commlib.observe`)
reads it back and nothing here imports the doctor.
"""
