"""The local mesh `kvmesh up` runs: its settings, its processes started, supervised and
stopped, its rollouts."""
