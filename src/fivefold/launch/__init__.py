"""fivefold.launch: starting the processes of a run and the host they run on.

`launcher` (torchrun on this machine, an sbatch script for a cluster), `agent` (torchrun's
agent with quiet failures), `rank_report` (why the ranks stopped, said once), `shielded_import`
(Ctrl-C held while torch loads), `threads` (how many CPU threads, and how they wait),
`host_memory` (freed memory kept in the process) and `machine_memory` (free memory, OOM kills).
Every program's entry imports `shielded_import` first, so this package imports nothing here.
"""
