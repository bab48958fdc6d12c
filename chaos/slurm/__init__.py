"""chaos under Slurm: one harness per node of an sbatch job, whole-job preemption and
requeue, the time-limit notice, a lost node; and a local Slurm cluster to run them on
(`chaos.slurm.cluster`)."""
